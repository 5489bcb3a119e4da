"""A request's decoding: prefill once, then propose, verify in one forward, accept.

`DecodingRequest` holds one request's state; the continuous batcher's step (scheduler.py)
drives every request, alone or in a batch, through `plan_together`, `propose_together`, one
verify forward and `DecodingRequest.accept`. Plain autoregressive decoding is the same step
with a drafter that proposes nothing, so every strategy shares one verification and
acceptance path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipeline.decoding.batch_drafts import DraftBudget
from pipeline.decoding.drafters import Draft, DraftChoice, Drafter, DraftForward, DraftRequest, DraftSteps, NoDraft
from pipeline.decoding.sampling import (
    SamplingParams,
    check_finite,
    greedy_decision,
    greedy_emitted,
    non_finite,
    probabilities,
    raise_if_non_finite,
    sample,
    sampled_decision,
    sampled_emitted,
)
from pipeline.decoding.stats import GenerationStats
from pipeline.decoding.stopping import FINISH_EOS, FINISH_LENGTH, FINISH_SENTENCE, SentenceStop
from pipeline.errors import ConfigError
from pipeline.model.kv_cache import KVCache
from pipeline.model.packing import RequestRows
from pipeline.model.sublayer_model import SublayerModel


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    eos_token_ids: frozenset[int] = frozenset()
    stop: SentenceStop | None = None  # end on a sentence (stopping.py); None: at EOS or the budget only

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # one of stopping.FINISH_REASONS
    extra: dict = field(default_factory=dict)


@dataclass
class Prefilled:
    """A prompt's KV cache and the logits after its last token."""

    cache: KVCache
    logits: torch.Tensor  # [V]
    prompt_tokens: int
    seconds: float

    def copy(self) -> Prefilled:
        return Prefilled(self.cache.copy(), self.logits.clone(), self.prompt_tokens, self.seconds)


def prefill(model: SublayerModel, prompt_ids: torch.Tensor, max_new_tokens: int) -> Prefilled:
    """Run the prompt into a cache with room for the answer.

    Drafts never need more: `decode` drafts at most up to the token limit, so the last
    position a draft or verify writes is that of the last answer token.
    """
    if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
        raise ConfigError("prompt_ids must be a non-empty 1-D tensor of token ids")
    t0 = time.perf_counter()
    cache = model.new_cache(prompt_ids.numel() + max_new_tokens)
    logits = model.prefill(cache, prompt_ids.to(model.device))
    return Prefilled(cache, logits, prompt_ids.numel(), time.perf_counter() - t0)


def plan_together(model: SublayerModel, requests: Sequence[DecodingRequest], budget: DraftBudget) -> None:
    """Before a batch step: the requests whose drafters share a batch planner (KnapSpec for
    batches, knapspec/batch_plan.py) get one plan for all of them, made from the batch's
    step cost; alone, a request plans for itself."""
    groups: dict[int, tuple[object, list[DecodingRequest]]] = {}
    for request in requests:
        planner = request.drafter.batch_planner
        if planner is not None:
            groups.setdefault(id(planner), (planner, []))[1].append(request)
    for planner, members in groups.values():
        planner.prepare(model, members, budget.step_cost(planner.latency))


def propose_together(model: SublayerModel, requests: Sequence[DecodingRequest]) -> list[Draft | Exception]:
    """Every request's draft, their drafting forwards run together: at each draft position the
    requests still drafting with one sub-network share one batched forward (usually all share
    a plan: same strategy, same search history). A request whose drafter fails gets its error
    in its place; the others draft on."""
    drafts: list[Draft | Exception | None] = [None] * len(requests)
    asking: dict[int, tuple[DraftSteps, DraftForward | DraftChoice]] = {}

    def advance(i: int, steps: DraftSteps, answer) -> None:
        try:
            asking[i] = (steps, next(steps) if answer is None else steps.send(answer))
        except StopIteration as stop:
            asking.pop(i, None)
            drafts[i] = stop.value
        except Exception as e:  # one request's drafter failing must not take the batch with it
            asking.pop(i, None)
            drafts[i] = e

    for i, request in enumerate(requests):
        advance(i, request.propose_steps(model), None)
    while asking:
        choosing = [i for i, (_, asked) in asking.items() if isinstance(asked, DraftChoice)]
        if choosing:  # every drafting request's choices back to the host in one copy
            choices = [asking[i][1].values for i in choosing]
            values = torch.cat(choices).tolist()
            at = 0
            for i, chosen in zip(choosing, choices):
                mine, at = values[at : at + chosen.numel()], at + chosen.numel()
                advance(i, asking[i][0], mine)
            continue
        by_skip: dict[frozenset[int], list[int]] = {}
        for i, (_, forward) in asking.items():
            by_skip.setdefault(forward.skip, []).append(i)
        for skip, members in by_skip.items():
            blocks = [RequestRows(requests[i].cache, [asking[i][1].token], asking[i][1].position) for i in members]
            for i, logits in zip(members, model.forward_batch(blocks, skip=skip, logits="last")):
                advance(i, asking[i][0], logits[0])
    return drafts


