"""What a comparison leaves behind: OUTPUT/benchmark.json (records, verify costs, forced
candidates, the summary and the run's settings), OUTPUT/benchmark.png, and the markdown
tables the job prints."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from profiling.benchmark.plots import plot
from profiling.benchmark.records import Comparison
from profiling.benchmark.summary import pearson, summarize
from profiling.benchmark.tables import (
    format_batch_plans,
    format_batch_verify,
    format_batches,
    format_forced,
    format_summary,
    format_tables,
)


def write_report(comparison: Comparison, reference: tuple[str, str], output: Path, settings: dict) -> str:
    """Write the JSON and the plot into `output`; the tables to print. `settings` is the run's
    options as given (JSON-ready); the number of threads decoding ran on is added to them."""
    records, forced = comparison.records, comparison.forced
    output.mkdir(parents=True, exist_ok=True)
    settings = dict(settings)
    settings["threads"] = torch.get_num_threads()
    correlation = pearson([f["predicted_tpt"] for f in forced], [f["measured_tpt"] for f in forced])
    summary = summarize(records, forced, reference)
    out = {
        "records": [asdict(r) | {"measured_tpt": r.measured_tpt} for r in records],
        "verify_cost": comparison.verify_rows,
        "batch_verify_cost": comparison.batch_verify,
        "forced_candidates": forced,
        "forced_pearson_r": correlation,
        "summary": summary,
        "settings": settings,
    }
    (output / "benchmark.json").write_text(json.dumps(out, indent=2))
    plot(records, forced, reference, output / "benchmark.png")
    # A blank line between tables; those with nothing to show (no batches, no forced runs) are left out.
    tables = [format_tables(records, comparison.verify_rows, reference), format_summary(summary, reference)]
    optional = [
        format_batches(records, reference),
        format_batch_verify(comparison.batch_verify) if comparison.batch_verify else "",
        format_batch_plans(records),
        format_forced(forced) if forced else "",
        (
            f"Forced DP candidates: Pearson r(predicted, measured TPT) = {correlation:.2f} over {len(forced)}"
            if correlation is not None
            else ""
        ),
    ]
    return "\n\n".join(tables + [table for table in optional if table])
