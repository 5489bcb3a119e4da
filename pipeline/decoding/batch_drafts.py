"""How much of each request's draft a batch verifies.

Alone, a verify row is nearly free: one decode step reads every weight once whatever
its rows, so a drafter may propose generously. In a batch of R requests the weights'
reading is shared by R rows already, and each extra row costs its own compute (on a
2-core CPU the linears cost ~2.3× one row at 16 rows and ~4× at 32) — a draft token
that pays alone can cost the batch more time than its expected acceptance earns.
So when several requests draft together, the batch keeps the draft positions that
raise its tokens per second: position j of request i is worth its survival P_ij (the
chance that drafted tokens 0..j are all accepted) at a cost of one row ρ_i; with the
positions sorted by P/ρ, taking them while P/ρ beats the batch's tokens per second so
far maximizes the ratio (each request keeps a prefix: its P_ij does not grow with j).

The costs come from the device's latency table: one step of the batch reads the
weights once (t_forward(0)), each request's attention over its own cache, and every row
past the first costs the table's verify slope (the last measured verify ratio,
per row) at its request's context. A draft without a survival estimate is kept whole.

Requests whose caches are slots of one KV pool attend together, every slot padded to the
batch's widest block: one request's long draft widens every slot's attention, which at
long context is most of the step. There a row costs the linears' slope only, the widest
draft sets every slot's attention growth, and each width is tried.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class StepLatency(Protocol):
    """What a latency table (knapspec.latency's LatencyModel or PipelineLatency) answers."""

    @property
    def max_verify(self) -> int: ...

    def t_forward(self, n: int) -> float: ...

    def t_verify(self, k: int, n: int) -> float: ...


def row_seconds(latency: StepLatency, context: int) -> float:
    """One more row in a forward at `context`: the slope of the measured verify curve."""
    widest = latency.max_verify
    if widest < 2:
        return latency.t_forward(context)
    return max(latency.t_verify(widest, context) - latency.t_forward(context), 0.0) / (widest - 1)


def batch_step_seconds(
    latency: StepLatency, contexts: Sequence[int], rows: Sequence[int], padded: bool = False
) -> float:
    """One forward over requests at `contexts` with `rows` rows each (≥ 1): the weights once,
    each request's attention over its cache, every row but the batch's first at its slope.

    `padded`: the requests' caches are slots of one KV pool, whose attention computes the
    batch's widest block for every slot (layers.pooled_attention). Then a row costs the
    linears' slope (that at context 0), and each slot's attention grows with the widest block.
    """
    if not contexts or len(contexts) != len(rows) or min(rows) < 1:
        raise ValueError(f"a batch step needs one row count (>= 1) per request, got {list(rows)}")
    weights = latency.t_forward(0)
    attention = sum(latency.t_forward(n) - weights for n in contexts)
    if padded:
        per_row = row_seconds(latency, 0)
        growth = per_row / weights if weights > 0 else 0.0  # a row's share of one row's cost
        return weights + attention * (1 + growth * (max(rows) - 1)) + per_row * (sum(rows) - 1)
    extra = sum(k * row_seconds(latency, n) for n, k in zip(contexts, rows)) - row_seconds(latency, contexts[0])
    return weights + attention + extra


def trim_drafts(
    lengths: Sequence[int],
    survival: Sequence[Sequence[float] | None],
    contexts: Sequence[int],
    latency: StepLatency,
    padded: bool = False,
) -> list[int]:
    """How many tokens of each request's draft the batch verifies.

    `lengths[i]`: request i's draft tokens; `survival[i][j]`: the chance its tokens 0..j are
    all accepted (None: no estimate, the draft is kept whole); `contexts[i]`: its cache length;
    `padded`: as in batch_step_seconds — then the widest kept draft sets every slot's attention
    cost, so each width is tried and the best kept.
    Every request emits one token a step whatever its draft, so a batch of R starts at R tokens.
    """
    if not len(lengths) == len(survival) == len(contexts):
        raise ValueError("trim_drafts needs a length, a survival and a context per request")
    for i, (n, p) in enumerate(zip(lengths, survival)):
        if p is not None and len(p) < n:
            raise ValueError(f"request {i} drafts {n} tokens but has {len(p)} survival estimates")
    if not padded:
        return _best_under(lengths, survival, contexts, latency, max(lengths, default=0), padded)[0]
    fixed = max((n for n, p in zip(lengths, survival) if p is None), default=0)
    widths = range(fixed, max(lengths, default=0) + 1)
    return max((_best_under(lengths, survival, contexts, latency, w, padded) for w in widths), key=lambda r: r[1])[0]


def _best_under(lengths, survival, contexts, latency, width: int, padded: bool) -> tuple[list[int], float]:
    """The best kept lengths with no estimated draft longer than `width`, and their expected
    tokens per second; a padded step is costed at that width whatever is kept below it."""
    kept = [n if p is None else 0 for n, p in zip(lengths, survival)]
    if padded:
        row_costs = [row_seconds(latency, 0)] * len(lengths)
        time = batch_step_seconds(latency, contexts, [1 + width] + [1] * (len(lengths) - 1), padded)
        time += row_costs[0] * (sum(kept) - width)  # the rows kept, not the width's, at the linears' slope
    else:
        row_costs = [row_seconds(latency, n) for n in contexts]
        time = batch_step_seconds(latency, contexts, [1 + k for k in kept])
    tokens = float(len(lengths))
    candidates = []
    for i, (n, p) in enumerate(zip(lengths, survival)):
        if p is None:
            continue
        cost = row_costs[i]
        chance = 1.0
        for j in range(min(n, width)):
            chance = min(chance, max(float(p[j]), 0.0))  # a later position never survives more often
            candidates.append((chance / cost if cost > 0 else float("inf"), i, j, chance, cost))
    # Stable on ties: a request's positions stay in order, so each keeps a prefix.
    candidates.sort(key=lambda c: -c[0])
    for ratio, i, j, chance, cost in candidates:
        if ratio * time <= tokens:  # this token earns less than the batch's rate: so do the rest
            break
        kept[i] = j + 1
        tokens += chance
        time += cost
    return kept, tokens / time
