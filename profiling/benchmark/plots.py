"""The benchmark's figure: speed-up and items skipped vs context, the latency model's predicted
vs measured tokens/s, and throughput and items skipped vs batch size."""

from __future__ import annotations

import statistics
from pathlib import Path

from profiling.benchmark.records import Record
from profiling.benchmark.settings import SEARCHING
from profiling.benchmark.summary import length_bucket


def plot(records: list[Record], forced: list[dict], reference: tuple[str, str], path: Path) -> None:
    """Speed-up vs context per strategy (geometric mean over documents, each document a faint
    dot); attention vs MLP items skipped vs context; predicted vs measured TPT; throughput vs
    batch size; items skipped by KnapSpec's batch plans vs batch size per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(26, 4.5))
    by_strategy: dict[str, dict[int, list[float]]] = {}
    skipped: dict[str, dict[int, list[tuple[float, float]]]] = {}
    throughput: dict[tuple[str, int], dict[int, list[float]]] = {}
    batch_skipped: dict[tuple[str, int], dict[int, list[tuple[float, float]]]] = {}
    for r in records:
        label = f"{r.strategy}:{r.dtype}"
        length = length_bucket(r.context_tokens)
        throughput.setdefault((label, length), {}).setdefault(r.batch_size, []).append(r.tokens_per_s)
        if r.strategy in SEARCHING and r.skipped_attn is not None:
            key = (r.strategy, length)
            batch_skipped.setdefault(key, {}).setdefault(r.batch_size, []).append((r.skipped_attn, r.skipped_mlp))
        if r.batch_size > 1:
            continue
        if r.speedup_vs_ar is not None:
            by_strategy.setdefault(label, {}).setdefault(length, []).append(r.speedup_vs_ar)
        if r.skipped_attn is not None:
            skipped.setdefault(r.strategy, {}).setdefault(r.context_tokens, []).append((r.skipped_attn, r.skipped_mlp))
    for label, points in sorted(by_strategy.items()):
        xs = sorted(points)
        line = axes[0].plot(xs, [statistics.geometric_mean(points[x]) for x in xs], marker="o", label=label)[0]
        dots = [(x, v) for x in xs for v in points[x]]
        axes[0].scatter([x for x, _ in dots], [v for _, v in dots], color=line.get_color(), alpha=0.25, s=12)
    axes[0].axhline(1.0, color="gray", linewidth=0.8)
    axes[0].set(xlabel="context tokens", ylabel=f"decode speed / {reference[0]}:{reference[1]}", title="Speed-up")
    axes[0].legend(fontsize=7)
    for strategy, points in sorted(skipped.items()):
        _plot_skipped(axes[1], points, strategy)
    axes[1].set(xlabel="context tokens", ylabel="items skipped (speculating plans)", title="What the draft skips")
    axes[1].legend(fontsize=7)
    if forced:
        axes[2].scatter([f["predicted_tpt"] for f in forced], [f["measured_tpt"] for f in forced], label="forced")
    searched = [r for r in records if r.predicted_tpt is not None and r.strategy in SEARCHING and r.batch_size == 1]
    axes[2].scatter(
        [r.predicted_tpt for r in searched], [r.measured_tpt for r in searched], marker="x", label="knapspec (its plan)"
    )
    # A batch plan predicts the batch's tokens/s (its per-request rate × the batch).
    planned = [r for r in records if r.predicted_tpt is not None and r.batch_searches]
    axes[2].scatter(
        [r.predicted_tpt * r.batch_size for r in planned],
        [r.measured_tpt for r in planned],
        marker="+",
        label="knapspec batch plans",
    )
    limits = [v for f in forced for v in (f["predicted_tpt"], f["measured_tpt"])]
    limits += [v for r in searched for v in (r.predicted_tpt, r.measured_tpt)]
    limits += [v for r in planned for v in (r.predicted_tpt * r.batch_size, r.measured_tpt)]
    if limits:
        axes[2].plot([min(limits), max(limits)], [min(limits), max(limits)], color="gray", linewidth=0.8)
    axes[2].set(xlabel="predicted tokens/s", ylabel="measured tokens/s", title="Latency model")
    axes[2].legend(fontsize=7)
    for (label, length), points in sorted(throughput.items()):
        xs = sorted(points)
        axes[3].plot(xs, [statistics.geometric_mean(points[x]) for x in xs], marker="o", label=f"{label} ~{length:,}")
    sizes = sorted({r.batch_size for r in records})
    axes[3].set(xlabel="batch size", ylabel="decode tokens/s (batch)", title="Throughput vs batch", xscale="log")
    axes[3].set_xticks(sizes, [str(size) for size in sizes])
    axes[3].minorticks_off()
    axes[3].legend(fontsize=6)
    for (strategy, length), points in sorted(batch_skipped.items()):
        _plot_skipped(axes[4], points, f"{strategy} ~{length:,}")
    axes[4].set(xlabel="batch size", ylabel="items skipped (speculating plans)", title="Skipped vs batch", xscale="log")
    axes[4].set_xticks(sizes, [str(size) for size in sizes])
    axes[4].minorticks_off()
    axes[4].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_skipped(axis, points: dict[int, list[tuple[float, float]]], label: str) -> None:
    """Mean attention and MLP items skipped at each x, in one colour: attention solid, MLP dashed."""
    xs = sorted(points)
    line = axis.plot(xs, [statistics.mean(a for a, _ in points[x]) for x in xs], marker="o", label=f"{label} attn")[0]
    axis.plot(
        xs,
        [statistics.mean(m for _, m in points[x]) for x in xs],
        marker="x",
        linestyle="--",
        color=line.get_color(),
        label=f"{label} MLP",
    )
