"""jobs/benchmark.py end to end on a reduced setting (records, forced candidates, plot), and
the parts of the benchmark module it drives (profiling/benchmark/)."""

from __future__ import annotations

import json

import pytest

from pipeline.model.linear import resolve_compute_mode
from profiling.benchmark.prefill import prompt_flops
from profiling.benchmark.records import BatchRun, Record, search_share
from profiling.benchmark.runs import run_order
from profiling.benchmark.summary import pearson, summarize
from profiling.benchmark.tables import format_forced, format_summary
from profiling.benchmark.verify_costs import TARGET_BATCH_SPEEDUP
from tests.builders import load_job


def test_pearson():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 2], [1, 2]) is None


def test_strategies_by_bare_name_or_with_a_mode():
    benchmark = load_job("benchmark.py", "benchmark_script")
    default = resolve_compute_mode("auto", "cpu").value  # fp16w-bf16 where the CPU has bf16 units
    assert benchmark.parse_strategy("knapspec") == ("knapspec", default)  # as generate.py takes it
    assert benchmark.parse_strategy("ar:auto") == ("ar", default)
    assert benchmark.parse_strategy(" hf:fp32") == ("hf", "fp32")
    assert benchmark.parse_strategy("ar:fp16w+matmul") == ("ar", "fp16w+matmul")  # the kernel off, beside it
    assert benchmark.parse_strategy("ar:+matmul") == ("ar", f"{default}+matmul")
    assert benchmark.parse_strategy("ar:fp16w-bf16") == ("ar", "fp16w-bf16")
    for bad, says in [
        ("knapspeed", "unknown strategy"),
        ("ar:fp8", "unknown dtype"),
        ("ar:fp16w:x", "unknown dtype"),
        ("ar:fp16w+bmm", "only route"),
    ]:
        with pytest.raises(SystemExit) as stop:
            benchmark.parse_strategy(bad)
        message = str(stop.value)
        assert message.startswith("error: ") and says in message and "\n" not in message


def test_runs_alternate_their_order():
    pairs = [("ar", "fp16w"), ("knapspec", "fp16w"), ("ar-control", "fp16w")]
    assert run_order(pairs, 0) == pairs
    assert run_order(pairs, 1) == pairs[::-1]
    assert run_order(pairs, 2) == pairs


def test_a_batch_search_counts_against_the_batch_decode_time():
    from pipeline.decoding.loop import GenerationResult
    from pipeline.decoding.stats import GenerationStats

    def result(optimize_s=None, decode_s=10.0):
        extra = {} if optimize_s is None else {"optimize_s": optimize_s}
        return GenerationResult([1, 2], GenerationStats(decode_s=decode_s), "length", extra)

    # A batch planner's search of 0.4 s, a quarter carried by each of four requests, and a
    # last request's own search of 0.1 s: 0.5 s in which none of the batch decoded.
    batch = [result(0.1), result(0.1), result(0.1, decode_s=6.0), result(0.2, decode_s=8.0)]
    run = BatchRun(batch, decode_s=10.0, prefill_s=1.0)
    assert search_share(run) == pytest.approx(0.05)
    assert search_share(BatchRun([result(0.3)], decode_s=6.0, prefill_s=1.0)) == pytest.approx(0.05)
    assert search_share(BatchRun([result(), result()], decode_s=5.0, prefill_s=1.0)) is None


def test_the_full_batch_rate_counts_only_the_steps_the_whole_batch_ran():
    from pipeline.decoding.loop import GenerationResult
    from pipeline.decoding.scheduler import StepRecord
    from pipeline.decoding.stats import GenerationStats

    results = [GenerationResult([1] * 9, GenerationStats(), "length") for _ in range(3)]
    # Three requests: two steps of all three (6 and 9 tokens), then one left alone at a slower rate.
    steps = [StepRecord(3, 6, 0.5), StepRecord(3, 9, 0.5), StepRecord(1, 2, 2.0)]
    run = BatchRun(results, decode_s=3.0, prefill_s=1.0, steps=steps)
    assert run.tokens_per_s == pytest.approx(24 / 3.0)
    assert run.full_batch_tokens_per_s == pytest.approx(15 / 1.0)
    assert BatchRun(results, decode_s=3.0, prefill_s=1.0).full_batch_tokens_per_s is None  # untimed steps


def record(strategy, context, speedup, predicted=None, measured=10.0, share=None, equal=True):
    return Record(
        strategy=strategy, dtype="fp16w", doc_id="d", context_tokens=context, new_tokens=64,
        tokens_per_s=measured, prefill_s=1.0, speedup_vs_ar=speedup, acceptance_rate=0.0, mean_accepted_len=1.0,
        tokens_equal_ar=equal, repeats=2, predicted_tpt=predicted, dp_overhead_frac=share, skipped_attn=None,
        skipped_mlp=None,
    )  # fmt: skip


