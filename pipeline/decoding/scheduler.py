"""Continuous batching: many requests decode together, each joining after its prefill and
leaving at EOS or its limit without waiting for the others.

A `ContinuousBatcher` step is one batched forward (`SublayerModel.forward_batch`): the
verify rows of every running request (its pending token and its own draft, of its own
length or none) and, when a request is being prefilled, the next chunk of its prompt. So a
running request never waits more than one chunk for a long prompt, and a prompt's rows
share the linears with the decode rows. Admission is first come, first served, up to
`max_batch` requests and the batch's KV room (kv_room.py): where the model pools its
caches, a free slot of one KV pool made once and never reallocated, so that one attention
serves every decoding request of a step; one that could never fit is refused at `submit`.

Its step is the only draft → verify → accept loop of the house: a request decoded alone is
a batch of one, and prefilled requests decoded together are adopted into one batch
(decode.py). The batcher is pure of threads; `pipeline.decoding.serving` drives it from one.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import torch

from pipeline.decoding.batch_drafts import DraftBudget, pooled
from pipeline.decoding.drafters import Drafter
from pipeline.decoding.isolation import forward_isolating
from pipeline.decoding.kv_room import KVRoom
from pipeline.decoding.loop import (
    DecodeConfig,
    DecodingRequest,
    GenerationResult,
    Prefilled,
    plan_together,
    propose_together,
)
from pipeline.decoding.sampling import SamplingParams
from pipeline.errors import ConfigError
from pipeline.model.decoder import DecoderModel
from pipeline.model.kv_cache import KVCache
from pipeline.model.kv_pool import KVPool
from pipeline.model.packing import RequestRows

logger = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    """What a caller submits: a prompt, its limits and sampling, and its drafter (None: `ar`)."""

    prompt_ids: torch.Tensor  # [T], 1-D
    config: DecodeConfig
    params: SamplingParams = SamplingParams()
    drafter: Drafter | None = None

    @property
    def positions(self) -> int:
        """Cache positions the request needs: drafts never pass the answer's last token."""
        return self.prompt_ids.numel() + self.config.max_new_tokens


@dataclass(frozen=True)
class StepRecord:
    """One decode step of a batch: the requests it verified, the tokens they emitted, and the
    seconds of the whole step (drafting, verifying and accepting)."""

    running: int
    emitted: int
    seconds: float


@dataclass
class Finished:
    """A request that left the batch: its result, or why it failed."""

    ticket: int
    result: GenerationResult | None = None
    error: BaseException | None = None


@dataclass
class _Prefilling:
    ticket: int
    request: GenerationRequest
    cache: KVCache
    fed: int = 0  # prompt tokens already in the cache
    seconds: float = 0.0  # time of the forwards that carried its chunks


