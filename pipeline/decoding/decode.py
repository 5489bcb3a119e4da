"""Decoding requests already prefilled, by the continuous batcher's step: a request decoded
alone is a batch of one, and requests decoded together are one batch, so every caller runs
the step a replica runs (scheduler.py)."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.decoding.batch_drafts import DraftBudget
from pipeline.decoding.drafters import Drafter
from pipeline.decoding.loop import DecodeConfig, DecodingRequest, GenerationResult, Prefilled
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, StepRecord


def decode(
    model,
    prefilled: Prefilled,
    config: DecodeConfig,
    params: SamplingParams,
    drafter: Drafter | None = None,
    prompt_ids: list[int] | None = None,
    budget: DraftBudget | None = None,
) -> GenerationResult:
    """Generate after a prefilled prompt. Consumes `prefilled.cache`.

    `prompt_ids` is what drafters that copy from the context (prompt lookup) read; `budget`
    times the steps (an engine's: the fit of its device's step cost, which a searching drafter
    plans from once it has seen a few steps).
    """
    (result,) = decode_requests(model, [DecodingRequest(prefilled, config, params, drafter, prompt_ids)], budget)
    return result


def decode_requests(
    model,
    requests: Sequence[DecodingRequest],
    budget: DraftBudget | None = None,
    step_log: list[StepRecord] | None = None,
) -> list[GenerationResult]:
    """Decode prefilled requests together, results in their order; the first failure raises
    (after the others have finished). Each step every running request proposes its own draft,
    one forward verifies all of them and each accepts by its own rule, so a request's tokens
    are those it would decode alone (up to the batch's rounding: a different token only where
    its top-2 logits nearly tie). `budget`: the draft budget and step-cost fit (an engine's,
    which its batches share; default: the batch's own, from the drafters' table). `step_log`,
    if given, gets every step's StepRecord."""
    batcher = ContinuousBatcher(model, max(len(requests), 1), budget=budget, step_log=step_log)
    tickets = [batcher.adopt(request) for request in requests]
    done = {finished.ticket: finished for finished in batcher.run()}
    for ticket in tickets:
        if done[ticket].error is not None:
            raise done[ticket].error
    return [done[ticket].result for ticket in tickets]
