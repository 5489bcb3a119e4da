"""One attention entry point for every kind of rows a forward serves.

A forward's rows are described once, and every attention item of it hands that description
to `Attention`, which picks the route:

- `BatchRows`: the rows of one or more requests, packed. A request's `Span` attends over its
  own cache (a prefill chunk; a decode or verify block of a request with a cache of its own);
  the short blocks of requests in slots of one pool attend together (packing.PooledRows).
- `SlotRows`: a captured step's rows (graphs.static_step): R requests of T rows each in slots
  of one pool, every index on the device and every shape fixed by the step's bucket.
- `Branches`: the knapsack DP's B versions of the same r tokens, each attending to one
  committed prefix (only read) and causally to its own keys and values.

The math is in `pipeline.model.layers`; this module only chooses it and says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.model.flex import SlotBlocks, flex_slot_attention
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
    slot_attention,
    split_attention,
    ungroup,
    unseen_keys,
)
from pipeline.model.linear import KERNEL_MAX_ROWS
from pipeline.model.packing import PooledRows


@dataclass(frozen=True)
class Span:
    """One request's rows [offset, offset + rows) of a packed batch, at positions
    [start, start + rows) of its `cache` (`positions`, on the device). A long block's `mask`
    (layers.block_mask); a short one's keys seen per row, as the fused kernel takes them
    (`seen`, [1, rows] int32), or as the matmuls do: `width` keys read (a bucket,
    layers.aligned_keys), the ones each row must not see `hidden` [rows, width]. A long block
    split at its start (layers.split_attention) needs no mask."""

    cache: KVCache
    start: int
    rows: int
    offset: int
    mask: torch.Tensor | None
    positions: torch.Tensor
    seen: torch.Tensor | None = None
    width: int = 0
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchRows:
    """The packed rows of requests: the spans attended each over its own cache (`own`, their
    indices), and the rest laid out for one attention over their pool (`pooled`)."""

    spans: tuple[Span, ...]
    own: tuple[int, ...]
    pooled: PooledRows | None
    num_rows: int

    @classmethod
    def of(
        cls,
        spans: Sequence[tuple[KVCache, int, int]],
        own: Sequence[int],
        pooled: PooledRows | None,
        positions: torch.Tensor,
        kernel: bool,
        long_masks: bool = True,
    ) -> BatchRows:
        """From each request's (cache, start, rows) in the order of the rows, the ones attended
        over their own caches (`own`) and the pool's layout of the rest (packing.plan_pooled),
        every row's position on the device, whether short blocks take the fused kernel, and
        whether long ones need masks (not when split, Attention.split_dtype). Every mask is
        made here, from the device's positions, once per forward."""
        laid, offset = [], 0
        for j, (cache, start, n) in enumerate(spans):
            at = positions[offset : offset + n]
            if j not in own:
                laid.append(Span(cache, start, n, offset, None, at))
            elif _takes_fused(n, kernel):
                mask = block_mask(n, start, positions.device) if long_masks else None
                laid.append(Span(cache, start, n, offset, mask, at))
            elif kernel:
                laid.append(Span(cache, start, n, offset, None, at, seen=(at + 1).to(torch.int32).view(1, n)))
            else:
                width = aligned_keys(start + n, cache.capacity)
                laid.append(Span(cache, start, n, offset, None, at, width=width, hidden=unseen_keys(at, width)))
            offset += n
        return cls(tuple(laid), tuple(own), pooled, offset)


def _takes_fused(num_tokens: int, kernel: bool) -> bool:
    """Whether a block of a request's own takes PyTorch's fused attention: a long one, except that
    the kernel keeps what the kernel linears take (a long verify stays row-exact)."""
    return num_tokens >= FUSED_ATTENTION_MIN_TOKENS and not (kernel and num_tokens <= KERNEL_MAX_ROWS)


