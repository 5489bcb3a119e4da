"""jobs/gpu_check.py stays runnable without a GPU: its CPU form on small shapes writes the
report a GPU run would, and a machine without CUDA is told so in one line."""

from __future__ import annotations

import json

import torch

from profiling.gpu import steps as gpu_check_steps
from tests.builders import load_job

ACCEPTANCE = {
    "model": "a real model",
    "dtype": "fp16w",
    "context_length": 1024,
    "documents": ["a", "b"],
    "rows": [
        {"kind": "attention", "attention_skipped": 0.5, "mlp_skipped": 0.0, "alpha": 0.9},
        {"kind": "mlp", "attention_skipped": 0.0, "mlp_skipped": 0.25, "alpha": 0.5},
        {"kind": "both", "attention_skipped": 0.25, "mlp_skipped": 0.25, "alpha": 0.0},
    ],
}


def test_the_cpu_form_runs_every_stage_and_reports_each(tmp_path, capsys):
    """Eager and captured steps side by side, drafts against their bytes, KnapSpec's predictions,
    prefill against the matmul peak, greedy equality (captured and eager) and the sampling χ²."""
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps(ACCEPTANCE))
    code = gpu_check.main(
        ["--device", "cpu", "--shape", "tiny", "--batch-sizes", "1,4", "--contexts", "128,256", "--verify-rows",
         "2,4", "--iterations", "2", "--prefill-tokens", "256", "--prefill-chunk", "128", "--samples", "600",
         "--acceptance", str(acceptance), "--output", str(tmp_path)]
    )  # fmt: skip
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, {stage: out[stage] for stage in ("equality", "sampling")}
    assert [(row["batch"], row["context"]) for row in out["steps"]] == [(1, 128), (4, 128), (1, 256), (4, 256)]
    for row in out["steps"]:
        for path in ("eager", "graphs"):
            assert row[f"{path}_ms"] > 0 and row[f"{path}_host_ms"] > 0 and row[f"{path}_kernels"] > 0
        assert row["floor_ms"] > 0 and row["verify_4_over_1"] > 0
        # the tiny shape's 4 layers: the table's shares (half the attention is 2 items, a quarter of
        # the MLPs 1), and DRAFT_SHARES of 10-50% (1 or 2 items of each kind)
        assert set(row["draft_over_ar"]) == {"2/0", "0/1", "1/1", "1/0", "0/2", "2/2"}
        assert all(0 < ratio for ratio in row["draft_over_ar"].values())
        skipped = row["draft_bytes_skipped"]
        assert 0 < skipped["1/0"] < skipped["2/0"] < skipped["2/2"] < 1 and skipped["0/1"] < skipped["0/2"]
        # every way of capturing a step timed beside the default, the 30% draft of both kinds (1/1 here)
        assert row["variant_draft"] == "1/1" and set(row["variants"]) == set(gpu_check_steps.VARIANTS)
        assert all(v["ar_ms"] > 0 and v["draft_ms"] > 0 and v["captures"] > 0 for v in row["variants"].values())
    assert len(out["knapspec"]) == 4
    for plan in out["knapspec"]:
        assert plan["speedup"] >= 1.0 and (plan["gamma"] == 0) == (plan["speedup"] == 1.0)
        assert plan["gamma"] == 0 or plan["alpha"] > 0  # a draft never accepted never wins
    assert out["prefill"]["tokens"] == 256 and out["prefill"]["tokens_per_s"] > 0 and out["prefill"]["of_peak"] > 0
    captured = out["prefill"]["captured"]  # the prompt as one chunk of 256 rows, through its bucket's step
    assert captured["chunk_steps"] > 0 and captured["captured_tokens_per_s"] > 0 and captured["speedup"] > 0
    attention = out["attention"]
    assert not attention["failures"] and attention["split_vs_masked"] < 2e-2 and attention["flex_vs_matmul"] < 2e-2
    equality = out["equality"]
    assert not equality["failures"] and equality["captured_steps"] > 0
    for path in ("eager", "graphs"):
        assert equality["requests"] == equality[f"{path}_equal"] + equality[f"{path}_near_ties"]
    # On a CPU with the kernel build bf16 is row-exact: no drift at all.
    assert equality["bf16_drift"] <= equality["bf16_drift_bound"]
    assert equality["bf16_drift"] == 0.0 or not equality["bf16_row_exact"]
    sampling = out["sampling"]
    assert sampling["samples"] == 600 and sampling["p_value"] > 1e-3 and not sampling["failures"]
    report = (tmp_path / "gpu_check.md").read_text()
    for section in ("## Steps", "## KnapSpec", "## Prefill", "## Attention", "## Greedy equality", "## Speculative"):
        assert section in report
    assert "| 4 | 256 |" in report and "not measured speed-ups" in report and "bf16 row drift on the device" in report
    printed = capsys.readouterr().out
    assert printed.count("## Prefill") == 1 and printed.count("## Speculative sampling") == 1  # each stage as it ends


