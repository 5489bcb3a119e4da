"""jobs/gpu_check.py stays runnable without a GPU: its CPU form on small shapes writes the
report a GPU run would, and a machine without CUDA is told so in one line."""

from __future__ import annotations

import json

import torch

from tests.builders import load_job


def test_the_cpu_form_reports_costs_and_greedy_equality(tmp_path):
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    code = gpu_check.main(
        ["--device", "cpu", "--shape", "tiny", "--batch-sizes", "1,4", "--context", "256", "--verify-rows", "4",
         "--iterations", "2", "--output", str(tmp_path)]
    )  # fmt: skip
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, out["equality"]
    assert [row["batch"] for row in out["costs"]] == [1, 4]
    for row in out["costs"]:
        assert row["ar_step_ms"] > 0 and row["floor_ms"] > 0 and row["verify_4_over_1"] > 0
    equality = out["equality"]
    assert equality["requests"] == equality["equal"] + equality["near_ties"] and not equality["failures"]
    assert "| 4 | 256 |" in (tmp_path / "gpu_check.md").read_text()


def test_no_cuda_is_one_clear_error(capsys):
    if torch.cuda.is_available():
        return
    gpu_check = load_job("gpu_check.py", "gpu_check_script")
    assert gpu_check.main(["--output", "unused"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