class ContinuousBatcher:
    """Up to `max_batch` requests in one batch; `step` advances all of them by one forward."""

    def __init__(
        self,
        model: DecoderModel,
        max_batch: int,
        kv_budget_bytes: int | None = None,
        prefill_chunk: int | None = None,
        budget: DraftBudget | None = None,
        step_log: list[StepRecord] | None = None,
        slot_positions: int | None = None,
    ) -> None:
        """`kv_budget_bytes`, `slot_positions`: what the batch's caches may take together, and the
        longest request (prompt and answer) it serves (kv_room.KVRoom). `prefill_chunk`: prompt
        rows per step (None: the model's). `budget`: the draft budget and step-cost fit (None: the
        batcher's own, from the table). `step_log`, if given, gets a StepRecord of every step that
        verified and carried no prompt."""
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = max_batch
        self.room = KVRoom(model, max_batch, kv_budget_bytes, slot_positions)
        self.prefill_chunk = prefill_chunk or model.prefill_chunk
        self.waiting: collections.deque[tuple[int, GenerationRequest]] = collections.deque()
        self.prefilling: collections.deque[_Prefilling] = collections.deque()
        self.running: dict[int, DecodingRequest] = {}
        self._tickets = iter(range(1 << 62))
        self.steps = 0
        self._finished_early: list[Finished] = []  # adopted requests that had ended already
        # How much of each draft pays in the batch, learning its step cost.
        self.budget = budget if budget is not None else DraftBudget()
        self.step_log = step_log

    # --------------------------------------------------------------- intake

    def check(self, request: GenerationRequest) -> None:
        """Refuse at once what could never run: a bad prompt, or a cache past the budget or context."""
        if request.prompt_ids.ndim != 1 or request.prompt_ids.numel() == 0:
            raise ConfigError("prompt_ids must be a non-empty 1-D tensor of token ids")
        if request.positions > self.model.max_context:
            raise ConfigError(
                f"{request.prompt_ids.numel()} prompt tokens + {request.config.max_new_tokens} new tokens exceed "
                f"this model's {self.model.max_context}-token context; shorten the prompt or lower max_new_tokens"
            )
        self.room.check(request.positions)

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request; returns its ticket. Raises ConfigError if it could never run."""
        self.check(request)
        ticket = next(self._tickets)
        self.waiting.append((ticket, request))
        return ticket

    def adopt(self, request: DecodingRequest) -> int:
        """Decode a request already prefilled (its cache its own, or a slot of a pool); returns
        its ticket. It joins the running requests at once: adopting is for a caller that fills
        the batch itself (`decode`), not past `max_batch`."""
        if len(self.running) + len(self.prefilling) >= self.max_batch:
            raise ConfigError(f"the batch already runs {self.max_batch} requests")
        ticket = next(self._tickets)
        if not request.running:  # its first token ended it
            self._finished_early.append(self._finish(ticket, request))
            return ticket
        self.room.hold(ticket, request.cache)
        self.running[ticket] = request
        return ticket

    @property
    def num_requests(self) -> int:
        """Requests not finished yet: waiting, being prefilled, or decoding."""
        return len(self.waiting) + len(self.prefilling) + len(self.running) + len(self._finished_early)

    @property
    def reserved_bytes(self) -> int:
        """What the caches of the batch's requests take (a pool's slot counted whole)."""
        return self.room.held_bytes

    @property
    def pool(self) -> KVPool | None:
        return self.room.pool

    # ----------------------------------------------------------------- steps

    def step(self) -> list[Finished]:
        """Admit what fits, then one forward: every running request's verify rows and the next
        prefill chunk. Returns the requests that left the batch in this step.

        A failure costs only its own request: a drafter, a bookkeeping step or non-finite
        logits end the request they belong to, and a failed forward is run again in halves
        until the request that broke it is found (isolation.py)."""
        finished = self._admit() + self._finished_early
        self._finished_early = []
        step_started = time.perf_counter()
        running = list(self.running.items())
        drafts = self._drafts([request for _, request in running])
        pairs = []
        for (ticket, request), draft in zip(running, drafts):
            if isinstance(draft, Exception):  # its drafter failed: it leaves, the batch goes on
                logger.error("Request %d: its drafter failed", ticket, exc_info=draft)
                finished.append(self._fail(ticket, draft))
            else:
                pairs.append((ticket, request, draft))
        caches, latencies = [r.cache for _, r, _ in pairs], [r.drafter.latency for _, r, _ in pairs]
        fitted = self.budget.fit([d for _, _, d in pairs], [c.length for c in caches], pooled(caches), latencies)
        blocks, kept = [], []
        for (ticket, request, _), draft in zip(pairs, fitted):
            try:
                blocks.append(RequestRows(request.cache, request.verify_ids(draft), request.cache.length))
            except Exception as e:
                finished.append(self._fail(ticket, e, what="its verify rows"))
            else:
                kept.append((ticket, request, draft))
        pairs = kept
        chunk = self._next_chunk(finished)
        if chunk is not None:
            blocks.append(chunk)
        if not blocks:
            return finished
        started = time.perf_counter()
        outputs, isolated = forward_isolating(self.model, blocks)
        seconds = time.perf_counter() - started
        self.steps += 1
        if chunk is None and not isolated:  # a prefill chunk's rows cost by other rules than the step model's
            caches = [r.cache for _, r, _ in pairs]
            self.budget.observe([d for _, _, d in pairs], [c.length for c in caches], pooled(caches), seconds)
        emitted = sum(len(r.output) for _, r, _ in pairs) if self.step_log is not None else 0
        finished += self._accept(pairs, outputs)
        if chunk is not None:
            finished += self._chunk_done(chunk, outputs[-1], seconds)
        elif self.step_log is not None and not isolated:
            emitted = sum(len(r.output) for _, r, _ in pairs) - emitted
            self.step_log.append(StepRecord(len(pairs), emitted, time.perf_counter() - step_started))
        return finished

    def _accept(self, pairs: list, outputs: list) -> list[Finished]:
        """Every request's acceptance from its verify logits: decided on the device, brought back
        to the host in one copy for the whole batch, then taken. A request whose forward or
        acceptance failed leaves; the batch goes on."""
        finished, decided = [], []
        for (ticket, request, draft), logits in zip(pairs, outputs):
            if isinstance(logits, BaseException):
                finished.append(self._fail(ticket, logits, what="its verify forward"))
                continue
            try:
                decided.append((ticket, request, draft, request.decision(draft, logits)))
            except Exception as e:
                finished.append(self._fail(ticket, e, what="its acceptance"))
        if not decided:
            return finished
        values = torch.cat([decision for *_, decision in decided]).tolist()  # the step's one copy back
        at = 0
        for ticket, request, draft, decision in decided:
            mine, at = values[at : at + decision.numel()], at + decision.numel()
            try:
                request.take(draft, mine)
                if not request.running:
                    finished.append(self._finish(ticket, request))
            except Exception as e:  # its acceptance or result: this request's own, the batch goes on
                finished.append(self._fail(ticket, e, what="its acceptance"))
        return finished

    def _drafts(self, requests: list[DecodingRequest]) -> list:
        """Each running request's draft (or the exception its drafter raised). A batched draft
        forward that fails is tried again one request at a time, so that only the requests
        that fail alone fail."""
        if not requests:
            return []
        try:
            plan_together(self.model, requests, self.budget)
            return propose_together(self.model, requests)
        except Exception:
            if len(requests) == 1:
                raise
            logger.exception("A batched draft of %d requests failed; drafting each alone", len(requests))
        drafts = []
        for request in requests:
            try:
                plan_together(self.model, [request], self.budget)
                drafts += propose_together(self.model, [request])
            except Exception as e:
                drafts.append(e)
        return drafts

    def run(self) -> list[Finished]:
        """Step until every submitted request has finished."""
        finished = []
        while self.num_requests:
            finished += self.step()
        return finished

    def abort(self) -> None:
        """Drop every request (their caches go with them)."""
        caches = [p.cache for p in self.prefilling] + [r.cache for r in self.running.values()]
        self.waiting.clear()
        self.prefilling.clear()
        self.running.clear()
        self.room.clear()
        for cache in caches:
            self.room.give_back(None, cache)

    # -------------------------------------------------------------- helpers

    def _admit(self) -> list[Finished]:
        """Move waiting requests into prefill while the batch and the KV room allow; one whose
        cache cannot be made fails alone."""
        failed = []
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            ticket, request = self.waiting[0]
            if not self.room.admits(request.positions):
                break  # first come, first served: it waits until running requests leave
            self.waiting.popleft()
            try:
                cache = self.room.take(ticket, request.positions)
            except Exception as e:
                failed.append(self._fail(ticket, e, what="its admission"))
                continue
            self.prefilling.append(_Prefilling(ticket, request, cache))
        return failed

    def _next_chunk(self, finished: list[Finished]) -> RequestRows | None:
        """The first prefilling request's next prompt chunk (one that fails to make one leaves, into `finished`)."""
        while self.prefilling:
            p = self.prefilling[0]
            try:
                ids = p.request.prompt_ids[p.fed : p.fed + self.prefill_chunk].to(self.model.device)
            except Exception as e:
                self.prefilling.popleft()
                finished.append(self._fail(p.ticket, e, p.cache, what="its prompt chunk"))
                continue
            last = p.fed + ids.numel() == p.request.prompt_ids.numel()
            return RequestRows(p.cache, ids, p.fed, logits="last" if last else "none")
        return None

    def _chunk_done(self, chunk: RequestRows, logits, seconds: float) -> list[Finished]:
        """After the forward that carried a prompt chunk: the request moves on, starts decoding
        when its prompt is in, or leaves with the forward's error or its own."""
        p = self.prefilling[0]
        if isinstance(logits, BaseException):
            self.prefilling.popleft()
            return [self._fail(p.ticket, logits, p.cache, what="its prefill forward")]
        try:
            return self._prefill_advanced(p, chunk, logits, seconds)
        except Exception as e:
            if self.prefilling and self.prefilling[0] is p:
                self.prefilling.popleft()
            self.running.pop(p.ticket, None)
            return [self._fail(p.ticket, e, p.cache, what="its prefill")]

    def _prefill_advanced(self, p: _Prefilling, chunk: RequestRows, logits, seconds: float) -> list[Finished]:
        p.fed += chunk.token_ids.numel()
        p.seconds += seconds
        if logits is None:
            return []
        self.prefilling.popleft()
        p.cache.commit(p.fed)
        prompt = p.request.prompt_ids
        prefilled = Prefilled(p.cache, logits[0], prompt.numel(), p.seconds)
        request = DecodingRequest(prefilled, p.request.config, p.request.params, p.request.drafter, prompt.tolist())
        if not request.running:  # its first token ended it (EOS, or a limit of one)
            return [self._finish(p.ticket, request)]
        self.running[p.ticket] = request
        return []

    def _finish(self, ticket: int, request: DecodingRequest) -> Finished:
        self._leave(ticket, request.cache)
        return Finished(ticket, result=request.result())

    def _fail(self, ticket: int, error: BaseException, cache=None, what: str | None = None) -> Finished:
        if what is not None:
            logger.error("Request %d failed in %s: %s: %s", ticket, what, type(error).__name__, error)
        request = self.running.get(ticket)
        # What a failed request leaves in its slot (NaN, say) must not reach the slot's next one.
        self._leave(ticket, request.cache if request is not None else cache, scrub=True)
        return Finished(ticket, error=error)

    def _leave(self, ticket: int, cache, scrub: bool = False) -> None:
        self.running.pop(ticket, None)
        self.room.give_back(ticket, cache, scrub)
