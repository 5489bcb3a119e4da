"""The rows of several requests packed into one batched forward: what each request brings,
how the short blocks of requests in one KV pool are laid out for one attention, and how
the logits of its rows come back out."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError
from pipeline.model.kv_cache import KVCache
from pipeline.model.kv_pool import KVPool, PooledCache
from pipeline.model.layers import aligned_keys
from pipeline.model.linear import Linear


@dataclass(frozen=True)
class RequestRows:
    """One request's rows in a batched forward: `token_ids` [T] at positions [start, start + T)
    of its own cache (T = 1 to decode, 1 + γ to verify, a chunk to prefill). `logits`: which of
    its rows need logits ("all", "last", "none"); None takes the forward's choice."""

    cache: KVCache  # or any cache with the same interface (a pipeline's)
    token_ids: torch.Tensor
    start: int
    logits: str | None = None


def check_logit_choices(blocks: Sequence[RequestRows], default: str) -> list[str]:
    """Each block's logits choice ("all", "last", "none"), its own or the forward's."""
    if not blocks:
        raise ConfigError("a batched forward needs at least one request")
    wanted = [block.logits or default for block in blocks]
    for choice in wanted:
        if choice not in ("all", "last", "none"):
            raise ConfigError(f"logits must be 'all', 'last' or 'none', got {choice!r}")
    return wanted


def packed_logits(
    head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, wanted: Sequence[str], sizes: Sequence[int]
) -> list[torch.Tensor | None]:
    """`head` (final norm and LM head) once over the packed rows [M, d] that need logits, split
    back per request: all its rows, its last, or None (`wanted`); `sizes` are its row counts."""
    if all(choice == "all" for choice in wanted):
        return list(head(h).split(list(sizes)))
    offsets = [0, *itertools.accumulate(sizes)]
    rows = [
        range(a, e) if choice == "all" else range(e - 1, e) if choice == "last" else range(0)
        for choice, a, e in zip(wanted, offsets, offsets[1:])
    ]
    if not any(rows):
        return [None] * len(wanted)
    index = torch.tensor([row for block in rows for row in block], device=h.device)
    parts = iter(head(h[index]).split([len(block) for block in rows if block]))
    return [next(parts) if block else None for block in rows]


# Idle slots (free, or holding a request that is not in this step) between two pooled requests
# are split off when they would read this many keys or more: an idle slot inside one attention
# call costs a whole request's attention, a second call only a few more kernel launches.
MIN_GAP_KEYS = 512


@dataclass(frozen=True)
class SlotRun:
    """Pool slots [first, end) that one attention call serves, over their first `num_keys` keys."""

    first: int
    end: int
    num_keys: int
    seen: torch.Tensor  # [end - first, block] int32: the keys each query row sees (the fused kernel's form)

    @functools.cached_property
    def hidden(self) -> torch.Tensor:
        """[end - first, 1, 1, block, num_keys]: True where a query must not look (the matmuls'
        mask; made on first use, once per forward, since the kernel never needs it)."""
        return (torch.arange(self.num_keys, device=self.seen.device) >= self.seen[..., None])[:, None, None]


@dataclass(frozen=True)
class PooledRows:
    """The short blocks (decode, verify) of a batch whose caches are slots of one pool, laid out
    for attention over runs of neighbouring slots (`runs`, one call each): each slot's queries
    padded to `block` rows, the runs' slots one after another."""

    pool: KVPool
    rows: torch.Tensor  # [R]: their rows in the packed batch
    slots: torch.Tensor  # [R]: each row's slot, and its position there (where its K/V go)
    positions: torch.Tensor
    padded: torch.Tensor  # [Σ run slots * block]: which of the R rows fills each padded row
    back: torch.Tensor  # [R]: each row's place among the padded rows
    block: int
    runs: tuple[SlotRun, ...]


def slot_runs(slots_keys: Sequence[tuple[int, int]], min_gap_keys: int = MIN_GAP_KEYS) -> list[tuple[int, int, int]]:
    """(first, end, keys) runs over (slot, keys) pairs sorted by slot: neighbours share a run
    unless the idle slots between them would read `min_gap_keys` keys or more."""
    runs: list[list[int]] = []
    for slot, keys in slots_keys:
        if runs:
            first, end, most = runs[-1]
            if (slot - end) * max(most, keys) < min_gap_keys:
                runs[-1] = [first, slot + 1, max(most, keys)]
                continue
        runs.append([slot, slot + 1, keys])
    return [(first, end, keys) for first, end, keys in runs]


