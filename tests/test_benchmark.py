"""jobs/benchmark.py end to end on a reduced setting: records, forced candidates, plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("benchmark_script", REPO / "jobs" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_pearson():
    benchmark = load_script()
    assert benchmark.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert benchmark.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert benchmark.pearson([1, 2], [1, 2]) is None


@pytest.mark.slow
def test_benchmark_writes_records_and_plot(tmp_path):
    benchmark = load_script()
    code = benchmark.main(
        [
            "--ids", "gao-26-109008",
            "--context-lengths", "200",
            "--max-new-tokens", "8",
            "--repeats", "1",
            "--strategies", "ar:fp16w,knapspec:fp16w,lookup:fp16w",
            "--no-fallback", "--forced", "2",
            "--output", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    out = json.loads((tmp_path / "benchmark.json").read_text())
    records = {r["strategy"]: r for r in out["records"]}
    assert set(records) == {"ar", "knapspec", "lookup"}
    for r in records.values():
        assert r["tokens_equal_ar"] and r["repeats"] == 1 and r["measured_tpt"] == r["tokens_per_s"] > 0
    assert records["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert records["knapspec"]["dp_overhead_frac"] is not None
    assert 1 <= len(out["forced_candidates"]) <= 2
    assert all(f["predicted_tpt"] > 0 and f["measured_tpt"] > 0 for f in out["forced_candidates"])
    assert (tmp_path / "benchmark.png").stat().st_size > 10_000
