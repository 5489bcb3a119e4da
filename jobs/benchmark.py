#!/usr/bin/env python
"""Side-by-side decoding speed: strategies and compute modes on the same prompts.

Every (document, context length) is run by every strategy in turn, repeated, the
order reversed on every other repeat (A B C, C B A, ...) so that a machine growing
busier or quieter hits all of them alike. Speeds are medians over repeats; a speed-up
is the median over repeats of the ratio to the reference (`ar` in the CPU default mode)
in the same repeat. `--control` runs the reference a second time at the other end of
the order: its "speed-up" is this machine's noise.

    python jobs/benchmark.py --ids gao-26-109008 --context-lengths 512,2048,4096 --repeats 3

Strategies are given as NAME:DTYPE (e.g. `hf:fp32,ar:fp32,ar:fp16w,static:fp16w`).
Writes OUT/benchmark.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from job_cli import add_calibration_dir_argument, add_repetition_arguments, load_documents, sampling_params
from pipeline.decoding.decode import decode, decode_requests
from pipeline.decoding.drafters import LayerSkipDrafter
from pipeline.decoding.loop import DecodeConfig, DecodingRequest, GenerationResult, Prefilled, prefill
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import StepRecord
from pipeline.decoding.stats import GenerationStats
from pipeline.engine import SEARCHING_STRATEGIES, STRATEGIES, Engine, EngineConfig, StrategyConfig
from pipeline.errors import ConfigError
from pipeline.knapspec.drafter import KnapSpecDrafter, search_candidates
from pipeline.knapspec.replanning import KnapSpecConfig
from pipeline.knapspec.tpt import choose_plan
from pipeline.logs import configure_logging
from pipeline.model import items, short_attention
from pipeline.model.linear import resolve_compute_mode
from pipeline.model.packing import RequestRows
from pipeline.summarization.prompts import build_prompt
from profiling.calibration import store_calibrator

logger = logging.getLogger("benchmark")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INPUT = REPO / "data" / "sample.jsonl"
DEFAULT_STRATEGIES = "hf:fp32,ar:fp32,hf:fp16w,ar:fp16w,static:fp16w"
CONTROL = "ar-control"  # the reference strategy, run a second time
# Whose plan predicts their speed (the hybrid mixes in copied drafts its layer plan does not predict).
SEARCHING = ("knapspec", "knapspec-coupled")
VERIFY_SIZES = (1, 2, 4, 8, 11)
# Rows each request of a batch verifies (1 + its drafted tokens) in the batch's verify cost.
BATCH_VERIFY_ROWS = (1, 2, 3, 5)
TARGET_BATCH_SPEEDUP = 1.3  # what the batch verify table asks of a draft
MATMUL = short_attention.MATMUL_ROUTE  # DTYPE+matmul: attention by PyTorch's matmuls, not the fused kernel
# Steps a batch's online step cost has seen before its predictions are reported.
CALIBRATION_STEPS = 16


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
    # A batch's step time as predicted before each step (after the first CALIBRATION_STEPS):
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


def parse_strategy(text: str) -> tuple[str, str]:
    """NAME or NAME:DTYPE -> (name, compute mode); a bare name, or `auto`, takes the CPU default
    mode, as generate.py and summarize.py do. DTYPE+matmul (e.g. `ar:fp16w+matmul`) is the mode
    with attention by PyTorch's matmuls instead of the fused kernel, run beside it. Anything
    else ends the run with one error line."""
    name, _, dtype = text.strip().partition(":")
    dtype, plus, route = dtype.partition("+")
    if name not in STRATEGIES:
        raise SystemExit(f"error: unknown strategy {name!r} in {text!r}; choose from {', '.join(STRATEGIES)}")
    if plus and route != MATMUL:
        raise SystemExit(f"error: {text!r}: the only route after '+' is {MATMUL!r}")
    try:
        return name, resolve_compute_mode(dtype or "auto", "cpu").value + (f"+{MATMUL}" if plus else "")
    except ConfigError as e:
        raise SystemExit(f"error: {text!r}: {e}") from None


def build_engine(model: str | None, dtype: str, calibration_dir: Path | None = None) -> Engine:
    """The engine of one parsed compute mode; a `+matmul` one is built with the kernel off (its
    latency tables are stored apart: a calibration's key names the attention route)."""
    mode, plus, _ = dtype.partition("+")
    short_attention.use_kernel(not plus)
    try:
        config = EngineConfig(model=model, dtype=mode, calibration_dir=calibration_dir)
        return Engine(config, calibrator=store_calibrator(calibration_dir))
    finally:
        short_attention.use_kernel(True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, default=DEFAULT_INPUT, help="a .jsonl file with id and text")
    parser.add_argument("--ids", default="gao-26-109008", help="comma-separated document ids")
    parser.add_argument("--context-lengths", default="512,2048,4096", help="prompt tokens, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help="NAME:DTYPE pairs, comma-separated (a bare NAME: the CPU default mode; DTYPE+matmul: "
        "attention by PyTorch's matmuls instead of the fused kernel, e.g. ar:fp16w+matmul)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch-sizes",
        default="1",
        help="requests decoded together, comma-separated (e.g. 1,4,8,16): request k of a batch is the "
        "document read from its k-th part on, like the chunks of one document in the summarize job",
    )
    parser.add_argument("--reference", default="ar:fp16w", help="the NAME:DTYPE speedups are relative to")
    parser.add_argument("--output", type=Path, default=Path("out"))
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    add_calibration_dir_argument(parser, os.environ)
    parser.add_argument(
        "--no-fallback",
        action="store_true",
        help="also run the DP's best candidates as forced draft models, to test the latency model's predictions",
    )
    parser.add_argument("--forced", type=int, default=4, help="how many DP candidates --no-fallback runs")
    parser.add_argument(
        "--control", action="store_true", help=f"run the reference twice ({CONTROL}): the measured noise"
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure the latency model afresh before the run (and store it) instead of using a stored one",
    )
    add_repetition_arguments(parser.add_argument_group("repetition control (greedy, every strategy alike)"))
    pipe = parser.add_argument_group(
        "pipeline throughput (instead of the strategy comparison): requests through one replica of P stage "
        "actors, one at a time vs several in flight, and the cost of one hop"
    )
    pipe.add_argument("--pipeline-parallel", type=int, help="stages of the replica (e.g. 2)")
    pipe.add_argument("--in-flight", default="1,4", help="requests in flight, comma-separated")
    pipe.add_argument("--requests", type=int, default=8, help="requests per measurement")
    return parser.parse_args(argv)


def batch_prompts(tokenizer, text: str, length: int, count: int) -> list[torch.Tensor]:
    """`count` prompts of up to `length` tokens: the k-th reads the document from its k-th
    part on (at a paragraph boundary), as the chunks of one document reach a replica together."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    prompts = []
    for k in range(count):
        first = k * len(paragraphs) // count
        prompts.append(build_prompt(tokenizer, "\n\n".join(paragraphs[first:]), max_prompt_tokens=length).token_ids)
    return prompts


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


def run_batch(
    engine: Engine,
    strategy: str,
    prompts: list[torch.Tensor],
    prefilled: list,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
):
    """One batch of `strategy` from copies of the prefilled prompts: our decoders through
    the replicas' batcher step (one forward per step for all), transformers' generate() on a left-padded batch."""
    if strategy.startswith("hf"):
        if len(prompts) == 1:
            results = [engine.generate(prompts[0], StrategyConfig(strategy), max_new_tokens, params)]
        else:
            results = engine.generate_batch(
                prompts, StrategyConfig(strategy), max_new_tokens, params, max_batch=len(prompts)
            )
        # generate() times its own prefill and decode; in a batch they are the batch's.
        return BatchRun(results, results[0].stats.decode_s, results[0].stats.prefill_s)
    config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=engine.eos_token_ids)
    # Each prefilled cache copied into a slot of one KV pool, as a replica's batcher holds them.
    pool = engine.model.new_pool(len(prefilled), max(f.cache.capacity for f in prefilled))
    requests = [
        DecodingRequest(
            Prefilled(pool.adopt(f.cache), f.logits, f.prompt_tokens, f.seconds),
            config,
            params,
            engine.drafter(StrategyConfig(strategy)),
            p.tolist(),
        )
        for p, f in zip(prompts, prefilled)
    ]
    started, steps = time.perf_counter(), []
    # The engine's step-cost fit, shared by its batches as a replica's are (a request alone plans from it).
    budget = engine.step_cost.budget()
    fit = engine.step_cost.cost
    seen_before, changes_before = (0, 0) if fit is None else (fit.num_observed, fit.num_changes)
    # The replicas' step: each request leaves the batch (and frees its slot) when it ends.
    results = decode_requests(engine.model, requests, budget, steps)
    decode_s = time.perf_counter() - started
    _report_step_errors(results, budget, seen_before, changes_before)
    searches, postponed = batch_plan_figures(results)
    return BatchRun(results, decode_s, sum(f.seconds for f in prefilled), searches, postponed, steps)


def batch_plan_figures(results: list[GenerationResult]) -> tuple[list[dict], int]:
    """The batch planner's searches of one batch, oldest first, and its checks that found no time
    for one, from its requests' results (each has those it took part in)."""
    searches = {s["id"]: s for r in results for s in r.extra.get("batch_searches", ())}
    postponed = max((r.extra.get("num_batch_searches_postponed", 0) for r in results), default=0)
    return [searches[i] for i in sorted(searches)], postponed


def _report_step_errors(results: list[GenerationResult], budget, seen_before: int, changes_before: int) -> None:
    """The batch's step-time predictions, table's and online fit's, after its first
    CALIBRATION_STEPS, into each of its results' `extra`."""
    cost = budget.cost
    errors = cost.prediction_errors(after=max(seen_before, CALIBRATION_STEPS)) if cost is not None else None
    if errors is not None:
        for result in results:
            result.extra["step_error_table"], result.extra["step_error_online"] = errors
            result.extra["step_fit_restarts"] = cost.num_changes - changes_before


def _alone(
    engine: Engine, prompt: torch.Tensor, prefilled, max_new_tokens: int, params: SamplingParams = SamplingParams()
) -> list[int]:
    """The request's `ar` tokens decoded by itself: what it must emit in any batch."""
    config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=engine.eos_token_ids)
    return decode(engine.model, prefilled.copy(), config, params, prompt_ids=prompt.tolist()).token_ids


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


def batch_verify_costs(engine: Engine, prompts: list[torch.Tensor], prefilled: list, rounds: int = 7) -> dict:
    """Median seconds of one batched forward in which every request verifies r rows (r - 1 drafted
    tokens), for each r in BATCH_VERIFY_ROWS, over copies of the prefilled caches in one KV pool as
    a replica holds them: what drafting costs a batch, which its accepted tokens must repay. Row
    counts alternate their order from round to round so that noise hits them alike."""
    model = engine.model
    pool = model.new_pool(len(prefilled), max(f.cache.capacity for f in prefilled))
    caches = [pool.adopt(f.cache) for f in prefilled]
    seconds: dict[int, list[float]] = {r: [] for r in BATCH_VERIFY_ROWS}
    for round_ in range(rounds + 1):  # the first round warms up
        for r in BATCH_VERIFY_ROWS if round_ % 2 else BATCH_VERIFY_ROWS[::-1]:
            blocks = [RequestRows(c, p[-r:].clone(), c.length) for c, p in zip(caches, prompts)]
            started = time.perf_counter()
            model.forward_batch(blocks, logits="all")
            if round_:
                seconds[r].append(time.perf_counter() - started)
    for cache in caches:
        pool.release(cache)
    return {r: statistics.median(v) for r, v in seconds.items()}


def batch_verify_row(doc_id: str, context_tokens: int, size: int, costs: dict[int, float]) -> dict:
    """One row of the batch verify table. With d drafted tokens a request must add a(d) accepted
    tokens per step for the batch to gain TARGET_BATCH_SPEEDUP: (1 + a) / (cost(1 + d) / cost(1)) >= it."""
    ratios = {r: costs[r] / costs[1] for r in BATCH_VERIFY_ROWS}
    return {
        "doc_id": doc_id,
        "context_tokens": context_tokens,
        "batch_size": size,
        "step_1_s": costs[1],
        **{f"rows_{r}_over_1": ratios[r] for r in BATCH_VERIFY_ROWS[1:]},
        **{f"accepted_needed_{r - 1}": TARGET_BATCH_SPEEDUP * ratios[r] - 1 for r in BATCH_VERIFY_ROWS[1:]},
    }


def verify_costs(engine: Engine, prompt_ids: torch.Tensor, rounds: int = 9) -> dict:
    """Median seconds of one full forward of k tokens after the prompt (a verify of k - 1
    drafts), for each k in VERIFY_SIZES, and of its parts for k = 1 and 4: every linear with
    the LM head alone, and every layer's attention alone over the prompt's cache. Sizes and
    parts alternate within each round so that noise hits them alike."""
    model = engine.model
    cache = prefill(model, prompt_ids, max(VERIFY_SIZES)).cache
    s = model.spec
    jobs = {
        ("forward", k): lambda k=k: model.forward(cache, prompt_ids[-k:].clone(), cache.length) for k in VERIFY_SIZES
    }
    for k in (1, 4):
        x = torch.randn(k, s.hidden_size, dtype=model.dtype)
        heads = torch.randn(k, s.num_heads * s.head_dim, dtype=model.dtype)
        inner = torch.randn(k, s.intermediate_size, dtype=model.dtype)
        q = torch.randn(k, s.num_heads, s.head_dim, dtype=model.dtype)
        kv = torch.randn(k, s.num_kv_heads, s.head_dim, dtype=model.dtype)

        def linears(x=x, heads=heads, inner=inner) -> None:
            with torch.inference_mode():
                for layer in model.layers:
                    layer.qkv(x), layer.o(heads), layer.gate_up(x), layer.down(inner)
                model.lm_head(x)

        def attention(q=q[None], kv=kv[None], k=k) -> None:
            with torch.inference_mode():
                rows = model.rows([(cache, cache.length, k)]).attention
                for i in range(s.num_layers):
                    model.attention(i, q, kv, kv, rows)

        jobs[("linears", k)], jobs[("attention", k)] = linears, attention
    times: dict = {key: [] for key in jobs}
    for round_ in range(rounds + 1):
        for key, job in jobs.items():
            t0 = time.perf_counter()
            job()
            if round_:  # the first round warms up
                times[key].append(time.perf_counter() - t0)
    median = {key: statistics.median(v) for key, v in times.items()}
    costs: dict = {k: median[("forward", k)] for k in VERIFY_SIZES}
    costs["parts"] = {f"{part}_{k}_s": median[(part, k)] for part in ("linears", "attention") for k in (1, 4)}
    return costs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    if args.pipeline_parallel:
        return pipeline_throughput(args)
    pairs = [parse_strategy(s) for s in args.strategies.split(",")]
    reference = parse_strategy(args.reference)
    if reference not in pairs:
        pairs.insert(0, reference)
    if args.control:
        pairs.append((CONTROL, reference[1]))
    lengths = [int(x) for x in args.context_lengths.split(",")]
    documents = load_documents(args.input, args.ids.split(","))
    engines = {dtype: build_engine(args.model, dtype, args.calibration_dir) for dtype in sorted({d for _, d in pairs})}
    tokenizer = next(iter(engines.values())).tokenizer
    if args.recalibrate:
        for dtype in {d for n, d in pairs if n in SEARCHING_STRATEGIES}:
            engines[dtype].calibrate(force=True)

    params = sampling_params(args)
    batch_sizes = sorted({int(x) for x in args.batch_sizes.split(",")})
    records: list[Record] = []
    verify_rows = []
    batch_verify = []
    forced: list[dict] = []
    for doc_id, text in documents.items():
        for length in lengths:
            prompts = batch_prompts(tokenizer, text, length, max(batch_sizes))
            # One prefill per prompt and compute mode; every strategy and repeat decodes from its own copy.
            prefilled = {
                dtype: [engine.prefill(p, args.max_new_tokens) for p in prompts] for dtype, engine in engines.items()
            }
            alone = {
                dtype: [_alone(engine, p, f, args.max_new_tokens, params) for p, f in zip(prompts, prefilled[dtype])]
                for dtype, engine in engines.items()
            }
            reference_at_1 = None
            for size in batch_sizes:
                chosen = [pair for pair in pairs if size == 1 or pair[0] != "hf-lookup"]  # it takes one prompt
                runs: dict[tuple[str, str], list] = {pair: [] for pair in chosen}
                for repeat in range(args.repeats):
                    for name, dtype in run_order(chosen, repeat):
                        strategy = reference[0] if name == CONTROL else name
                        run = run_batch(
                            engines[dtype], strategy, prompts[:size], prefilled[dtype][:size], args.max_new_tokens,
                            params,
                        )  # fmt: skip
                        runs[(name, dtype)].append(run)
                        logger.info(
                            "%s %d tokens, batch %d, %s:%s repeat %d: %.1f tok/s",
                            doc_id, prompts[0].numel(), size, name, dtype, repeat, run.tokens_per_s,
                        )  # fmt: skip
                ref_speeds = [r.tokens_per_s for r in runs[reference]]
                ref_full = [r.full_batch_tokens_per_s for r in runs[reference]]
                if size == batch_sizes[0]:
                    reference_at_1 = statistics.median(ref_speeds) if size == 1 else None
                for (name, dtype), batch_runs in runs.items():
                    records.append(
                        batch_record(
                            name, dtype, doc_id, size, batch_runs, ref_speeds, reference_at_1, alone[dtype], ref_full
                        )
                    )
                if size > 1:
                    costs = batch_verify_costs(engines[reference[1]], prompts[:size], prefilled[reference[1]][:size])
                    batch_verify.append(batch_verify_row(doc_id, prompts[0].numel(), size, costs))
            if args.no_fallback:
                forced += forced_candidates(
                    engines[reference[1]], prompts[0], prefilled[reference[1]][0], doc_id, args.max_new_tokens,
                    args.forced,
                )  # fmt: skip
            # The reference's mode, and beside it the same mode on the matmuls where that runs too.
            for dtype in [d for d in engines if d in (reference[1], f"{reference[1]}+{MATMUL}")]:
                costs = verify_costs(engines[dtype], prompts[0])
                parts = costs["parts"]
                floor = parts["linears_1_s"] + parts["attention_1_s"]
                verify_rows.append(
                    {
                        "doc_id": doc_id,
                        "context_tokens": prompts[0].numel(),
                        "dtype": dtype,
                        "t_forward_1_s": costs[1],
                    }
                    | {f"verify_{k}_over_1": costs[k] / costs[1] for k in VERIFY_SIZES[1:]}
                    | parts
                    | {
                        "linears_4_over_1": parts["linears_4_s"] / parts["linears_1_s"],
                        "attention_4_over_1": parts["attention_4_s"] / parts["attention_1_s"],
                        # The step against what its linears and attention alone cost; the rest is the
                        # elementwise work and the Python per item.
                        "step_over_linears_and_attention": costs[1] / floor,
                        "other_1_s": costs[1] - floor,
                    }
                )

    args.output.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings["threads"] = torch.get_num_threads()
    correlation = pearson([f["predicted_tpt"] for f in forced], [f["measured_tpt"] for f in forced])
    summary = summarize(records, forced, reference)
    out = {
        "records": [asdict(r) | {"measured_tpt": r.measured_tpt} for r in records],
        "verify_cost": verify_rows,
        "batch_verify_cost": batch_verify,
        "forced_candidates": forced,
        "forced_pearson_r": correlation,
        "summary": summary,
        "settings": settings,
    }
    (args.output / "benchmark.json").write_text(json.dumps(out, indent=2))
    plot(records, forced, reference, args.output / "benchmark.png")
    print(format_tables(records, verify_rows, reference))
    print()
    print(format_summary(summary, reference))
    batches = format_batches(records, reference)
    if batches:
        print()
        print(batches)
    if batch_verify:
        print()
        print(format_batch_verify(batch_verify))
    plans = format_batch_plans(records)
    if plans:
        print()
        print(plans)
    if forced:
        print()
        print(format_forced(forced))
    if correlation is not None:
        print(f"\nForced DP candidates: Pearson r(predicted, measured TPT) = {correlation:.2f} over {len(forced)}")
    return 0


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


def run_order(pairs: list, repeat: int) -> list:
    """A B C, then C B A: drift in the machine's speed over a pass hits every strategy alike."""
    return list(pairs) if repeat % 2 == 0 else list(pairs)[::-1]


def length_bucket(context_tokens: int) -> int:
    """Documents cut to one requested length differ by a few tokens: one bucket per length."""
    return int(round(context_tokens, -2))


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


def label_of(r: Record) -> str:
    """A strategy's name in the summary: NAME:DTYPE, and @BATCH beyond batch 1."""
    return f"{r.strategy}:{r.dtype}" + (f"@{r.batch_size}" if r.batch_size > 1 else "")


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


def forced_candidates(
    engine: Engine, prompt: torch.Tensor, prefilled, doc_id: str, max_new_tokens: int, num_forced: int
) -> list[dict]:
    """Decode with the DP's best candidates as fixed draft models, no AR fallback: what
    the latency model predicted for each, against what it measured."""
    model, config = engine.model, KnapSpecConfig()
    context = prefilled.cache.length
    drafter = KnapSpecDrafter(engine.latency, config)
    r = config.num_reference_tokens
    weights = tuple(engine.latency.item_weights(context, config.weight_cap))
    candidates = search_candidates(model, prefilled.cache, prompt[-r:], context - r, weights, config)
    plans = []
    for skip, top1 in candidates[1:]:  # the first is the full model
        scored = drafter.score(skip, top1, candidates[0][1], context)
        plans.append(choose_plan([scored], lambda k: engine.latency.t_verify(k, context), config.max_draft, -1.0))
    plans.sort(key=lambda p: p.predicted_tpt, reverse=True)
    rows = []
    decode_config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=engine.eos_token_ids)
    for plan in plans[:num_forced]:
        fixed = LayerSkipDrafter(plan.skip, model.spec.num_items, plan.gamma)
        result = decode(model, prefilled.copy(), decode_config, SamplingParams(), fixed, prompt.tolist())
        rows.append(
            {
                "doc_id": doc_id,
                "context_tokens": context,
                "skip": sorted(plan.skip),
                "gamma": plan.gamma,
                "alpha": plan.alpha,
                "predicted_tpt": plan.predicted_tpt,
                "predicted_vs_ar": plan.predicted_tpt / plan.ar_tpt,
                "measured_tpt": result.stats.tokens_per_s,
                "acceptance_rate": result.stats.acceptance_rate,
            }
        )
        logger.info(
            "forced %s γ=%d: predicted %.1f, measured %.1f tok/s",
            sorted(plan.skip),
            plan.gamma,
            plan.predicted_tpt,
            result.stats.tokens_per_s,
        )
    return rows


