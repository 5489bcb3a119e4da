"""A comparison summed up per strategy: speed-ups over the reference per context length, the
searches' share of decode time, and how far the latency model's predictions were from the
measured speeds (and, over the forced candidates, their correlation)."""

from __future__ import annotations

import statistics

import torch

from profiling.benchmark.records import Record
from profiling.benchmark.settings import SEARCHING


def length_bucket(context_tokens: int) -> int:
    """Documents cut to one requested length differ by a few tokens: one bucket per length."""
    return int(round(context_tokens, -2))


def label_of(r: Record) -> str:
    """A strategy's name in the summary: NAME:DTYPE, and @BATCH beyond batch 1."""
    return f"{r.strategy}:{r.dtype}" + (f"@{r.batch_size}" if r.batch_size > 1 else "")


def summarize(records: list[Record], forced: list[dict], reference: tuple[str, str]) -> dict:
    """Per strategy: the speed-up over the reference per context length (geometric mean over
    documents, with the lowest and highest), the searches' share of decode time, and how far
    the predicted tokens/s were from the measured ones."""
    per_strategy: dict[str, dict] = {}
    for r in records:
        if r.speedup_vs_ar is None or (r.strategy, r.dtype) == reference:
            continue
        entry = per_strategy.setdefault(label_of(r), {"by_length": {}, "rows": []})
        entry["by_length"].setdefault(length_bucket(r.context_tokens), []).append(r.speedup_vs_ar)
        entry["rows"].append(r)
    summary: dict[str, dict] = {}
    for label, entry in per_strategy.items():
        rows = entry["rows"]
        # A plan predicts one request's speed: batched rows measure the batch's.
        predicted = [r for r in rows if r.predicted_tpt is not None and r.strategy in SEARCHING and r.batch_size == 1]
        shares = [r.dp_overhead_frac for r in rows if r.dp_overhead_frac is not None]
        summary[label] = {
            "by_length": {
                length: {"geomean": statistics.geometric_mean(v), "min": min(v), "max": max(v), "n": len(v)}
                for length, v in sorted(entry["by_length"].items())
            },
            "geomean": statistics.geometric_mean([r.speedup_vs_ar for r in rows]),
            "min": min(r.speedup_vs_ar for r in rows),
            "rows": len(rows),
            "all_tokens_equal_ar": all(r.tokens_equal_ar for r in rows),
            "max_search_share": max(shares) if shares else None,
            "mean_search_share": statistics.mean(shares) if shares else None,
            "mean_abs_prediction_error": (
                statistics.mean(abs(r.predicted_tpt - r.measured_tpt) / r.measured_tpt for r in predicted)
                if predicted
                else None
            ),
        }
    if forced:
        summary["forced"] = {
            "mean_abs_prediction_error": statistics.mean(
                abs(f["predicted_tpt"] - f["measured_tpt"]) / f["measured_tpt"] for f in forced
            ),
            "pearson_r": pearson([f["predicted_tpt"] for f in forced], [f["measured_tpt"] for f in forced]),
            "n": len(forced),
        }
    return summary


def pearson(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = (x.norm() * y.norm()).item()
    return (x @ y).item() / denominator if denominator else None