@dataclass(frozen=True)
class SlotRows:
    """A captured step's rows: `requests` requests of `rows_each` rows, row r's keys and values
    into slot `row_slots[r]` at `positions[r]` of the pool's `keys` and `values` (a padding
    row's into its scratch position), request i attending over the first `width` keys of slot
    `request_slots[i]` (None: of slot i, read in place), `hidden` [R, 1, 1, T, width] where it
    must not look (`seen`, the same for the CPU kernel; `flex`, for FlexAttention). Device
    tensors in buffers the step's graphs were captured over: a new step rewrites them, never
    replaces them. The pool's tensors, not the pool: the pool owns its captured steps
    (KVPool.graphs), and a step that held the pool would keep it alive in a cycle."""

    keys: torch.Tensor  # the pool's [layers, slots, kv_heads, positions, head_dim]
    values: torch.Tensor
    requests: int
    rows_each: int
    width: int
    row_slots: torch.Tensor
    positions: torch.Tensor
    request_slots: torch.Tensor | None
    hidden: torch.Tensor | None  # None where FlexAttention reads `flex`
    seen: torch.Tensor  # int32 [R, T]: the keys each row sees, as the fused CPU kernel takes them
    flex: SlotBlocks | None = None  # attention through FlexAttention over this block mask (flex.py)


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

    def __init__(self, num_kv_heads: int, head_dim: int, kernel: bool, split_dtype: torch.dtype | None = None) -> None:
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5
        self.kernel = kernel  # the fused CPU kernel for short blocks (short_attention.py)
        # Long blocks split at their start, in this dtype (layers.split_attention); None: one masked call.
        self.split_dtype = split_dtype

    def __call__(self, layer: int, q, k, v, rows: BatchRows | SlotRows | Branches) -> torch.Tensor:
        if isinstance(rows, Branches):
            return self._branches(layer, q, k, v, rows)
        if isinstance(rows, SlotRows):
            return self._slots(layer, q[0], k[0], v[0], rows)
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
        cache.write(layer, start, k.transpose(0, 1), v.transpose(0, 1))
        if span.seen is not None:  # the whole cache handed over: each row reads its keys to its own limit
            result = kernel_attention(q * self.scale, *cache.view(layer, cache.capacity), span.seen, self.num_kv_heads)
        elif span.hidden is not None:
            keys, values = cache.view(layer, span.width)  # [kv_heads, width, head_dim]
            result = matmul_attention(q * self.scale, keys, values, span.hidden, self.num_kv_heads)
        elif self.split_dtype is not None:
            keys, values = cache.view(layer, start + q.shape[0])
            return split_attention(q, keys, values, start, self.scale, self.split_dtype, out)
        else:
            return fused_attention(q, *cache.view(layer, start + q.shape[0]), start, span.mask, self.scale, out)
        return result if out is None else out.copy_(result)

    def _pooled(self, layer: int, q, k, v, pooled: PooledRows) -> torch.Tensor:
        """The pooled rows' keys and values into their slots, then attention over runs of the slots."""
        pool = pooled.pool
        pool.keys[layer][pooled.slots, :, pooled.positions] = k
        pool.values[layer][pooled.slots, :, pooled.positions] = v
        return pooled_attention(q * self.scale, pooled, layer, self.num_kv_heads, self.kernel)

    def _slots(self, layer: int, q, k, v, rows: SlotRows) -> torch.Tensor:
        """Every row's keys and values into its slot, then each request's rows over its slot: its
        own key blocks through FlexAttention, or its first `width` keys, masked, through the
        matmuls (in place, or gathered first). The same shapes whatever the requests' lengths.
        The fused CPU kernel takes short blocks only, as in an eager forward (`_span`)."""
        rows.keys[layer][rows.row_slots, :, rows.positions] = k
        rows.values[layer][rows.row_slots, :, rows.positions] = v
        if rows.flex is not None and rows.request_slots is None:
            keys, values = rows.keys[layer][: rows.requests], rows.values[layer][: rows.requests]
            return flex_slot_attention(q, keys, values, rows.flex, self.scale)
        keys, values = rows.keys[layer][:, :, : rows.width], rows.values[layer][:, :, : rows.width]
        if rows.request_slots is None:
            keys, values = keys[: rows.requests], values[: rows.requests]
        else:
            keys, values = keys.index_select(0, rows.request_slots), values.index_select(0, rows.request_slots)
        if rows.flex is not None:  # a prompt chunk: its slot's keys up to the bucket's
            return flex_slot_attention(q, keys, values, rows.flex, self.scale)
        seen = rows.seen if self.kernel and rows.rows_each <= KERNEL_MAX_ROWS else None
        return slot_attention(q * self.scale, keys, values, rows.hidden, self.num_kv_heads, seen)

    def _branches(self, layer: int, q, k, v, rows: Branches) -> torch.Tensor:
        prefix_k, prefix_v = rows.cache.view(layer, rows.prefix)  # [kv_heads, p, head_dim]
        # [kv_heads, B, r, head_dim]: each branch's own keys and values
        own_k, own_v = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
        qg = group_queries(q * self.scale, self.num_kv_heads)
        return ungroup(grouped_attention(qg, prefix_k, prefix_v, own_k, own_v, rows.later))