def pearson(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = (x.norm() * y.norm()).item()
    return (x @ y).item() / denominator if denominator else None


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


def _median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_extra(results, key: str) -> float | None:
    return _median_of([r.extra[key] for r in results if r.extra.get(key) is not None])


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


def pipeline_throughput(args: argparse.Namespace) -> int:
    """Tokens/s of one pipelined replica with 1 vs k requests in flight (interleaved, repeated,
    medians), and the median round trip of one hidden state to a stage actor."""
    from concurrent.futures import ThreadPoolExecutor

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: stay on 127.0.0.1
    import ray

    from actors.replica import PipelineReplica

    stages = args.pipeline_parallel
    in_flight = [int(x) for x in args.in_flight.split(",")]
    length = int(args.context_lengths.split(",")[0])
    name, dtype = args.strategies.split(",")[0].split(":") if ":" in args.strategies else ("ar", "fp16w")
    ray.init(address="local", include_dashboard=False)
    try:
        from pipeline.model import checkpoint

        engine_config = EngineConfig(model=args.model, dtype=dtype, calibration_dir=args.calibration_dir)
        path = checkpoint.resolve_checkpoint(args.model)
        tokenizer = checkpoint.load_tokenizer(path)
        texts = list(load_documents(args.input, args.ids.split(",")).values())
        prompts = [
            build_prompt(tokenizer, texts[i % len(texts)][i * 500 :], length).token_ids.tolist()
            for i in range(args.requests)
        ]
        threads = max(1, (os.cpu_count() or 1) // stages)
        replica = (
            ray.remote(PipelineReplica)
            .options(num_cpus=0, max_concurrency=max(in_flight))
            .remote(engine_config, StrategyConfig(name), stages, 0.5, threads)
        )
        ray.get(replica.info.remote())
        params = SamplingParams()

        def run(k: int) -> float:
            started = time.perf_counter()
            with ThreadPoolExecutor(k) as pool:
                outs = list(
                    pool.map(lambda ids: ray.get(replica.generate.remote(ids, args.max_new_tokens, params)), prompts)
                )
            return sum(len(o["token_ids"]) for o in outs) / (time.perf_counter() - started)

        run(1)  # warm-up: first calls load kernels on every stage
        rates: dict[int, list[float]] = {k: [] for k in in_flight}
        for _ in range(args.repeats):
            for k in in_flight:
                rates[k].append(run(k))
        stage = ray.get(replica.stage_handles.remote())[-1]
        hidden = torch.zeros(1, checkpoint.load_config(path).hidden_size)
        hops = []
        for _ in range(50):
            started = time.perf_counter()
            ray.get(stage.echo.remote(hidden))
            hops.append(time.perf_counter() - started)
    finally:
        ray.shutdown()
    base = statistics.median(rates[in_flight[0]])
    rows = [
        {
            "pipeline_parallel": stages,
            "in_flight": k,
            "tokens_per_s": statistics.median(v),
            "vs_first": statistics.median(v) / base,
            "repeats": len(v),
        }
        for k, v in rates.items()
    ]
    hop_ms = statistics.median(hops) * 1e3
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "pipeline_benchmark.json").write_text(json.dumps({"rows": rows, "hop_ms": hop_ms}, indent=2))
    print(f"| stages | requests in flight | tokens/s (prefill + decode) | vs {in_flight[0]} in flight |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {stages} | {row['in_flight']} | {row['tokens_per_s']:.1f} | {row['vs_first']:.2f} |")
    print(f"\nOne hop (a hidden state to a stage actor and back), median of 50: {hop_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
