"""What the benchmark measures: one batch decoded by one strategy (`BatchRun`), the record of
a strategy's runs at one (document, context, batch size) against the reference's in the same
repeats (`Record`), and a whole comparison's results (`Comparison`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from pipeline.decoding.loop import GenerationResult
from pipeline.decoding.scheduler import StepRecord
from pipeline.decoding.stats import GenerationStats


@dataclass
class Record:
    strategy: str
    dtype: str
    doc_id: str
    context_tokens: int
    new_tokens: int  # of the batch's first request
    tokens_per_s: float  # decode throughput summed over the batch (at batch 1 the measured TPT)
    prefill_s: float  # of all the batch's prompts
    speedup_vs_ar: float | None  # against `ar` at the same batch size, same prompts
    acceptance_rate: float
    mean_accepted_len: float
    tokens_equal_ar: bool
    repeats: int
    predicted_tpt: float | None  # tokens/s the searching strategies' last plan expected
    # Search time over decode time in the dearest repeat: the first request at a length
    # searches, later ones on the same engine inherit its verdict (a median would hide it).
    dp_overhead_frac: float | None
    skipped_attn: float | None  # attention items a speculating plan skipped, mean over plans
    skipped_mlp: float | None
    batch_size: int = 1
    speedup_vs_batch1: float | None = None  # against the reference at batch 1
    # While every request of the batch runs (BatchRun.full_batch_tokens_per_s), and against the
    # reference's the same way, run by run.
    full_batch_tokens_per_s: float | None = None
    full_batch_speedup_vs_ar: float | None = None
    # A batch's step time as predicted before each step (after the first runs.CALIBRATION_STEPS):
    # mean relative error of the latency table's prediction and of the online fit's.
    step_error_table: float | None = None
    step_error_online: float | None = None
    step_fit_restarts: float | None = None  # times the online fit restarted from a change of speed
    # KnapSpec's batch planner: its searches, and the best drafting plan's predicted batch
    # tokens/s over plain decoding's (median; below 1 + margin it chose AR).
    batch_searches: int | None = None
    batch_postponed: int | None = None  # its checks that found no time for a search within its share
    best_draft_gain: float | None = None  # of the searches that ran the DP
    draft_bound_gain: float | None = None  # of those the optimistic bound spared (every token matched)
    best_draft_alpha: float | None = None  # the best drafting plan's mean acceptance estimate

    @property
    def measured_tpt(self) -> float:
        return self.tokens_per_s


@dataclass
class BatchRun:
    results: list[GenerationResult]
    decode_s: float  # wall time of the batch's decode (after every prefill)
    prefill_s: float
    searches: list[dict] = field(default_factory=list)  # the batch planner's, in this run
    postponed: int = 0  # its checks that found no time for a search
    steps: list[StepRecord] = field(default_factory=list)  # the batcher's, step by step

    @property
    def tokens_per_s(self) -> float:
        """Tokens decoded after the prefills, summed over the batch, per second of the batch."""
        decoded = sum(max(len(r.token_ids) - 1, 0) for r in self.results)
        return decoded / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def full_batch_tokens_per_s(self) -> float | None:
        """Tokens per second of the steps in which every request of the batch ran: the rate a
        replica keeps while it refills its batch as requests leave. The batch here drains at
        its end, and requests that speculate leave it unevenly, so its last steps run fewer
        requests; None where no step was timed (transformers' generate())."""
        size = len(self.results)
        full = [(step.emitted, step.seconds) for step in self.steps if step.running == size]
        seconds = sum(s for _, s in full)
        return sum(e for e, _ in full) / seconds if seconds > 0 else None


def batch_record(
    name: str,
    dtype: str,
    doc_id: str,
    size: int,
    runs: list[BatchRun],
    ref_speeds: list[float],
    reference_at_1: float | None,
    alone: list[list[int]],
    ref_full: list[float | None] = (),
) -> Record:
    speeds = [run.tokens_per_s for run in runs]
    ratios = [s / ref for s, ref in zip(speeds, ref_speeds) if ref > 0]
    full = [run.full_batch_tokens_per_s for run in runs]
    full_ratios = [f / ref for f, ref in zip(full, ref_full) if f is not None and ref]
    results = [r for run in runs for r in run.results]
    stats = [GenerationStats.total(r.stats for r in run.results) for run in runs]
    first = runs[0].results[0]
    return Record(
        strategy=name,
        dtype=dtype,
        doc_id=doc_id,
        context_tokens=first.stats.prompt_tokens,
        new_tokens=len(first.token_ids),
        tokens_per_s=statistics.median(speeds),
        prefill_s=statistics.median(run.prefill_s for run in runs),
        speedup_vs_ar=statistics.median(ratios) if ratios else None,
        acceptance_rate=statistics.median(s.acceptance_rate for s in stats),
        mean_accepted_len=statistics.median(s.mean_accepted_len for s in stats),
        # Greedy outputs are exact within a compute mode: each request against itself alone with `ar`.
        tokens_equal_ar=all(r.token_ids == alone[i] for run in runs for i, r in enumerate(run.results)),
        repeats=len(runs),
        predicted_tpt=_median_extra(results, "predicted_tpt"),
        dp_overhead_frac=max((share for run in runs if (share := search_share(run)) is not None), default=None),
        skipped_attn=_median_extra(results, "mean_skipped_attn"),
        skipped_mlp=_median_extra(results, "mean_skipped_mlp"),
        batch_size=size,
        speedup_vs_batch1=statistics.median(speeds) / reference_at_1 if reference_at_1 else None,
        full_batch_tokens_per_s=_median_of([f for f in full if f is not None]),
        full_batch_speedup_vs_ar=_median_of(full_ratios),
        step_error_table=_median_extra(results, "step_error_table"),
        step_error_online=_median_extra(results, "step_error_online"),
        step_fit_restarts=_median_extra(results, "step_fit_restarts"),
        batch_searches=sum(len(run.searches) for run in runs) // len(runs) if size > 1 else None,
        batch_postponed=sum(run.postponed for run in runs) // len(runs) if size > 1 else None,
        best_draft_gain=_median_of(
            [
                s["best_draft_tpt"] / s["ar_tpt"]
                for run in runs
                for s in run.searches
                if s["searched"] and s["best_draft_alpha"] is not None  # a candidate passed τ
            ]
        ),
        draft_bound_gain=_median_of(
            [s["best_draft_tpt"] / s["ar_tpt"] for run in runs for s in run.searches if not s["searched"]]
        ),
        best_draft_alpha=_median_of(
            [s["best_draft_alpha"] for run in runs for s in run.searches if s["best_draft_alpha"] is not None]
        ),
    )


def search_share(run: BatchRun) -> float | None:
    """The run's search time over its decode time (None: no request of it searches). Every
    search stalls the whole batch, whether the batch planner runs it (each member carries its
    share of the time) or a request left alone runs its own, so the batch's search time is the
    sum over its requests, and its decode time the batch's."""
    searched = [r.extra["optimize_s"] for r in run.results if "optimize_s" in r.extra]
    if not searched or run.decode_s <= 0:
        return None
    return math.fsum(searched) / run.decode_s


def _median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_extra(results, key: str) -> float | None:
    return _median_of([r.extra[key] for r in results if r.extra.get(key) is not None])


@dataclass
class Comparison:
    """A strategy comparison's results, as benchmark.json holds them."""

    records: list[Record] = field(default_factory=list)
    verify_rows: list[dict] = field(default_factory=list)  # verify_costs.verify_row per document and length
    batch_verify: list[dict] = field(default_factory=list)  # verify_costs.batch_verify_row per batch beyond 1
    forced: list[dict] = field(default_factory=list)  # forced.forced_candidates' rows (--no-fallback)
