"""The rows of several requests packed into one batched forward: what each request brings,
how the short blocks of requests in one KV pool are laid out for one attention, and how
the logits of its rows come back out."""

from __future__ import annotations

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
    """One request's rows in a batched forward: `token_ids` [T] (a tensor, or host ints that the
    forward moves with the rest of its metadata) at positions [start, start + T)
    of its own cache (T = 1 to decode, 1 + γ to verify, a chunk to prefill). `logits`: which of
    its rows need logits ("all", "last", "none"); None takes the forward's choice."""

    cache: KVCache  # or any cache with the same interface (a pipeline's)
    token_ids: torch.Tensor | Sequence[int]
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


def logit_rows(wanted: Sequence[str], sizes: Sequence[int]) -> list[range]:
    """Each block's rows that need logits in the packed batch: all its rows, its last, or none."""
    offsets = [0, *itertools.accumulate(sizes)]
    return [
        range(a, e) if choice == "all" else range(e - 1, e) if choice == "last" else range(0)
        for choice, a, e in zip(wanted, offsets, offsets[1:])
    ]


def packed_logits(
    head: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    wanted: Sequence[str],
    sizes: Sequence[int],
    index: torch.Tensor | None,
) -> list[torch.Tensor | None]:
    """`head` (final norm and LM head) once over the packed rows [M, d] that need logits, split
    back per request: all its rows, its last, or None (`wanted`); `sizes` are its row counts,
    `index` the rows of logit_rows on h's device (None where every row needs logits)."""
    if all(choice == "all" for choice in wanted):
        return list(head(h).split(list(sizes)))
    rows = logit_rows(wanted, sizes)
    if not any(rows):
        return [None] * len(wanted)
    parts = iter(head(h[index]).split([len(block) for block in rows if block]))
    return [next(parts) if block else None for block in rows]


# Idle slots (free, or holding a request that is not in this step) between two pooled requests
# are split off when they would read this many keys or more: an idle slot inside one attention
# call costs a whole request's attention, a second call only a few more kernel launches.
MIN_GAP_KEYS = 512


@dataclass(frozen=True)
class SlotRun:
    """Pool slots [first, end) that one attention call serves, over their first `num_keys` keys:
    how many keys each query row sees as the fused kernel takes it (`seen`, [end - first, block]
    int32), or as the matmuls' mask (`hidden`, [end - first, 1, 1, block, num_keys], True where
    a query must not look)."""

    first: int
    end: int
    num_keys: int
    seen: torch.Tensor
    hidden: torch.Tensor | None


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


@dataclass(frozen=True)
class PooledPlan:
    """A PooledRows on the host: its index lists (`parts`: rows, slots, positions, padded, back,
    limits), to be moved to the device with the rest of a step's metadata (staging.py)."""

    pool: KVPool
    parts: tuple[list[int], ...]
    runs: tuple[tuple[int, int, int], ...]  # (first, end, keys read): one attention call each
    bases: tuple[int, ...]  # each run's first slot's place among the runs' slots
    block: int

    def on_device(self, parts: Sequence[torch.Tensor], kernel: bool) -> PooledRows:
        """The layout from `parts` as they arrived on the device (int64, in the order of `parts`),
        its masks made for the fused kernel (`kernel`) or for the matmuls."""
        rows, slots, positions, padded, back, limits = parts
        limits = (limits + 1).to(torch.int32).view(-1, self.block)
        runs = []
        for (first, end, keys), base in zip(self.runs, self.bases):
            seen = limits[base : base + end - first]
            hidden = None if kernel else (torch.arange(keys, device=seen.device) >= seen[..., None])[:, None, None]
            runs.append(SlotRun(first, end, keys, seen, hidden))
        return PooledRows(self.pool, rows, slots, positions, padded, back, self.block, tuple(runs))


def plan_pooled(spans: Sequence[tuple[KVCache, int, int]], max_rows: int) -> tuple[PooledPlan | None, list[int]]:
    """Which spans (cache, start, rows) one pooled attention can serve — blocks shorter than
    `max_rows` in slots of one pool, at least two of them — and its plan; the others' indices."""
    pooled = [i for i, (cache, _, n) in enumerate(spans) if isinstance(cache, PooledCache) and n < max_rows]
    pools = {id(spans[i][0].pool) for i in pooled}
    if len(pooled) < 2 or len(pools) != 1:
        return None, list(range(len(spans)))
    pool = spans[pooled[0]][0].pool
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
    limits = [0] * (len(base) * block)
    for i in pooled:
        cache, start, n = spans[i]
        for t in range(n):
            place = base[cache.slot] * block + t
            back.append(place)
            padded[place] = len(rows)
            rows.append(offsets[i] + t)
            slots.append(cache.slot)
            positions.append(start + t)
            limits[place] = start + t
    laid_runs = tuple((first, end, aligned_keys(keys, pool.slot_capacity)) for first, end, keys in runs)
    plan = PooledPlan(
        pool,
        (rows, slots, positions, padded, back, limits),
        laid_runs,
        tuple(base[first] for first, _, _ in runs),
        block,
    )
    return plan, [i for i in range(len(spans)) if i not in set(pooled)]


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
