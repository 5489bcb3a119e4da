"""Continuous batching: many requests decode together, each joining after its prefill and
leaving at EOS or its limit without waiting for the others.

A `ContinuousBatcher` step is one batched forward (`SublayerModel.forward_batch`): the
verify rows of every running request (its pending token and its own draft, of its own
length or none) and, when a request is being prefilled, the next chunk of its prompt. So a
running request never waits more than one chunk for a long prompt, and a prompt's rows
share the linears with the decode rows. Admission is first come, first served, up to
`max_batch` requests and a KV-memory budget: each request is counted at its prompt and
answer when admitted; one that could never fit is refused at `submit`. Where the model has
one, the caches are slots of one KV pool (pipeline/model/kv_pool.py), so that one attention
serves every decoding request of a step.

The batcher is pure of threads; `pipeline.decoding.serving` drives it from one.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import torch

from pipeline.decoding.batch_drafts import DraftBudget
from pipeline.decoding.drafters import Drafter
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
from pipeline.model.kv_cache import KVCache
from pipeline.model.kv_pool import KVPool, PooledCache
from pipeline.model.packing import RequestRows

logger = logging.getLogger(__name__)

# KV pool slots grow in steps of this many positions: requests of about one length share a
# slot size without a regrowth for every few tokens more.
POOL_STEP = 256


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


def kv_bytes_per_position(model) -> int:
    """Bytes one cache position takes: keys and values of every layer."""
    s = model.spec
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.empty(0, dtype=model.dtype).element_size()


class ContinuousBatcher:
    """Up to `max_batch` requests in one batch; `step` advances all of them by one forward."""

    def __init__(
        self,
        model,
        max_batch: int,
        kv_budget_bytes: int | None = None,
        prefill_chunk: int | None = None,
        budget: DraftBudget | None = None,
    ) -> None:
        """`kv_budget_bytes`: what all caches together may take (None: `max_batch` caches at the
        model's whole context). `prefill_chunk`: prompt rows per step (None: the model's).
        `budget`: the draft budget and step-cost fit (None: the batcher's own, from the table)."""
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if not hasattr(model, "forward_batch"):
            raise ConfigError(f"{type(model).__name__} has no batched forward; decode its requests one at a time")
        self.model = model
        self.max_batch = max_batch
        self.position_bytes = kv_bytes_per_position(model)
        if kv_budget_bytes is None:
            kv_budget_bytes = max_batch * model.max_context * self.position_bytes
        if kv_budget_bytes < self.position_bytes:
            raise ConfigError(f"a KV budget of {kv_budget_bytes} bytes holds not one cache position")
        self.kv_budget_bytes = kv_budget_bytes
        self.prefill_chunk = prefill_chunk or model.prefill_chunk
        self.waiting: collections.deque[tuple[int, GenerationRequest]] = collections.deque()
        self.prefilling: collections.deque[_Prefilling] = collections.deque()
        self.running: dict[int, DecodingRequest] = {}
        self._reserved: dict[int, int] = {}  # ticket -> bytes of its cache
        self._tickets = iter(range(1 << 62))
        self.steps = 0
        # How much of each draft pays in the batch, learning its step cost.
        self.budget = budget if budget is not None else DraftBudget()
        self.pool: KVPool | None = None  # made at the first admission

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
        needed = request.positions * self.position_bytes
        if needed > self.kv_budget_bytes:
            raise ConfigError(
                f"a request of {request.positions} positions needs {needed / 2**20:.1f} MiB of KV cache, more than "
                f"the whole budget of {self.kv_budget_bytes / 2**20:.1f} MiB; raise the KV budget or shorten the request"
            )

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request; returns its ticket. Raises ConfigError if it could never run."""
        self.check(request)
        ticket = next(self._tickets)
        self.waiting.append((ticket, request))
        return ticket

    @property
    def num_requests(self) -> int:
        """Requests not finished yet: waiting, being prefilled, or decoding."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    # ----------------------------------------------------------------- steps

    def step(self) -> list[Finished]:
        """Admit what fits, then one forward: every running request's verify rows and the next
        prefill chunk. Returns the requests that left the batch in this step."""
        self._admit()
        finished: list[Finished] = []
        running = list(self.running.items())
        try:
            if running:
                plan_together(self.model, [request for _, request in running], self.budget)
            drafts = propose_together(self.model, [request for _, request in running]) if running else []
        except Exception as e:  # a batched draft forward failed (a lost stage): as a failed verify
            logger.exception("A batched draft forward of %d requests failed", len(running))
            return [self._fail(ticket, e) for ticket, _ in running]
        for (ticket, _), draft in zip(running, drafts):
            if isinstance(draft, Exception):  # its drafter failed: it leaves, the batch goes on
                logger.error("Request %d: its drafter failed", ticket, exc_info=draft)
                finished.append(self._fail(ticket, draft))
        pairs = [(t, r, d) for (t, r), d in zip(running, drafts) if not isinstance(d, Exception)]
        fitted = self.budget.fit([r for _, r, _ in pairs], [d for _, _, d in pairs])
        pairs = [(t, r, d) for (t, r, _), d in zip(pairs, fitted)]
        blocks = [RequestRows(r.cache, r.verify_ids(d, self.model.device), r.cache.length) for _, r, d in pairs]
        chunk = self._next_chunk()
        if chunk is not None:
            blocks.append(chunk)
        if not blocks:
            return finished
        started = time.perf_counter()
        try:
            outputs = self.model.forward_batch(blocks, logits="all")
        except Exception as e:
            # Every request in this forward shares its fate; the queue goes on.
            logger.exception("A batched forward of %d requests failed", len(blocks))
            finished += [self._fail(ticket, e) for ticket, _, _ in pairs]
            if chunk is not None:
                failed = self.prefilling.popleft()
                finished.append(self._fail(failed.ticket, e, failed.cache))
            return finished
        seconds = time.perf_counter() - started
        self.steps += 1
        if chunk is None:  # a prefill chunk's rows cost by other rules than the step model's
            self.budget.observe([r for _, r, _ in pairs], [d for _, _, d in pairs], seconds)
        for (ticket, request, draft), logits in zip(pairs, outputs):
            request.accept(draft, logits)
            if not request.running:
                finished.append(self._finish(ticket, request))
        if chunk is not None:
            finished += self._chunk_done(chunk, outputs[-1], seconds)
        return finished

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
        self._reserved.clear()
        for cache in caches:
            self._release(cache)

    # -------------------------------------------------------------- helpers

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            ticket, request = self.waiting[0]
            needed = request.positions * self.position_bytes
            if self.reserved_bytes + needed > self.kv_budget_bytes:
                return  # first come, first served: it waits until running requests leave
            self.waiting.popleft()
            self._reserved[ticket] = needed
            self.prefilling.append(_Prefilling(ticket, request, self._new_cache(request.positions)))

    def _new_cache(self, positions: int):
        """A slot of the batch's KV pool where the model has one and the pool fits the budget
        (its slots are as long as the longest request yet, in steps of POOL_STEP); else a cache
        of its own."""
        if not hasattr(self.model, "new_pool"):
            return self.model.new_cache(positions)
        capacity = min(-(-positions // POOL_STEP) * POOL_STEP, self.model.max_context)
        if self.pool is None:
            if self.max_batch * capacity * self.position_bytes <= self.kv_budget_bytes:
                self.pool = self.model.new_pool(self.max_batch, capacity)
        elif capacity > self.pool.slot_capacity and self.pool.bytes_for(capacity) > self.kv_budget_bytes:
            return self.model.new_cache(positions)
        return self.pool.acquire(positions) if self.pool is not None else self.model.new_cache(positions)

    def _next_chunk(self) -> RequestRows | None:
        if not self.prefilling:
            return None
        p = self.prefilling[0]
        ids = p.request.prompt_ids[p.fed : p.fed + self.prefill_chunk].to(self.model.device)
        last = p.fed + ids.numel() == p.request.prompt_ids.numel()
        return RequestRows(p.cache, ids, p.fed, logits="last" if last else "none")

    def _chunk_done(self, chunk: RequestRows, logits: torch.Tensor | None, seconds: float) -> list[Finished]:
        p = self.prefilling[0]
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

    def _fail(self, ticket: int, error: BaseException, cache=None) -> Finished:
        request = self.running.get(ticket)
        self._leave(ticket, request.cache if request is not None else cache)
        return Finished(ticket, error=error)

    def _leave(self, ticket: int, cache) -> None:
        self.running.pop(ticket, None)
        self._reserved.pop(ticket, None)
        self._release(cache)

    def _release(self, cache) -> None:
        if isinstance(cache, PooledCache):
            cache.pool.release(cache)
            return
        # A model whose caches live elsewhere (pipeline stages) frees them when told.
        release = getattr(self.model, "release", None)
        if release is not None and cache is not None:
            release(cache)
