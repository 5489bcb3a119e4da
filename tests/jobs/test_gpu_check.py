"""jobs/gpu_check.py stays runnable without a GPU: its CPU form on small shapes writes the
report a GPU run would, and a machine without CUDA is told so in one line."""

from __future__ import annotations

import json

import torch

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


def test_the_cpu_form_reports_costs_knapspec_projections_and_greedy_equality(tmp_path):
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps(ACCEPTANCE))
    code = gpu_check.main(
        ["--device", "cpu", "--shape", "tiny", "--batch-sizes", "1,4", "--contexts", "128,256", "--verify-rows",
         "2,4", "--iterations", "2", "--acceptance", str(acceptance), "--output", str(tmp_path)]
    )  # fmt: skip
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, out["equality"]
    assert [(row["batch"], row["context"]) for row in out["costs"]] == [(1, 128), (4, 128), (1, 256), (4, 256)]
    for row in out["costs"]:
        assert row["ar_step_ms"] > 0 and row["floor_ms"] > 0 and row["verify_4_over_1"] > 0
        # the tiny shape's 4 layers: half the attention is 2 items, a quarter of the MLPs 1
        assert set(row["draft_over_ar"]) == {"2/0", "0/1", "1/1"}
        assert all(0 < ratio for ratio in row["draft_over_ar"].values())
    assert len(out["knapspec"]) == 4
    for plan in out["knapspec"]:
        assert plan["speedup"] >= 1.0 and (plan["gamma"] == 0) == (plan["speedup"] == 1.0)
        assert plan["gamma"] == 0 or plan["alpha"] > 0  # a draft never accepted never wins
    report = (tmp_path / "gpu_check.md").read_text()
    assert "| 4 | 256 |" in report and "not measured speed-ups" in report
    equality = out["equality"]
    assert equality["requests"] == equality["equal"] + equality["near_ties"] and not equality["failures"]
    # On a CPU with the kernel build bf16 is row-exact: no drift at all.
    assert equality["bf16_drift"] <= equality["bf16_drift_bound"]
    assert equality["bf16_drift"] == 0.0 or not equality["bf16_row_exact"]
    assert "bf16 row drift on the device" in report


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