def test_summary_per_length_and_prediction_error():
    records = [
        record("ar", 503, 1.0),
        record("knapspec", 503, 0.9, predicted=12.0, share=0.02),
        record("knapspec", 498, 1.1, predicted=8.0, share=0.04),
        record("knapspec", 2040, 1.0, predicted=10.0, share=0.0, equal=False),
        record("lookup", 2040, 2.0),
    ]
    forced = [{"predicted_tpt": 10.0, "measured_tpt": 8.0}] * 2 + [{"predicted_tpt": 6.0, "measured_tpt": 5.0}]
    summary = summarize(records, forced, ("ar", "fp16w"))
    assert set(summary) == {"knapspec:fp16w", "lookup:fp16w", "forced"}  # not the reference itself
    knapspec = summary["knapspec:fp16w"]
    assert knapspec["by_length"][500] == pytest.approx({"geomean": (0.9 * 1.1) ** 0.5, "min": 0.9, "max": 1.1, "n": 2})
    assert knapspec["by_length"][2000]["n"] == 1 and knapspec["rows"] == 3 and knapspec["min"] == 0.9
    assert knapspec["max_search_share"] == 0.04 and knapspec["mean_search_share"] == pytest.approx(0.02)
    assert knapspec["mean_abs_prediction_error"] == pytest.approx((0.2 + 0.2 + 0.0) / 3)
    assert not knapspec["all_tokens_equal_ar"]
    assert summary["lookup:fp16w"]["mean_abs_prediction_error"] is None
    assert summary["forced"]["mean_abs_prediction_error"] == pytest.approx(0.25 * 2 / 3 + 0.2 / 3)
    table = format_summary(summary, ("ar", "fp16w"))
    assert "| ~500 | 0.99× (0.90–1.10) |" in table and "| knapspec:fp16w | 3 | NO | 2.0%, 4.0% | 13% |" in table


