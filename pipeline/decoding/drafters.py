"""Drafters: what proposes tokens for the full model to verify.

A self-speculative drafter runs the model with a set of items (sublayers) skipped.
It stops early when its own top-1 probability falls below a confidence threshold
(KnapSpec and SWIFT use 0.7): a doubtful draft token is usually rejected, and every
drafted token costs a forward of the draft model.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.decoding.repetition import RepetitionState
from pipeline.decoding.sampling import SamplingParams, probabilities
from pipeline.decoding.step_cost import OnlineStepCost, StepLatency
from pipeline.errors import ConfigError
from pipeline.model import items
from pipeline.model.kv_cache import KVCache
from pipeline.model.packing import RequestRows
from pipeline.model.sublayer_model import SublayerModel

DEFAULT_MAX_DRAFT = 4
DEFAULT_CONFIDENCE_THRESHOLD = 0.7


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [n, V] draft distributions; only when sampling
    # [n]: the drafter's estimate that tokens 0..j are all accepted, for a batch to weigh the
    # draft's rows (batch_drafts.py); None: no estimate, a batch verifies the draft whole.
    survival: list[float] | None = None

    def prefix(self, n: int) -> Draft:
        """Its first n tokens: still a draft to verify exactly (acceptance goes token by token)."""
        if n >= len(self.token_ids):
            return self
        probs = None if self.probs is None else self.probs[:n]
        return Draft(self.token_ids[:n], probs, None if self.survival is None else self.survival[:n])


@dataclass
class DraftRequest:
    """What a drafter may use to propose the tokens after `pending`."""

    model: SublayerModel
    cache: KVCache  # committed up to `pending`, whose own position is cache.length
    token_ids: list[int]  # prompt and emitted tokens, ending with `pending`
    max_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: Collection[int]
    # The request's repetition control (None: off): drafts are proposed under it, as they are verified.
    repetition: RepetitionState | None = None

    @property
    def pending(self) -> int:
        return self.token_ids[-1]

    def process(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        """A draft forward's logits [V] after `drafted`, as verification will process that row."""
        return logits if self.repetition is None else self.repetition.process_row(logits, drafted)


@dataclass(frozen=True)
class DraftForward:
    """One forward a drafter asks for: `token` at `position` of the request's cache, through the
    model minus `skip`. Answered with that row's logits [V]."""

    token: int
    position: int
    skip: frozenset[int]


@dataclass(frozen=True)
class DraftChoice:
    """Values a drafter computed on the device and needs on the host (a drafted token, its
    probability): `values` [k] float64, answered with them as a list. A batch brings every
    request's back in one copy per draft position."""

    values: torch.Tensor


# A drafter's proposal as steps: it yields the forwards it needs, receives their logits, yields
# the choices it needs back on the host, receives them, and returns its Draft. A batch runs the
# steps of all its requests together (decoding/loop.py).
DraftSteps = Generator[DraftForward | DraftChoice, torch.Tensor | list[float], Draft]


class BatchPlanning(Protocol):
    """Plans the layer drafts of a batch's requests together (knapspec/batch_plan.py)."""

    def prepare(self, model, requests: Sequence, cost: OnlineStepCost | None) -> None: ...


class Drafter(Protocol):
    """What proposes a request's drafts. Proposing is a generator of the draft forwards it
    needs (`DraftSteps`): a batch runs those of all its requests together, and a drafter that
    copies or proposes nothing asks for none."""

    max_draft: int
    # The table its drafts' survival estimates are weighed against (batch_drafts.py); None: it makes none.
    latency: StepLatency | None
    # Who plans its layer drafts with the other requests of a batch; None: it plans alone, if at all.
    batch_planner: BatchPlanning | None

    def propose_steps(self, request: DraftRequest) -> DraftSteps:
        """Up to `request.max_tokens` tokens to follow `request.pending`, asking for the draft
        forwards it needs. They may write K/V beyond `cache.length`; verification overwrites them."""
        ...

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Feedback after verification."""
        ...

    def summary(self) -> dict:
        """What it reports with the request's result (GenerationResult.extra)."""
        ...


def propose(drafter: Drafter, request: DraftRequest) -> Draft:
    """`drafter`'s draft for a request alone, each draft forward on the request's own cache."""
    return run_steps(request, drafter.propose_steps(request))


def run_steps(request: DraftRequest, steps: DraftSteps) -> Draft:
    """A proposal's steps for one request alone: each forward on its own cache."""
    model = request.model
    try:
        asked = next(steps)
        while True:
            if isinstance(asked, DraftChoice):
                asked = steps.send(asked.values.tolist())
                continue
            out = model.forward_batch([RequestRows(request.cache, [asked.token], asked.position)], asked.skip, "last")
            asked = steps.send(out[0][0])
    except StopIteration as stop:
        return stop.value


class NoDraft:
    """Plain autoregressive decoding."""

    max_draft = 0
    latency = None
    batch_planner = None

    def propose_steps(self, request: DraftRequest) -> DraftSteps:
        return Draft([])
        yield  # a generator that asks for nothing

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def summary(self) -> dict:
        return {}


class LayerSkipDrafter:
    """Drafts with the model minus the items in `skip`."""

    latency = None
    batch_planner = None

    def __init__(
        self,
        skip: Iterable[int],
        num_items: int,
        max_draft: int = DEFAULT_MAX_DRAFT,
        confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD,
    ) -> None:
        self.skip = frozenset(validate_skip(skip, num_items))
        if max_draft < 1:
            raise ConfigError(f"max_draft must be >= 1, got {max_draft}")
        self.max_draft = max_draft
        self.confidence_threshold = confidence_threshold

    def propose_steps(self, request: DraftRequest) -> DraftSteps:
        cache, params = request.cache, request.params
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        token = request.pending
        for j in range(min(self.max_draft, request.max_tokens)):
            logits = request.process((yield DraftForward(token, cache.length + j, self.skip)), tokens)
            if params.greedy:
                chosen = logits.max(dim=-1).indices  # argmax's index, in a third of its time (greedy_decision)
                confidence = torch.softmax(logits, dim=-1)[chosen]
            else:
                q = probabilities(logits, params)
                chosen = torch.multinomial(q, 1, generator=request.generator)[0]
                confidence = q.max()
                dists.append(q)
            # Both come back together, with the other drafting requests' (one copy per position).
            token, confidence = yield DraftChoice(torch.stack([chosen.double(), confidence.double()]))
            token = int(token)
            if confidence < self.confidence_threshold:
                if dists:
                    dists.pop()
                break
            tokens.append(token)
            if token in request.eos_token_ids:
                break
        probs = torch.stack(dists) if dists else None
        return Draft(tokens, probs)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def summary(self) -> dict:
        return {}


def validate_skip(skip: Iterable[int], num_items: int) -> list[int]:
    chosen = sorted(set(skip))
    bad = [i for i in chosen if not 0 <= i < num_items]
    if bad:
        raise ConfigError(f"skip items {bad} are out of range: this model has items 0..{num_items - 1}")
    return chosen


def default_static_skip(num_layers: int, fraction: float = 0.25) -> list[int]:
    """A fixed skip set: attention items of early-middle layers.

    Screening fixed sets on SmolLM2 found early-middle attention the least harmful
    to skip; the first and last layers are always kept (as in KnapSpec's DP).
    """
    num_skip = max(1, round(fraction * num_layers))
    first = max(1, num_layers // 10)
    layers = range(first, min(num_layers - 1, first + num_skip))
    return [items.attention_item(i) for i in layers]
