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

The costs are a step's (step_cost.py): from the device's latency table at first, then
fitted to the batch's own timed steps. A draft without a survival estimate is kept whole.

Requests whose caches are slots of one KV pool attend together, every slot padded to the
batch's widest block: one request's long draft widens every slot's attention, which at
long context is most of the step. There a row costs the linears' slope only, the widest
draft sets every slot's attention growth, and each width is tried.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeline.decoding.drafters import Draft
from pipeline.decoding.step_cost import OnlineStepCost, StepCost, StepLatency
from pipeline.model.kv_pool import PooledCache


def trim_drafts(
    lengths: Sequence[int],
    survival: Sequence[Sequence[float] | None],
    contexts: Sequence[int],
    cost: StepCost,
    padded: bool = False,
) -> list[int]:
    """How many tokens of each request's draft the batch verifies.

    `lengths[i]`: request i's draft tokens; `survival[i][j]`: the chance its tokens 0..j are
    all accepted (None: no estimate, the draft is kept whole); `contexts[i]`: its cache length;
    `padded`: the caches are slots of one KV pool — then the widest kept draft sets every
    slot's attention cost, so each width is tried and the best kept.
    Every request emits one token a step whatever its draft, so a batch of R starts at R tokens.
    """
    if not len(lengths) == len(survival) == len(contexts):
        raise ValueError("trim_drafts needs a length, a survival and a context per request")
    for i, (n, p) in enumerate(zip(lengths, survival)):
        if p is not None and len(p) < n:
            raise ValueError(f"request {i} drafts {n} tokens but has {len(p)} survival estimates")
    if not padded:
        return _best_under(lengths, survival, contexts, cost, max(lengths, default=0), padded)[0]
    fixed = max((n for n, p in zip(lengths, survival) if p is None), default=0)
    widths = range(fixed, max(lengths, default=0) + 1)
    return max((_best_under(lengths, survival, contexts, cost, w, padded) for w in widths), key=lambda r: r[1])[0]


def _best_under(lengths, survival, contexts, cost: StepCost, width: int, padded: bool) -> tuple[list[int], float]:
    """The best kept lengths with no estimated draft longer than `width`, and their expected
    tokens per second; a padded step is costed at that width whatever is kept below it."""
    kept = [n if p is None else 0 for n, p in zip(lengths, survival)]
    if padded:
        row_costs = [cost.per_row] * len(lengths)
        seconds = cost.seconds(contexts, [1 + width] + [1] * (len(lengths) - 1), padded)
        seconds += cost.per_row * (sum(kept) - width)  # the rows kept, not the width's
    else:
        row_costs = [cost.per_row + cost.per_key_row * n for n in contexts]
        seconds = cost.seconds(contexts, [1 + k for k in kept])
    tokens = float(len(lengths))
    candidates = []
    for i, (n, p) in enumerate(zip(lengths, survival)):
        if p is None:
            continue
        chance = 1.0
        for j in range(min(n, width)):
            chance = min(chance, max(float(p[j]), 0.0))  # a later position never survives more often
            ratio = chance / row_costs[i] if row_costs[i] > 0 else float("inf")
            candidates.append((ratio, i, j, chance, row_costs[i]))
    # Stable on ties: a request's positions stay in order, so each keeps a prefix.
    candidates.sort(key=lambda c: -c[0])
    for ratio, i, j, chance, row_cost in candidates:
        if ratio * seconds <= tokens:  # this token earns less than the batch's rate: so do the rest
            break
        kept[i] = j + 1
        tokens += chance
        seconds += row_cost
    return kept, tokens / seconds


def fresh_step_cost(latency: StepLatency) -> OnlineStepCost:
    """A step-cost fit of its own, started from `latency`'s table."""
    return OnlineStepCost(StepCost.from_table(latency))