def pooled_rows(spans: Sequence[tuple[KVCache, int, int]], max_rows: int) -> tuple[PooledRows | None, list[int]]:
    """Which spans (cache, start, rows) one pooled attention can serve — blocks shorter than
    `max_rows` in slots of one pool, at least two of them — and its layout; the others' indices."""
    pooled = [i for i, (cache, _, n) in enumerate(spans) if isinstance(cache, PooledCache) and n < max_rows]
    pools = {id(spans[i][0].pool) for i in pooled}
    if len(pooled) < 2 or len(pools) != 1:
        return None, list(range(len(spans)))
    pool = spans[pooled[0]][0].pool
    device = pool.keys.device
    block = max(spans[i][2] for i in pooled)
    # Rows stay in the batch's order (a forward whose rows are all pooled takes the output as is).
    runs = slot_runs(sorted((spans[i][0].slot, spans[i][1] + spans[i][2]) for i in pooled))
    # Each slot's place among the runs' slots, laid one run after another.
    base: dict[int, int] = {}
    for first, end, _ in runs:
        for slot in range(first, end):
            base[slot] = len(base)
    offsets = [0, *itertools.accumulate(n for _, _, n in spans)]
    rows, slots, positions, back = [], [], [], []
    padded = [0] * (len(base) * block)  # idle slots and padding read row 0: finite, then dropped
    # Every padded query may look at key 0 (a softmax over nothing would be NaN); a real one at
    # its prefix and its block up to itself.
    limit = [[0] * block for _ in range(len(base))]
    for i in pooled:
        cache, start, n = spans[i]
        for t in range(n):
            place = base[cache.slot] * block + t
            back.append(place)
            padded[place] = len(rows)
            rows.append(offsets[i] + t)
            slots.append(cache.slot)
            positions.append(start + t)
            limit[base[cache.slot]][t] = start + t
    # Every index of the layout in one tensor, moved to the device in one copy.
    parts = (rows, slots, positions, padded, back, [x for slot_limits in limit for x in slot_limits])
    packed = torch.tensor([x for part in parts for x in part], dtype=torch.long).to(device)
    rows_t, slots_t, positions_t, padded_t, back_t, limits = packed.split([len(part) for part in parts])
    limits = limits.view(len(base), block)
    layout_runs = []
    for first, end, keys in runs:
        seen = (limits[base[first] : base[first] + end - first] + 1).to(torch.int32)
        layout_runs.append(SlotRun(first, end, aligned_keys(keys, pool.slot_capacity, device), seen))
    layout = PooledRows(pool, rows_t, slots_t, positions_t, padded_t, back_t, block, tuple(layout_runs))
    return layout, [i for i in range(len(spans)) if i not in set(pooled)]


def kernel_ranges(sizes: Sequence[int], max_packed_rows: int) -> list[tuple[int, int, bool]]:
    """Row ranges [a, e) of a packed batch and, for each, whether its linears take the packed
    16-bit weights' kernel: a block takes it alone when it has at most `max_packed_rows` rows,
    and in a batch it must take what it would alone (PyTorch's linear over the plain weights
    rounds differently), so consecutive blocks of one choice share a range."""
    ranges: list[tuple[int, int, bool]] = []
    at = 0
    for n in sizes:
        packed = n <= max_packed_rows
        if ranges and ranges[-1][2] == packed:
            ranges[-1] = (ranges[-1][0], at + n, packed)
        else:
            ranges.append((at, at + n, packed))
        at += n
    return ranges


def ranged_linear(linear: Linear, x: torch.Tensor, ranges: list[tuple[int, int, bool]] | None) -> torch.Tensor:
    """`linear` over packed rows, each range with its kernel (kernel_ranges; None: by row count)."""
    if ranges is None:
        return linear(x)
    if len(ranges) == 1:
        return linear(x, ranges[0][2])
    out = x.new_empty(x.shape[0], linear.out_features)
    for a, e, packed in ranges:
        linear(x[a:e], packed, out[a:e])
    return out