@pytest.mark.slow
def test_benchmark_writes_records_and_plot(tmp_path):
    benchmark = load_job("benchmark.py", "benchmark_script")
    code = benchmark.main(
        [
            "--ids", "gao-26-109008",
            "--context-lengths", "200",
            "--max-new-tokens", "8",
            "--repeats", "2",
            "--strategies", "ar:fp16w,knapspec:fp16w,lookup:fp16w",
            "--no-fallback", "--forced", "2", "--control",
            "--output", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    out = json.loads((tmp_path / "benchmark.json").read_text())
    records = {r["strategy"]: r for r in out["records"]}
    assert set(records) == {"ar", "knapspec", "lookup", "ar-control"}
    for r in records.values():
        assert r["tokens_equal_ar"] and r["repeats"] == 2 and r["measured_tpt"] == r["tokens_per_s"] > 0
    assert records["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert records["knapspec"]["dp_overhead_frac"] is not None
    assert set(out["summary"]) == {"knapspec:fp16w", "lookup:fp16w", "ar-control:fp16w", "forced"}
    assert out["summary"]["ar-control:fp16w"]["rows"] == 1
    assert 1 <= len(out["forced_candidates"]) <= 2
    assert all(f["predicted_tpt"] > 0 and f["measured_tpt"] > 0 for f in out["forced_candidates"])
    assert all(f["predicted_vs_ar"] > 0 for f in out["forced_candidates"])
    table = format_forced(out["forced_candidates"])
    assert table.count("| gao-26-109008 |") == len(out["forced_candidates"])
    assert (tmp_path / "benchmark.png").stat().st_size > 10_000


@pytest.mark.slow
def test_benchmark_across_batch_sizes(tmp_path):
    """--batch-sizes: every strategy at every size on the same prompts, transformers' generate()
    on a left-padded batch beside ours; speed-ups against ar at the same size and at size 1."""
    benchmark = load_job("benchmark.py", "benchmark_script")
    code = benchmark.main(
        [
            "--ids", "gao-26-109008", "--context-lengths", "150", "--max-new-tokens", "24", "--repeats", "1",
            "--strategies", "ar:fp16w,lookup:fp16w,hf:fp16w,knapspec:fp16w,ar:fp16w+matmul", "--batch-sizes", "1,3",
            "--output", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    out = json.loads((tmp_path / "benchmark.json").read_text())
    matmul = {(r["strategy"], r["batch_size"]): r for r in out["records"] if r["dtype"] == "fp16w+matmul"}
    records = {(r["strategy"], r["batch_size"]): r for r in out["records"] if r["dtype"] == "fp16w"}
    assert set(records) == {(name, size) for name in ("ar", "lookup", "hf", "knapspec") for size in (1, 3)}
    # The matmuls' attention ran beside the kernel, against the same reference.
    assert set(matmul) == {("ar", 1), ("ar", 3)} and all(r["speedup_vs_ar"] > 0 for r in matmul.values())
    # KnapSpec in a batch plans for the batch: its planner decided (searched, or found no time for a
    # search in its share of so short a decode: which, depends on this machine's speeds), and the
    # step time was predicted.
    planned = records[("knapspec", 3)]
    assert planned["batch_searches"] + planned["batch_postponed"] >= 1 and planned["step_error_online"] is not None
    assert records[("knapspec", 1)]["batch_searches"] is None
    assert records[("ar", 3)]["speedup_vs_ar"] == pytest.approx(1.0)
    assert records[("ar", 3)]["full_batch_speedup_vs_ar"] == pytest.approx(1.0)
    assert (
        records[("lookup", 3)]["full_batch_tokens_per_s"] > 0 and records[("hf", 3)]["full_batch_tokens_per_s"] is None
    )
    assert records[("ar", 1)]["speedup_vs_batch1"] == pytest.approx(1.0)
    assert records[("ar", 3)]["speedup_vs_batch1"] > 0
    for (name, _), r in records.items():
        assert r["tokens_per_s"] > 0
        if name != "hf":  # generate() in fp16w rounds its own way
            assert r["tokens_equal_ar"], r
    assert "lookup:fp16w@3" in out["summary"]
    assert [b["dtype"] for b in out["verify_cost"]] == ["fp16w", "fp16w+matmul"]
    for breakdown in out["verify_cost"]:
        assert breakdown["linears_1_s"] > 0 and breakdown["attention_4_s"] > 0
        assert breakdown["step_over_linears_and_attention"] > 0 and breakdown["linears_4_over_1"] > 0
    # What drafting costs the batch of three, and the acceptance that would repay it.
    (batch_verify,) = out["batch_verify_cost"]
    assert batch_verify["batch_size"] == 3 and batch_verify["step_1_s"] > 0
    for drafted in (1, 2, 4):
        ratio = batch_verify[f"rows_{drafted + 1}_over_1"]
        assert ratio > 0
        assert batch_verify[f"accepted_needed_{drafted}"] == pytest.approx(TARGET_BATCH_SPEEDUP * ratio - 1)


def test_prompt_flops_count_every_layers_products_and_causal_attention():
    from pipeline.model.spec import ModelSpec

    spec = ModelSpec(
        model_type="llama", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
        intermediate_size=16, vocab_size=10, rms_norm_eps=1e-5, attention_bias=False, qk_norm=False,
        tie_word_embeddings=True, max_position_embeddings=64,
    )  # fmt: skip
    # qkv 16x8, o 8x8, gate_up 32x8, down 8x16: 576 multiply-adds a token, 2 FLOPs each
    products = 2 * 576 * 3
    attention = 4 * 2 * 4 * (3 * 4 / 2)  # two products of heads x head_dim over 6 query-key pairs
    assert prompt_flops(spec, 3) == 2 * (products + attention)


@pytest.mark.slow
def test_prefill_benchmark_times_modes_side_by_side(tmp_path, capsys):
    """--prefill: every mode reads the same prompts in turn; tokens/s, the ratio to the first mode,
    the fractions of the matmul peaks measured in the same run, one layer's attention of each
    prompt's last chunk (flash, and ours where the CPU takes it), and the weights each mode holds."""
    benchmark = load_job("benchmark.py", "benchmark_script")
    code = benchmark.main(
        [
            "--prefill", "fp16w,fp16w-bf16", "--ids", "gao-26-109008", "--context-lengths", "200,400",
            "--repeats", "2", "--output", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    out = json.loads((tmp_path / "prefill_benchmark.json").read_text())
    rows = {(r["mode"], r["prompt_tokens"] // 100): r for r in out["rows"]}
    assert set(rows) == {(mode, n) for mode in ("fp16w", "fp16w-bf16") for n in (1, 3)}
    for (mode, _), r in rows.items():
        assert r["tokens_per_s"] > 0 and 0 < r["of_bf16_peak"] and r["gflops"] > 0
        assert r["vs_reference"] == pytest.approx(1.0) if mode == "fp16w" else r["vs_reference"] > 0
    assert len(out["matmul_peak_gflops"]) == 2 and all(p["bf16"] > 0 for p in out["matmul_peak_gflops"].values())
    from pipeline.model.short_attention import long_attention_available

    assert sorted(int(n) // 100 for n in out["attention"]) == [1, 3]  # each prompt's last chunk, one layer
    for attention in out["attention"].values():
        assert attention["flash"]["ms"] > 0 and (attention["kernel"] is not None) == long_attention_available()
    held = out["weight_bytes"]
    # The long blocks' copy: fp32 in fp16w, bf16 in fp16w-bf16 (half); the packed fp16 ones alike.
    assert held["fp16w"]["long_blocks"] == 2 * held["fp16w-bf16"]["long_blocks"]
    assert held["fp16w"]["short_blocks"] == held["fp16w-bf16"]["short_blocks"] > 0
    assert "| fp16w-bf16 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--prefill"):
        benchmark.main(["--prefill", "fp16w,fp8", "--output", str(tmp_path)])