def test_a_failing_stage_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps(ACCEPTANCE))

    def broken(*args):
        raise RuntimeError("the prefill broke")

    monkeypatch.setattr(gpu_check, "prefill_speed", broken)
    # No time at all for the steps stage: every batch and context is reported skipped, and the
    # stages after it run.
    code = gpu_check.main(
        ["--device", "cpu", "--shape", "tiny", "--stages", "steps,prefill,sampling", "--samples", "200",
         "--batch-sizes", "1,2", "--contexts", "64", "--time-budget", "0", "--acceptance", str(acceptance),
         "--output", str(tmp_path)]
    )  # fmt: skip
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and out["prefill"] == {"error": "RuntimeError: the prefill broke"}
    assert [row.get("skipped", "") for row in out["steps"]] == ["out of the check's time (--time-budget)"] * 2
    assert out["sampling"]["samples"] == 200
    assert "FAILED: RuntimeError: the prefill broke" in (tmp_path / "gpu_check.md").read_text()


def test_the_committed_acceptance_table_is_what_the_check_reads():
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    table = gpu_check.load_acceptance(gpu_check.DEFAULT_ACCEPTANCE)
    assert table["num_layers"] == 30 and {row["kind"] for row in table["rows"]} == {"attention", "mlp", "both"}
    assert gpu_check.draft_counts(table, 32)


def test_a_missing_acceptance_table_is_one_clear_error(tmp_path, capsys):
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    code = gpu_check.main(["--device", "cpu", "--shape", "tiny", "--acceptance", str(tmp_path / "none.json")])
    assert code == 2 and "run jobs/acceptance.py" in capsys.readouterr().err


def test_no_cuda_is_one_clear_error(capsys):
    if torch.cuda.is_available():
        return
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    assert gpu_check.main(["--output", "unused"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


class StandInCompiler:
    """A compiler backend in place of Inductor's Triton one, on a CPU: it counts the versions
    Dynamo compiles, notes whether each keeps static what Inductor's decode kernel needs (every
    tensor's batch; the queries', keys' and values' heads and head size), and runs the traced
    graph eagerly where it is small (the tiny models' stages, whose tokens are checked) and
    answers zeros of the output's shape where it is large (the 8B-shaped stages time it, and
    their times are not this test's question)."""

    LARGE = 2_000_000  # scores of one call (batch × heads × rows × keys)

    def __init__(self) -> None:
        self.versions: list[list[tuple]] = []
        self.symbolic: list[list[tuple]] = []

    def __call__(self, gm, example_inputs):
        # The traced inputs, their sizes symbolic where Dynamo made them dynamic (s0, s1, ...).
        traced = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        tensors = [t for t in traced if isinstance(t, torch.Tensor)]
        shapes = [tuple(t.shape) for t in tensors]
        self.versions.append(shapes)
        for t, shape in zip(tensors, shapes):
            static = (0, 1, 3) if len(shape) == 4 and t.is_floating_point() else (0,) if shape else ()
            if any(isinstance(shape[d], torch.SymInt) for d in static):
                self.symbolic.append(shapes)

        def run(*args):
            query, keys = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4 and a.is_floating_point()][:2]
            if query.shape[:3].numel() * keys.shape[2] <= self.LARGE:
                return gm.forward(*args)
            return (torch.zeros_like(query),)  # (flex_attention's output: the queries' shape)

        return run


# Llama-3.1-8B's structure where the GPU check's attention calls depend on it (the batch sizes,
# contexts, verify widths and prompt lengths come from the check's defaults, the prompt chunks
# from the 8B's prefill chunk), narrow where they do not (heads and head size are constants of a
# model: fewer and smaller, its calls keep their shapes), and four layers (every layer's call is
# the same; four leave drafts to skip).
NARROW_8B = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=131072, rope_theta=500000.0,
)  # fmt: skip


