"""A per-request key/value cache: preallocated plain tensors and a committed length.

Positions below `length` hold keys and values of committed tokens. A forward at
positions [start, start + T) writes there and attends to [0, start + T); what lies
beyond is never read, so rolling back a rejected draft is only `crop`. Speculative
drafts write past `length` for the attention items they execute; verification
rewrites those positions with the full model before `length` moves.
"""

from __future__ import annotations

import torch

from pipeline.errors import KnapSpecError


class CacheOverflow(KnapSpecError):
    """A forward or a commit would pass the positions a request's cache was allocated for."""


class CachePositions:
    """What every cache of a request shares, wherever its tensors live (a `KVCache` here, a
    `PipelineCache` over pipeline stages): a committed `length` and room for `capacity` positions."""

    length: int

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    def check_room(self, end: int) -> None:
        if end > self.capacity:
            raise CacheOverflow(
                f"KV cache overflow: position {end} is past its capacity {self.capacity}; "
                "allocate the cache for prompt + max_new_tokens + the longest draft"
            )

    def advance(self, num_tokens: int) -> None:
        self.commit(self.length + num_tokens)

    def commit(self, length: int) -> None:
        self.check_room(length)
        self.length = length

    def crop(self, length: int) -> None:
        """Roll the committed length back to `length` (the rest becomes scratch space)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length


class KVCache(CachePositions):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}")
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, kv_heads, capacity, head_dim]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [kv_heads, T, head_dim] at positions [start, start + T)."""
        # narrow + copy_, not slice assignment: Python's indexing costs more than the copy of a decode row.
        self.keys[layer].narrow(1, start, keys.shape[1]).copy_(keys)
        self.values[layer].narrow(1, start, values.shape[1]).copy_(values)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end): two [kv_heads, end, head_dim] views."""
        return self.keys[layer].narrow(1, 0, end), self.values[layer].narrow(1, 0, end)

    def copy(self) -> KVCache:
        """An independent copy (e.g. to give each benchmark repeat the same prefilled cache)."""
        clone = KVCache.__new__(KVCache)
        clone.keys = self.keys.clone()
        clone.values = self.values.clone()
        clone.length = self.length
        return clone