class DecodingRequest:
    """One request's decoding state: what it emitted, its drafter, its statistics. The loops
    above drive it: propose a draft, verify it in a forward, accept."""

    def __init__(
        self,
        prefilled: Prefilled,
        config: DecodeConfig,
        params: SamplingParams,
        drafter: Drafter | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.cache = prefilled.cache
        self.config, self.params = config, params
        self.drafter = drafter or NoDraft()
        self.generator = params.generator(prefilled.logits.device)
        if prompt_ids is None and params.controls_repetition and params.repetition_scope == "all":
            raise ConfigError("repetition control over the prompt needs the prompt's token ids (prompt_ids)")
        # Repetition control processes every row this request's tokens are chosen from (repetition.py).
        self.repetition = params.repetition(prompt_ids or [])
        self.stats = GenerationStats(prompt_tokens=prefilled.prompt_tokens, prefill_s=prefilled.seconds)
        self._t0 = time.perf_counter()
        logits = prefilled.logits if self.repetition is None else self.repetition.process_row(prefilled.logits)
        self.pending = _choose(logits, params, self.generator)  # its KV is not in the cache yet
        if self.repetition is not None:
            self.repetition.extend([self.pending])
        self.output = [self.pending]
        self.history = list(prompt_ids or []) + self.output  # prompt + emitted, kept in step with `output`
        self.running = True
        self.finish_reason: str | None = None  # set when done (stopping.FINISH_REASONS)
        self._check_done()

    def propose_steps(self, model: SublayerModel) -> DraftSteps:
        """The proposal as steps, for drafting together with other requests (propose_together)."""
        return self.drafter.propose_steps(self._draft_request(model))

    def _draft_request(self, model: SublayerModel) -> DraftRequest:
        # Drafting past the token limit is wasted: the verify step emits one token more than it drafts.
        room = self.config.max_new_tokens - len(self.output) - 1
        return DraftRequest(
            model,
            self.cache,
            self.history,
            room,
            self.params,
            self.generator,
            self.config.eos_token_ids,
            self.repetition,
        )

    def verify_ids(self, draft: Draft) -> list[int]:
        """The rows a verify forward runs: the pending token and the draft [1 + n] (the forward
        moves them to the device with the rest of its step's metadata)."""
        return [self.pending, *draft.token_ids]

    def accept(self, draft: Draft, logits: torch.Tensor) -> None:
        """Accept from the verify forward's logits [1 + n, V] (decision, then take)."""
        self.take(draft, self.decision(draft, logits).tolist())

    def decision(self, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
        """Everything acceptance needs from the verify forward's logits [1 + n, V], computed on
        their device: greedy, each row's argmax (sampling.greedy_decision); sampling, every draw
        of speculative rejection sampling (sampling.sampled_decision); both with each row's
        finiteness first. A batch brings every request's back to the host in one copy. Under
        repetition control, row i is processed with the history and the draft's first i tokens."""
        if self.repetition is not None:
            logits = self.repetition.process(logits, draft.token_ids)
        if self.params.greedy:
            return greedy_decision(logits)
        probs = probabilities(logits, self.params)
        return torch.cat([non_finite(logits), sampled_decision(draft.token_ids, draft.probs, probs, self.generator)])

    def take(self, draft: Draft, decision: list[int]) -> None:
        """Accept the longest matching prefix and the model's own next token (greedy), or what
        speculative rejection sampling emits, from the decision back on the host."""
        rows = len(draft.token_ids) + 1
        if self.params.greedy:
            emitted = greedy_emitted(draft.token_ids, decision)
        else:
            raise_if_non_finite(decision[:rows])  # a NaN distribution's draws are garbage
            emitted = sampled_emitted(draft.token_ids, decision[rows:])
        num_accepted = len(emitted) - 1
        self.drafter.observe(len(draft.token_ids), num_accepted)
        # The verify forward wrote exact K/V for pending + the accepted drafts.
        self.cache.advance(1 + num_accepted)
        self.stats.steps += 1
        self.stats.drafted_tokens += len(draft.token_ids)
        self.stats.accepted_tokens += num_accepted
        stopped = None
        for token in emitted:
            if self.config.stop is not None and self.config.stop.stops_before(self.output, token):
                stopped = FINISH_SENTENCE
                break
            self.output.append(token)
            self.history.append(token)
            if self.repetition is not None:
                self.repetition.extend([token])
            if token in self.config.eos_token_ids or len(self.output) >= self.config.max_new_tokens:
                break
        self.pending = self.output[-1]
        self._check_done(stopped)

    def result(self) -> GenerationResult:
        # Searching drafters report their own numbers (search time, plans chosen).
        extra = self.drafter.summary()
        return GenerationResult(token_ids=self.output, stats=self.stats, finish_reason=self.finish_reason, extra=extra)

    def _check_done(self, stopped: str | None = None) -> None:
        if stopped is None and self.pending in self.config.eos_token_ids:
            stopped = FINISH_EOS
        elif stopped is None and len(self.output) >= self.config.max_new_tokens:
            stopped = FINISH_LENGTH
            if self.config.stop is not None:
                self.output, stopped = self.config.stop.at_budget(self.output)
        if stopped is not None:
            # In a batch, a request's decode time is the time it spent in the batch.
            self.running = False
            self.finish_reason = stopped
            self.stats.decode_s = time.perf_counter() - self._t0
            self.stats.output_tokens = len(self.output)


def _choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    check_finite(logits)
    if params.greedy:
        return int(logits.argmax())
    return sample(probabilities(logits, params), generator)
