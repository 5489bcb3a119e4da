"""One attention entry point for every kind of rows a forward serves.

A forward's rows are described once, and every attention item of it hands that description
to `Attention`, which picks the route:

- `BatchRows`: the rows of one or more requests, packed. A request's `Span` attends over its
  own cache (a prefill chunk; a decode or verify block of a request with a cache of its own);
  the short blocks of requests in slots of one pool attend together (packing.PooledRows).
- `Branches`: the knapsack DP's B versions of the same r tokens, each attending to one
  committed prefix (only read) and causally to its own keys and values.

The math is in `pipeline.model.layers`; this module only chooses it and says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.model.kv_cache import KVCache
from pipeline.model.layers import (
    FUSED_ATTENTION_MIN_TOKENS,
    aligned_keys,
    block_mask,
    fused_attention,
    group_queries,
    grouped_attention,
    kernel_attention,
    later_in_block,
    matmul_attention,
    pooled_attention,
    ungroup,
)
from pipeline.model.linear import KERNEL_MAX_ROWS
from pipeline.model.packing import PooledRows, pooled_rows


@dataclass(frozen=True)
class Span:
    """One request's rows [offset, offset + rows) of a packed batch, at positions
    [start, start + rows) of its `cache`; `mask` is its block's (layers.block_mask)."""

    cache: KVCache
    start: int
    rows: int
    offset: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class BatchRows:
    """The packed rows of requests: the spans attended each over its own cache (`own`, their
    indices), and the rest laid out for one attention over their pool (`pooled`)."""

    spans: tuple[Span, ...]
    own: tuple[int, ...]
    pooled: PooledRows | None
    num_rows: int

    @classmethod
    def of(cls, spans: Sequence[tuple[KVCache, int, int]], device: torch.device) -> BatchRows:
        """From each request's (cache, start, rows), in the order of the rows."""
        if len(spans) == 1:  # a request alone: nothing to pool, nothing to pack
            cache, start, n = spans[0]
            return cls((Span(cache, start, n, 0, block_mask(n, start, device)),), (0,), None, n)
        pooled, own = pooled_rows(spans, FUSED_ATTENTION_MIN_TOKENS)
        laid, offset = [], 0
        for j, (cache, start, n) in enumerate(spans):
            mask = block_mask(n, start, device) if pooled is None or j in own else None
            laid.append(Span(cache, start, n, offset, mask))
            offset += n
        return cls(tuple(laid), tuple(own), pooled, offset)


@dataclass(frozen=True)
class Branches:
    """B branches of the same r tokens at positions [prefix, prefix + r) of `cache`: each attends
    to the keys below `prefix` (shared, only read: the DP explores drafts without disturbing the
    request) and causally to its own; `later` hides a token's later ones (layers.later_in_block)."""

    cache: KVCache
    prefix: int
    later: torch.Tensor | None

    @classmethod
    def of(cls, cache: KVCache, prefix: int, num_tokens: int, device: torch.device) -> Branches:
        return cls(cache, prefix, later_in_block(num_tokens, device))


class Attention:
    """Attention of a layer's queries, keys and values [B, T, heads, head_dim] (B = 1 for
    BatchRows) over the rows they describe -> [B * T, H * head_dim]. The rows' own keys and
    values are written into their caches first, except for branches, which only read."""

    def __init__(self, num_kv_heads: int, head_dim: int, kernel: bool) -> None:
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5
        self.kernel = kernel  # the fused CPU kernel for short blocks (short_attention.py)

    def __call__(self, layer: int, q, k, v, rows: BatchRows | Branches) -> torch.Tensor:
        if isinstance(rows, Branches):
            return self._branches(layer, q, k, v, rows)
        q, k, v = q[0], k[0], v[0]  # [M, heads, head_dim]
        if rows.pooled is not None and not rows.own:
            return self._pooled(layer, q, k, v, rows.pooled)
        if rows.pooled is None and len(rows.own) == 1:
            return self._span(layer, q, k, v, rows.spans[0])
        # Every request's rows written into one tensor: no concatenation of a prefill chunk.
        out = q.new_empty(rows.num_rows, q.shape[1] * q.shape[2])
        if rows.pooled is not None:
            index = rows.pooled.rows
            out[index] = self._pooled(layer, q[index], k[index], v[index], rows.pooled)
        for j in rows.own:
            span = rows.spans[j]
            at = slice(span.offset, span.offset + span.rows)
            self._span(layer, q[at], k[at], v[at], span, out[at])
        return out

    def _span(self, layer: int, q, k, v, span: Span, out: torch.Tensor | None = None) -> torch.Tensor:
        """One request's block: its keys and values into its cache, then attention over the cache
        up to the block's end; a short block through the kernel up to the kernel linears' rows,
        so that a long verify stays row-exact."""
        cache, start = span.cache, span.start
        num_tokens, end = q.shape[0], start + q.shape[0]
        cache.write(layer, start, k.transpose(0, 1), v.transpose(0, 1))
        if num_tokens >= FUSED_ATTENTION_MIN_TOKENS and not (self.kernel and num_tokens <= KERNEL_MAX_ROWS):
            return fused_attention(q, *cache.view(layer, end), start, span.mask, self.scale, out)
        if self.kernel:
            result = kernel_attention(q * self.scale, *cache.view(layer, end), start, self.num_kv_heads)
        else:
            keys, values = cache.view(layer, aligned_keys(end, cache.capacity, q.device))  # [kv_heads, n, head_dim]
            result = matmul_attention(q * self.scale, keys, values, start, span.mask, self.num_kv_heads)
        return result if out is None else out.copy_(result)

    def _pooled(self, layer: int, q, k, v, pooled: PooledRows) -> torch.Tensor:
        """The pooled rows' keys and values into their slots, then attention over runs of the slots."""
        pool = pooled.pool
        pool.keys[layer][pooled.slots, :, pooled.positions] = k
        pool.values[layer][pooled.slots, :, pooled.positions] = v
        return pooled_attention(q * self.scale, pooled, layer, self.num_kv_heads, self.kernel)

    def _branches(self, layer: int, q, k, v, rows: Branches) -> torch.Tensor:
        prefix_k, prefix_v = rows.cache.view(layer, rows.prefix)  # [kv_heads, p, head_dim]
        # [kv_heads, B, r, head_dim]: each branch's own keys and values
        own_k, own_v = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
        qg = group_queries(q * self.scale, self.num_kv_heads)
        return ungroup(grouped_attention(qg, prefix_k, prefix_v, own_k, own_v, rows.later))