def test_the_checks_whole_sequence_of_flex_calls_compiles_within_the_limit_with_a_static_batch(tmp_path, monkeypatch):
    """Every FlexAttention call the GPU check makes on a GPU, in its order (every stage, the
    8B-shaped model's batches, contexts, verify widths, drafts, variants and prompt chunks, then
    the attention stage's and the tiny models'), through the settings and code a GPU compiles
    them with (flex.py: compile options, static dimensions, recompile budget), Inductor's Triton
    backend replaced by a stand-in. Before, the ninth version raised FailOnRecompileLimitHit."""
    from pipeline.model import flex, sublayer_model
    from pipeline.model.context import prefill_chunk_for
    from pipeline.model.spec import ModelSpec

    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    compiler = StandInCompiler()
    compiled = flex.compiled_flex
    monkeypatch.setattr(flex, "compiled_flex", lambda device_type: compiled("cuda", compiler))
    chunk = prefill_chunk_for(ModelSpec.from_hf_config(gpu_check.llama_config("llama-3.1-8b")))
    monkeypatch.setitem(gpu_check.SHAPES, "llama-3.1-8b", NARROW_8B)
    monkeypatch.setattr(sublayer_model, "prefill_chunk_for", lambda spec: chunk if spec.hidden_size == 64 else
                        prefill_chunk_for(spec))  # fmt: skip
    torch._dynamo.reset()  # (flex_attention's versions from earlier tests, on the same code object)
    try:
        code = gpu_check.main(
            ["--device", "cpu", "--attention", "flex", "--iterations", "1", "--samples", "300", "--time-budget",
             "100000", "--output", str(tmp_path)]
        )  # fmt: skip
    finally:
        torch._dynamo.reset()
    print(f"{len(compiler.versions)} versions of flex_attention compiled:", *compiler.versions, sep="\n")
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    errors = {stage: out[stage] for stage in gpu_check.STAGES if isinstance(out[stage], dict) and "error" in out[stage]}
    assert not errors
    rows = [(row["batch"], row["context"]) for row in out["steps"]]
    assert rows == [(1, 4096), (8, 4096), (32, 4096), (1, 16384), (8, 16384), (32, 16384)]
    assert not [row for row in out["steps"] if "error" in row or "left" in row or "skipped" in row]
    captured = out["prefill"]["captured"]
    assert "error" not in captured and captured["chunk"] == chunk == 512 and captured["chunk_steps"] > 0
    assert not out["equality"]["failures"] and out["equality"]["captured_steps"] > 0
    assert not compiler.symbolic
    assert len(compiler.versions) <= flex.RECOMPILE_LIMIT // 2
    assert code in (0, 1)  # (sampling's χ² on few samples and random weights may fail: not this test's question)


def test_a_failing_batch_and_context_and_the_time_budget_leave_the_other_rows_in_the_report(tmp_path, monkeypatch):
    """Each batch and context is guarded and written as it ends: one that fails keeps its error
    in its row, the rows before and after it stay; past the deadline a started one measures no
    further part and the rest are skipped; the files on disk grow by a row as each one ends."""
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps(ACCEPTANCE))
    fits = gpu_check_steps.pool_fits

    def pool_fits(model, batch, positions):
        if (batch, positions) == (4, 128 + 2):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return fits(model, batch, positions)

    calls = []  # the deadline, asked before each batch and context and before each of its parts

    def out_of_time(deadline):
        calls.append(deadline)
        return len(calls) >= 8  # (the third's verify measured, its drafts and variants not)

    on_disk = []
    measure = gpu_check_steps.measure_step

    def measure_step(model, row, *args):
        written = tmp_path / "gpu_check.json"
        on_disk.append(len(json.loads(written.read_text())["steps"]) if written.exists() else 0)
        return measure(model, row, *args)

    monkeypatch.setattr(gpu_check_steps, "pool_fits", pool_fits)
    monkeypatch.setattr(gpu_check_steps, "out_of_time", out_of_time)
    monkeypatch.setattr(gpu_check_steps, "measure_step", measure_step)
    code = gpu_check.main(
        ["--device", "cpu", "--shape", "tiny", "--stages", "steps,knapspec", "--batch-sizes", "1,4", "--contexts",
         "128,256", "--verify-rows", "2", "--iterations", "1", "--acceptance", str(acceptance), "--output",
         str(tmp_path)]
    )  # fmt: skip
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    first, failed, cut, skipped = out["steps"]
    assert code == 1 and on_disk == [0, 1, 2]  # (a failed batch and context fails the check)
    assert "error" not in first and first["variants"] and first["draft_over_ar"] and first["verify_2_over_1"] > 0
    assert (failed["batch"], failed["context"]) == (4, 128) and "illegal memory access" in failed["error"]
    assert cut["graphs_ms"] > 0 and cut["verify_2_over_1"] > 0 and cut["left"] == ["drafts", "variants"]
    assert "draft_over_ar" not in cut and skipped["skipped"] == gpu_check_steps.OUT_OF_TIME
    assert [(plan["batch"], plan["context"]) for plan in out["knapspec"]] == [(1, 128)]  # the one with drafts
    report = (tmp_path / "gpu_check.md").read_text()
    assert "| 4 | 128 | FAILED: RuntimeError: CUDA error: an illegal memory access" in report
    assert "batch 1, context 256: drafts, variants left out of the check's time" in report
    assert "| 4 | 256 | skipped: out of the check's time" in report and "| 1 | 128 | " in report
