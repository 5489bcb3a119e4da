"""KV caches of a batch as slots of one pool, so that a batched forward attends for all its
decoding requests at once.

A pool holds keys and values `[layers, slots, kv_heads, slot_capacity, head_dim]`: one
layer's caches of every slot are one strided tensor, and the decode and verify rows of
many requests become two batched matmuls over it (`layers.pooled_attention`) instead of
two per request — on CPU the per-request loop's small operations cost as much as the
attention itself at a batch of eight. A slot is a `KVCache` whose tensors are views into
the pool, so everything else (prefill, drafts, the DP) uses it as any cache. A pool is
allocated once and never grows: its addresses hold for its life (decoding/kv_room.py).
"""

from __future__ import annotations

import heapq

import torch

from pipeline.errors import ConfigError
from pipeline.model.kv_cache import KVCache


class PooledCache(KVCache):
    """One slot of a KVPool: a request's cache, `capacity` positions of the slot's."""

    def __init__(self, pool: KVPool, slot: int, capacity: int) -> None:
        # No allocation: the tensors are the pool's (see KVPool.acquire).
        self.pool, self.slot, self._capacity = pool, slot, capacity
        self.length = 0
        # Views of this slot, [layers, kv_heads, slot_capacity, head_dim]: the pool never moves.
        self.keys = pool.keys[:, slot]
        self.values = pool.values[:, slot]

    @property
    def capacity(self) -> int:
        return self._capacity

    def copy(self) -> KVCache:
        """An independent plain cache with the same contents."""
        clone = KVCache.__new__(KVCache)
        clone.keys = self.keys[:, :, : self._capacity].clone()
        clone.values = self.values[:, :, : self._capacity].clone()
        clone.length = self.length
        return clone


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        slot_capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        scratch: bool = False,
    ) -> None:
        """`scratch`: one more position past every slot's capacity, never handed out nor read,
        where a captured step's padding rows write their keys and values (graphs.static_step)."""
        if num_slots < 1 or slot_capacity < 1:
            raise ConfigError(f"a KV pool needs slots and positions, got {num_slots} × {slot_capacity}")
        self.scratch_position = slot_capacity if scratch else None
        self.shape = (num_layers, num_slots, num_kv_heads, slot_capacity + scratch, head_dim)
        # Zeros, not empty: a slot's positions past its request's are read (and weighted 0) by
        # the batched attention, and 0 × NaN would not be 0. Plain tensors wherever the pool is
        # made (inference mode or not), so that a compiled attention meets one kind of them.
        with torch.inference_mode(False):
            self.keys = torch.zeros(self.shape, dtype=dtype, device=device)
            self.values = torch.zeros(self.shape, dtype=dtype, device=device)
        self._free = list(range(num_slots))  # a heap: low slots first, so live ones stay together
        self.live: set[int] = set()  # slots handed out (numbers: a cache refers to its pool, not back)
        self.graphs = None  # a model's captured steps over this pool (graphs.StepGraphs), from its first one

    @property
    def num_slots(self) -> int:
        return self.shape[1]

    @property
    def slot_capacity(self) -> int:
        """The positions a slot holds for its request (the scratch position not counted)."""
        return self.shape[3] - (self.scratch_position is not None)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, capacity: int) -> PooledCache:
        if not self._free:
            raise ConfigError(f"all {self.num_slots} slots of the KV pool are taken")
        if capacity > self.slot_capacity:
            raise ConfigError(f"a cache of {capacity} positions does not fit the pool's slots of {self.slot_capacity}")
        slot = heapq.heappop(self._free)
        cache = PooledCache(self, slot, capacity)
        self.live.add(slot)
        return cache

    def adopt(self, cache: KVCache) -> PooledCache:
        """A slot holding a copy of `cache` (its capacity and committed length)."""
        slot = self.acquire(cache.capacity)
        slot.keys[:, :, : cache.length] = cache.keys[:, :, : cache.length]
        slot.values[:, :, : cache.length] = cache.values[:, :, : cache.length]
        slot.length = cache.length
        return slot

    def release(self, cache: PooledCache, scrub: bool = False) -> None:
        """Free the cache's slot. `scrub`: zero it first. A batched attention reads a run of
        slots up to its longest request and masks the rest, and a masked NaN value still
        poisons the product (0 × NaN), so a slot a failed request may have left NaN in is
        cleared before its next request."""
        if cache.slot in self.live:
            self.live.remove(cache.slot)
            if scrub:
                self.keys[:, cache.slot].zero_()
                self.values[:, cache.slot].zero_()
            heapq.heappush(self._free, cache.slot)

    def layer(self, index: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values of slots [first, end): two [(end - first) * kv_heads,
        slot_capacity, head_dim] views (slot-major, as the batched attention reads them)."""
        _, _, kv_heads, capacity, head_dim = self.shape
        shape = ((end - first) * kv_heads, capacity, head_dim)
        return self.keys[index, first:end].view(shape), self.values[index, first:end].view(shape)
