"""The benchmark's markdown tables: every record, the verify costs, the summary per strategy,
throughput per batch size, KnapSpec's batch plans, a batch's verify cost and the forced
candidates."""

from __future__ import annotations

import statistics

from pipeline.model import items
from profiling.benchmark.records import Record
from profiling.benchmark.summary import length_bucket
from profiling.benchmark.verify_costs import BATCH_VERIFY_ROWS, TARGET_BATCH_SPEEDUP, VERIFY_SIZES


def format_tables(records: list[Record], verify_rows: list[dict], reference: tuple[str, str]) -> str:
    lines = [
        f"| doc | context | strategy | dtype | batch | decode tok/s | vs {reference[0]}:{reference[1]} | prefill s "
        "| acceptance | tokens/step | same tokens as ar | search / decode | skipped attn / MLP |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r.doc_id} | {r.context_tokens} | {r.strategy} | {r.dtype} | {r.batch_size} | {r.tokens_per_s:.1f} "
            f"| {r.speedup_vs_ar:.2f}× | {r.prefill_s:.2f} | {r.acceptance_rate:.2f} | {r.mean_accepted_len:.2f} "
            f"| {'yes' if r.tokens_equal_ar else 'NO'} "
            f"| {'' if r.dp_overhead_frac is None else f'{r.dp_overhead_frac:.1%}'} "
            f"| {'' if r.skipped_attn is None else f'{r.skipped_attn:.1f} / {r.skipped_mlp:.1f}'} |"
        )
    lines += [
        "",
        "| doc | context | dtype | 1-token forward ms | " + " | ".join(f"{k} / 1" for k in VERIFY_SIZES[1:]) + " |",
    ]
    lines.append("|---|---:|---|---:|" + "---:|" * (len(VERIFY_SIZES) - 1))
    for v in verify_rows:
        ratios = " | ".join(f"{v[f'verify_{k}_over_1']:.2f}" for k in VERIFY_SIZES[1:])
        lines.append(
            f"| {v['doc_id']} | {v['context_tokens']} | {v['dtype']} | {v['t_forward_1_s'] * 1e3:.1f} | {ratios} |"
        )
    lines += [
        "",
        "| doc | context | step ms | linears ms | attention ms | other ms | step / (linears + attention) "
        "| verify 4 / 1 | linears 4 / 1 | attention 4 / 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in verify_rows:
        lines.append(
            f"| {v['doc_id']} | {v['context_tokens']} | {v['t_forward_1_s'] * 1e3:.1f} | {v['linears_1_s'] * 1e3:.1f} "
            f"| {v['attention_1_s'] * 1e3:.1f} | {v['other_1_s'] * 1e3:.1f} | {v['step_over_linears_and_attention']:.2f} "
            f"| {v['verify_4_over_1']:.2f} | {v['linears_4_over_1']:.2f} | {v['attention_4_over_1']:.2f} |"
        )
    return "\n".join(lines)


def format_summary(summary: dict, reference: tuple[str, str]) -> str:
    strategies = [label for label in summary if label != "forced"]
    if not strategies:
        return ""
    lengths = sorted({length for label in strategies for length in summary[label]["by_length"]})
    lines = [
        f"Decode speed over {reference[0]}:{reference[1]}, geometric mean over documents (lowest–highest):",
        "",
        "| context | " + " | ".join(strategies) + " |",
        "|---:|" + "---:|" * len(strategies),
    ]
    for length in lengths:
        cells = []
        for label in strategies:
            cell = summary[label]["by_length"].get(length)
            cells.append(f"{cell['geomean']:.2f}× ({cell['min']:.2f}–{cell['max']:.2f})" if cell else "")
        lines.append(f"| ~{length:,} | " + " | ".join(cells) + " |")
    lines.append("| all | " + " | ".join(f"**{summary[label]['geomean']:.2f}×**" for label in strategies) + " |")
    lines += [
        "",
        "| strategy | rows | same tokens as ar | search / decode (mean, max) | predicted vs measured tok/s (mean error) |",
        "|---|---:|---|---:|---:|",
    ]
    for label in strategies:
        entry = summary[label]
        share = (
            f"{entry['mean_search_share']:.1%}, {entry['max_search_share']:.1%}"
            if entry["max_search_share"] is not None
            else ""
        )
        error = f"{entry['mean_abs_prediction_error']:.0%}" if entry["mean_abs_prediction_error"] is not None else ""
        lines.append(
            f"| {label} | {entry['rows']} | {'yes' if entry['all_tokens_equal_ar'] else 'NO'} | {share} | {error} |"
        )
    if "forced" in summary:
        f = summary["forced"]
        lines.append(f"| forced DP candidates | {f['n']} |  |  | {f['mean_abs_prediction_error']:.0%} |")
    return "\n".join(lines)


def format_batches(records: list[Record], reference: tuple[str, str]) -> str:
    """Throughput per batch size and context: geometric mean over documents, against the same
    reference at the same batch and at batch 1."""
    sizes = sorted({r.batch_size for r in records})
    if sizes == [1]:
        return ""
    groups: dict[tuple[str, int, int], list[Record]] = {}
    for r in records:
        groups.setdefault((f"{r.strategy}:{r.dtype}", length_bucket(r.context_tokens), r.batch_size), []).append(r)
    lines = [
        f"Decode throughput summed over the batch (geometric mean over documents); vs {reference[0]}:{reference[1]} "
        "at the same batch, and at batch 1; and over the steps in which the whole batch ran (a replica refills "
        "its batch; this one drains at its end), against the reference's the same way:",
        "",
        "| strategy | context | batch | tok/s | vs ar, same batch | vs ar at batch 1 | full batch: tok/s | vs ar "
        "| same tokens as ar alone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (label, length, size), rows in sorted(groups.items()):
        vs_ar = [r.speedup_vs_ar for r in rows if r.speedup_vs_ar]
        vs_1 = [r.speedup_vs_batch1 for r in rows if r.speedup_vs_batch1]
        full = [r.full_batch_tokens_per_s for r in rows if r.full_batch_tokens_per_s]
        full_vs_ar = [r.full_batch_speedup_vs_ar for r in rows if r.full_batch_speedup_vs_ar]
        lines.append(
            f"| {label} | ~{length:,} | {size} | {statistics.geometric_mean([r.tokens_per_s for r in rows]):.1f} "
            f"| {statistics.geometric_mean(vs_ar):.2f}× | "
            + (f"{statistics.geometric_mean(vs_1):.2f}×" if vs_1 else "")
            + (f" | {statistics.geometric_mean(full):.1f}" if len(full) == len(rows) else " | ")
            + (f" | {statistics.geometric_mean(full_vs_ar):.2f}×" if len(full_vs_ar) == len(rows) else " | ")
            + f" | {'yes' if all(r.tokens_equal_ar for r in rows) else 'NO'} |"
        )
    return "\n".join(lines)


def format_batch_plans(records: list[Record]) -> str:
    """KnapSpec inside batches: one plan per batch step (knapspec/batch_plan.py), what it skipped,
    why it chose AR, and how well the step time was predicted."""
    rows = [r for r in records if r.batch_size > 1 and (r.batch_searches or r.batch_postponed)]
    if not rows:
        return ""

    def cell(value: float | None, form: str) -> str:
        return "" if value is None else format(value, form)

    lines = [
        "KnapSpec's batch plans: batch searches per run (and checks postponed for want of time), items its "
        "speculating plans skipped, the best "
        "drafting plan's predicted batch tokens/s over AR's (where the DP ran; else the optimistic bound that "
        "spared it), its predicted vs measured tokens/s, the search's share of decode, and the mean error of "
        "the step time predicted before each step by the latency table and by the online fit, and how often "
        "the fit restarted from a run of steps it missed the same way:",
        "",
        "| doc | context | strategy | batch | searches | attn skipped | MLP skipped | best draft / AR | its α "
        "| bound / AR | predicted tok/s | measured tok/s | search share | step error, table | step error, online | fit restarts |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r.doc_id, r.context_tokens, r.strategy, r.batch_size)):
        predicted = r.predicted_tpt * r.batch_size if r.predicted_tpt is not None else None
        lines.append(
            f"| {r.doc_id} | {r.context_tokens} | {r.strategy} | {r.batch_size} | {r.batch_searches}"
            f"{f' (+{r.batch_postponed} postponed)' if r.batch_postponed else ''} "
            f"| {cell(r.skipped_attn, '.1f')} | {cell(r.skipped_mlp, '.1f')} | {cell(r.best_draft_gain, '.2f')} "
            f"| {cell(r.best_draft_alpha, '.2f')} | {cell(r.draft_bound_gain, '.2f')} | {cell(predicted, '.1f')} | {r.tokens_per_s:.1f} "
            f"| {cell(r.dp_overhead_frac, '.1%')} | {cell(r.step_error_table, '.0%')} "
            f"| {cell(r.step_error_online, '.0%')} | {cell(r.step_fit_restarts, '.0f')} |"
        )
    return "\n".join(lines)


def format_batch_verify(rows: list[dict]) -> str:
    """What drafting costs a batch (the reference's mode), and the accepted tokens per request and
    step that would repay it TARGET_BATCH_SPEEDUP-fold: compare them with a strategy's own."""
    drafts = [r - 1 for r in BATCH_VERIFY_ROWS[1:]]
    lines = [
        "| doc | context | batch | step ms | "
        + " | ".join(f"{r} rows each / 1" for r in BATCH_VERIFY_ROWS[1:])
        + " | "
        + " | ".join(f"accepted for {TARGET_BATCH_SPEEDUP}x, {d} drafted" for d in drafts)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * 2 * len(drafts),
    ]
    for v in rows:
        ratios = " | ".join(f"{v[f'rows_{r}_over_1']:.2f}" for r in BATCH_VERIFY_ROWS[1:])
        needed = " | ".join(f"{v[f'accepted_needed_{d}']:.2f}" for d in drafts)
        lines.append(
            f"| {v['doc_id']} | {v['context_tokens']} | {v['batch_size']} | {v['step_1_s'] * 1e3:.1f} | {ratios} | {needed} |"
        )
    return "\n".join(lines)


def format_forced(forced: list[dict]) -> str:
    """The DP's best candidates run as fixed drafts: why the fallback chose what it chose."""
    lines = [
        "| doc | context | skipped attn / MLP | γ | α (predicted) | predicted tok/s | predicted vs AR "
        "| measured tok/s | acceptance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in forced:
        attn, mlp = items.count_kinds(f["skip"])
        lines.append(
            f"| {f['doc_id']} | {f['context_tokens']} | {attn} / {mlp} | {f['gamma']} "
            f"| {f['alpha']:.2f} | {f['predicted_tpt']:.1f} | {f['predicted_vs_ar']:.2f}× "
            f"| {f['measured_tpt']:.1f} | {f['acceptance_rate']:.2f} |"
        )
    return "\n".join(lines)
