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
