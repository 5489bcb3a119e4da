"""How a strategy runs in the benchmark: an engine per compute mode, a batch's prompts, one batch
decoded from copies of the prefilled prompts (as a replica's batcher decodes it), what a request
emits alone (what it must emit in any batch), and the order of the strategies in a repeat."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pipeline.decoding.decode import decode, decode_requests
from pipeline.decoding.loop import DecodeConfig, DecodingRequest, GenerationResult, Prefilled
from pipeline.decoding.sampling import SamplingParams
from pipeline.engine import Engine, EngineConfig, StrategyConfig
from pipeline.model import short_attention
from pipeline.summarization.prompts import build_prompt
from profiling.benchmark.records import BatchRun
from profiling.calibration import store_calibrator

# Steps a batch's online step cost has seen before its predictions are reported.
CALIBRATION_STEPS = 16


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


def batch_prompts(tokenizer, text: str, length: int, count: int) -> list[torch.Tensor]:
    """`count` prompts of up to `length` tokens: the k-th reads the document from its k-th
    part on (at a paragraph boundary), as the chunks of one document reach a replica together."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    prompts = []
    for k in range(count):
        first = k * len(paragraphs) // count
        prompts.append(build_prompt(tokenizer, "\n\n".join(paragraphs[first:]), max_prompt_tokens=length).token_ids)
    return prompts


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


def decode_alone(
    engine: Engine, prompt: torch.Tensor, prefilled, max_new_tokens: int, params: SamplingParams = SamplingParams()
) -> list[int]:
    """The request's `ar` tokens decoded by itself: what it must emit in any batch."""
    config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=engine.eos_token_ids)
    return decode(engine.model, prefilled.copy(), config, params, prompt_ids=prompt.tolist()).token_ids


def run_order(pairs: list, repeat: int) -> list:
    """A B C, then C B A: drift in the machine's speed over a pass hits every strategy alike."""
    return list(pairs) if repeat % 2 == 0 else list(pairs)[::-1]