class DraftBudget:
    """A batch's draft budget across its steps: the step cost, from the latency table of a
    drafter that estimates its drafts' survival, then fitted to the steps it timed.

    `start` gives the fit from a table (default: a fit of the batch's own; an engine passes
    the device's, which its batches share); `observed` hears of every timed step after it
    is fitted (an engine writes the fit back to the device's calibration now and then)."""

    def __init__(
        self,
        start: Callable[[StepLatency], OnlineStepCost] = fresh_step_cost,
        observed: Callable[[OnlineStepCost], None] | None = None,
    ) -> None:
        self.cost: OnlineStepCost | None = None
        self._start = start
        self._observed = observed

    def step_cost(self, latency: StepLatency) -> OnlineStepCost:
        """The batch's step cost, started from `latency`'s table if nothing has started it yet."""
        if self.cost is None:
            self.cost = self._start(latency)
        return self.cost

    def fit(
        self,
        drafts: Sequence[Draft],
        contexts: Sequence[int],
        padded: bool,
        latencies: Sequence[StepLatency | None],
    ) -> list[Draft]:
        """The drafts of requests verified together, each cut to the positions that pay in this
        batch; a request alone verifies its draft as proposed (its drafter weighed it).
        `contexts`: the requests' cache lengths; `padded`: their caches are slots of one pool;
        `latencies`: each drafter's table (the first of a draft with survival estimates starts
        the step cost)."""
        drafts = list(drafts)
        if self.cost is None:
            estimated = (latency for latency, d in zip(latencies, drafts) if d.survival is not None)
            latency = next((latency for latency in estimated if latency is not None), None)
            if latency is None:
                return drafts
            self.cost = self._start(latency)
        if len(drafts) < 2 or all(d.survival is None for d in drafts):
            return drafts
        lengths = trim_drafts(
            [len(d.token_ids) for d in drafts], [d.survival for d in drafts], contexts, self.cost.current(), padded
        )
        return [d.prefix(n) for d, n in zip(drafts, lengths)]

    def observe(self, drafts: Sequence[Draft], contexts: Sequence[int], padded: bool, seconds: float) -> None:
        """The verify forward of these drafts (and nothing else) over caches of `contexts`
        positions took `seconds`."""
        if self.cost is not None:
            self.cost.observe(contexts, [1 + len(d.token_ids) for d in drafts], padded, seconds)
            if self._observed is not None:
                self._observed(self.cost)


def pooled(caches: Sequence) -> bool:
    """Whether several caches are slots of one pool: they attend together (packing.plan_pooled)."""
    pools = {id(cache.pool) if isinstance(cache, PooledCache) else None for cache in caches}
    return len(caches) > 1 and None not in pools and len(pools) == 1


# The device's fit is recorded once it has seen this many timed steps, then every RECORD_EVERY.
RECORD_FIRST = 64
RECORD_EVERY = 512


class DeviceStepCost:
    """One device's step-cost fit, shared by the batches that an engine runs one after
    another (each batch alone would start from the table again), and handed to `record`
    (the calibration store: the next engine starts from it) once it has seen RECORD_FIRST
    timed steps, then every RECORD_EVERY, and at `flush`."""

    def __init__(self, record: Callable[[StepCost, int], None] | None = None) -> None:
        self.cost: OnlineStepCost | None = None
        self._record = record
        self._recorded = 0  # timed steps the last recorded fit had seen

    def budget(self) -> DraftBudget:
        """A batch's draft budget over this fit."""
        return DraftBudget(start=self._start, observed=self._observed)

    def flush(self) -> None:
        """Record the fit if it has seen enough steps and more than were last recorded."""
        cost = self.cost
        if self._record is not None and cost is not None and cost.num_observed >= max(RECORD_FIRST, self._recorded + 1):
            self._recorded = cost.num_observed
            self._record(cost.current(), cost.num_observed)

    def _start(self, latency: StepLatency) -> OnlineStepCost:
        if self.cost is None:
            self.cost = fresh_step_cost(latency)
        return self.cost

    def _observed(self, cost: OnlineStepCost) -> None:
        due = RECORD_FIRST if self._recorded == 0 else self._recorded + RECORD_EVERY
        if cost.num_observed >= due:
            self.flush()
