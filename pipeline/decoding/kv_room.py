"""Where a batch's KV caches come from, and when a request may join.

A model whose caches can be slots of one pool (the whole model) gets one `KVPool` of fixed
slots, made once at the batch's first admission and never reallocated: its tensors keep
their addresses for the batch's life (a replica's life: a replica keeps its batcher), as a
captured GPU step needs. Every slot holds `slot_positions` positions — the longest request
the batch serves, which its owner sets (the summarize job: its longest prompt and answer) —
and there are as many as the budget holds, at most `max_batch`. A request joins when a slot
is free; one longer than a slot is refused at once, with its size and the pool's.

Slots, not pages: the attention kernels read a request's keys as one run of memory, and a
batch of summaries is of one shape (prompts cut to one budget, one answer budget), so a
slot sized to the longest request wastes little (docs/decoding.md, "KV memory").

A model whose caches live elsewhere (a pipeline's stages) gets caches of their own, each
counted at its prompt and answer against the budget.
"""

from __future__ import annotations

import logging

import torch

from pipeline.errors import ConfigError
from pipeline.model.decoder import Cache, DecoderModel
from pipeline.model.kv_pool import KVPool

logger = logging.getLogger(__name__)

# The share of a GPU's free memory (the model already loaded) a batch's KV pool takes unless told.
GPU_MEMORY_SHARE = 0.9


def kv_bytes_per_position(model: DecoderModel) -> int:
    """Bytes one cache position takes: keys and values of every layer."""
    s = model.spec
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.empty(0, dtype=model.dtype).element_size()


def default_budget(model: DecoderModel, max_batch: int, slot_positions: int) -> int:
    """On a GPU, a share of its free memory; elsewhere, `max_batch` requests of `slot_positions`."""
    device = torch.device(model.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(GPU_MEMORY_SHARE * free)
    return max_batch * slot_positions * kv_bytes_per_position(model)


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


class KVRoom:
    def __init__(
        self, model: DecoderModel, max_batch: int, budget_bytes: int | None = None, slot_positions: int | None = None
    ) -> None:
        """`budget_bytes`: what the batch's caches may take together (None: default_budget).
        `slot_positions`: the longest request (prompt, answer) the batch serves (None: the model's context)."""
        self.model = model
        self.position_bytes = kv_bytes_per_position(model)
        # No request passes the model's context (the batcher refuses it first).
        self.slot_positions = min(slot_positions or model.max_context, model.max_context)
        self.budget_bytes = (
            budget_bytes if budget_bytes is not None else default_budget(model, max_batch, self.slot_positions)
        )
        if self.budget_bytes < self.position_bytes:
            raise ConfigError(f"a KV budget of {self.budget_bytes} bytes holds not one cache position")
        self.pooled = model.pooled_caches
        # No slot at all is refused at the first submit, not here: a batch of adopted requests
        # (decode, each with a cache of its own) needs no pool.
        self.num_slots = min(max_batch, self.budget_bytes // (self.slot_positions * self.position_bytes))
        self.pool: KVPool | None = None  # made at the first admission, then kept
        self._held: dict[int, int] = {}  # ticket -> bytes of its cache

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    def check(self, positions: int) -> None:
        """Refuse at once a request that could never join."""
        if self.pooled and self.num_slots < 1:
            raise ConfigError(
                f"a KV budget of {mib(self.budget_bytes)} holds not one slot of {self.slot_positions} positions "
                f"({mib(self.slot_positions * self.position_bytes)}); raise the budget or lower the longest request"
            )
        if positions > self.slot_positions:
            limit = f"the KV pool's slots of {self.slot_positions} positions" if self.pooled else "the batch's limit"
            raise ConfigError(
                f"a request of {positions} positions (prompt and answer) does not fit {limit} "
                f"({self.num_slots} slots, {mib(self.budget_bytes)} budget); raise the longest request "
                "the batch serves or shorten the request"
            )
        if not self.pooled and positions * self.position_bytes > self.budget_bytes:
            raise ConfigError(
                f"a request of {positions} positions needs {mib(positions * self.position_bytes)} of KV cache, "
                f"more than the whole budget of {mib(self.budget_bytes)}; raise the KV budget or shorten the request"
            )

    def admits(self, positions: int) -> bool:
        """Whether a request of `positions` can join now (first come, first served: else it waits)."""
        if self.pooled:
            return self.pool is None or self.pool.num_free > 0
        return self.held_bytes + positions * self.position_bytes <= self.budget_bytes

    def take(self, ticket: int, positions: int) -> Cache:
        """A cache for an admitted request: a free slot of the pool, or one of its own."""
        if not self.pooled:
            cache = self.model.new_cache(positions)
            self._held[ticket] = positions * self.position_bytes
            return cache
        if self.pool is None:
            self.pool = self.model.new_pool(self.num_slots, self.slot_positions)
            logger.info(
                "KV pool: %d slots of %d positions, %s (budget %s)",
                self.num_slots, self.slot_positions, mib(self.pool.nbytes), mib(self.budget_bytes),
            )  # fmt: skip
        cache = self.pool.acquire(positions)
        self._held[ticket] = self.slot_positions * self.position_bytes
        return cache

    def hold(self, ticket: int, cache: Cache) -> None:
        """Count a cache the request brought along (adopted, already prefilled)."""
        self._held[ticket] = cache.capacity * self.position_bytes

    def give_back(self, ticket: int | None, cache: Cache | None, scrub: bool = False) -> None:
        self._held.pop(ticket, None)
        if cache is not None:
            self.model.release(cache, scrub)

    def clear(self) -> None:
        self._held.clear()
