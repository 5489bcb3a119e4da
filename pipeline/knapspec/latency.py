"""KnapSpec's latency model of one device: what an item, a draft token and a verify cost.

The paper models the decode cost of a sublayer by its kind: an attention item grows
linearly with the number n of cached tokens, t_attn(n) = a·n + b, while an MLP item
costs a constant t_mlp. Every forward also pays a fixed cost (embedding, final norm
and LM head) that no skip set removes. A draft token with skip set S costs
t_fixed + Σ_{i∉S} t_i, and verifying k tokens in one full forward costs
t_forward(n) · r_k, where r_k is measured (k = 1..D+1). The knapsack works on integer
weights w_i = round(t_i / Δ) with Δ = min(t_attn(n), t_mlp), capped as in the
reference code. One DP search, every row on m branch-tokens (B branches of r
reference tokens), costs t_forward(n) · (c0 + c1·m), c0 and c1 measured.

A pipelined replica (`PipelineLatency`) has each stage's own table plus the hops: every
stage is calibrated on the device it runs on, so a slow device's items weigh more in the
knapsack and get skipped first. A draft token pays each stage it runs and one hop per
stage after the first; a middle stage whose items are all skipped is bypassed and costs
nothing. `PipelineLatency` answers the questions the KnapSpec search asks of a
`LatencyModel`, so the search runs over a pipeline unchanged.

Pure arithmetic: the numbers come from `profiling` (microbenchmarks on the device
that runs the layers).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, fields

from pipeline.model import items

# The reference code caps an item's integer weight: a very slow item is still skipped
# only as a whole, and a large cap blows up the DP's budget dimension.
DEFAULT_WEIGHT_CAP = 5


@dataclass(frozen=True)
class LatencyModel:
    """Per-device decode latencies, all in seconds."""

    attn_slope: float  # a: seconds per cached token of one attention item
    attn_base: float  # b: seconds of one attention item at n = 0
    t_mlp: float  # one MLP item
    t_fixed: float  # embedding + final norm + LM head of one token
    verify_ratios: tuple[float, ...]  # [k - 1]: a full forward of k tokens / one of 1 token
    num_layers: int
    t_hop: float = 0.0  # one pipeline hop between stages; charged by whoever knows the layout
    # A whole DP search on m branch-tokens costs t_forward(n) · (search_base + search_per_token · m).
    # The defaults are 2 CPU cores' (SmolLM2 fp16w, 0.5k-7k context); profiling measures them.
    search_base: float = 1.0
    search_per_token: float = 1.0 / 12.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify_ratios", tuple(float(r) for r in self.verify_ratios))
        if self.num_layers < 1:
            raise ValueError(f"a latency model needs at least one layer, got {self.num_layers}")
        for name in ("attn_slope", "attn_base", "t_mlp", "t_fixed", "t_hop", "search_base", "search_per_token"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"latency {name} must be finite and >= 0, got {value}")
        if not self.verify_ratios or self.verify_ratios[0] != 1.0:
            raise ValueError(f"verify_ratios must start with 1.0 (k = 1), got {self.verify_ratios[:1]}")
        if any(not math.isfinite(r) or r <= 0 for r in self.verify_ratios):
            raise ValueError(f"verify_ratios must be finite and positive, got {self.verify_ratios}")

    @property
    def num_items(self) -> int:
        return items.num_items(self.num_layers)

    @property
    def max_verify(self) -> int:
        """The most tokens one verify forward is modelled for (D + 1)."""
        return len(self.verify_ratios)

    # ------------------------------------------------------------ item costs

    def t_attn(self, n: int) -> float:
        """One decode token through one attention item with n cached tokens."""
        return self.attn_slope * n + self.attn_base

    def t_item(self, item: int, n: int) -> float:
        """One decode token through one item (an attention item at context n, or an MLP)."""
        self._check_item(item)
        return self.t_attn(n) if items.is_attention(item) else self.t_mlp

    # -------------------------------------------------------- token costs

    def t_forward(self, n: int) -> float:
        """One token through every item, plus the fixed cost."""
        return self.t_draft((), n)

    def t_draft(self, skip: Collection[int], n: int) -> float:
        """One draft token of the sub-network that skips `skip` (Sec. 3: t_fixed + Σ executed t_i)."""
        skipped = set(skip)
        for item in skipped:
            self._check_item(item)
        num_attn_skipped, num_mlp_skipped = items.count_kinds(skipped)
        # Counting items (not summing them one by one) keeps t_draft(()) == t_forward exactly.
        return (
            (self.num_layers - num_attn_skipped) * self.t_attn(n)
            + (self.num_layers - num_mlp_skipped) * self.t_mlp
            + self.t_fixed
        )

    def t_verify(self, k: int, n: int) -> float:
        """One full-model forward of k tokens (γ drafts + 1) after n cached tokens."""
        if not 1 <= k <= self.max_verify:
            raise ValueError(f"verify of {k} tokens is outside the modelled 1..{self.max_verify}")
        return self.t_forward(n) * self.verify_ratios[k - 1]

    def t_search(self, branch_tokens: int, n: int) -> float:
        """One knapsack DP over every row, each row running `branch_tokens` (B·r) rows at once."""
        return self.t_forward(n) * (self.search_base + self.search_per_token * branch_tokens)

    # --------------------------------------------------------------- weights

    def item_weights(self, n: int, cap: int = DEFAULT_WEIGHT_CAP) -> list[int]:
        """Integer knapsack weights of the 2L items at context n (the paper's w_i).

        Δ = min(t_attn(n), t_mlp) is the cheaper kind, weight 1; the other kind weighs
        its cost in Δ units, rounded half up and clamped to [1, cap].
        """
        if cap < 1:
            raise ValueError(f"weight cap must be >= 1, got {cap}")
        t_attn = self.t_attn(n)
        delta = min(t_attn, self.t_mlp)
        w_attn, w_mlp = (integer_weight(t, delta, cap) for t in (t_attn, self.t_mlp))
        return [w_attn if items.is_attention(item) else w_mlp for item in range(self.num_items)]

    def bypass_weights(self, n: int, cap: int = DEFAULT_WEIGHT_CAP) -> list[tuple[int, int, int]]:
        """Stages a draft can bypass, for the knapsack: none in one model (see PipelineLatency)."""
        return []

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        data = asdict(self)
        data["verify_ratios"] = list(self.verify_ratios)
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> LatencyModel:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown latency model fields: {', '.join(sorted(unknown))}")
        try:
            return cls(**data)
        except TypeError as e:  # a missing field
            raise ValueError(f"incomplete latency model: {e}") from None

    def _check_item(self, item: int) -> None:
        if not 0 <= item < self.num_items:
            raise ValueError(f"item {item} is outside 0..{self.num_items - 1}")


def integer_weight(t: float, delta: float, cap: int) -> int:
    """An item's knapsack weight: its cost `t` in units of `delta`, half up, in [1, cap]."""
    if delta <= 0:
        # A free item costs one unit; anything else is infinitely many free ones.
        return 1 if t <= 0 else cap
    # Half up, not Python's banker's rounding: a weight should not depend on parity.
    return max(1, min(cap, math.floor(t / delta + 0.5)))


@dataclass(frozen=True)
class PipelineLatency:
    stages: tuple[LatencyModel, ...]  # stage k's table over its own layers
    t_hop: float  # one hidden state from a stage to the next

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        if not math.isfinite(self.t_hop) or self.t_hop < 0:
            raise ValueError(f"hop latency must be finite and >= 0, got {self.t_hop}")

    @classmethod
    def of(cls, stages: Sequence[LatencyModel], t_hop: float) -> PipelineLatency:
        return cls(tuple(stages), t_hop)

    @property
    def num_layers(self) -> int:
        return sum(stage.num_layers for stage in self.stages)

    @property
    def num_items(self) -> int:
        return items.num_items(self.num_layers)

    @property
    def max_verify(self) -> int:
        return min(stage.max_verify for stage in self.stages)

    @property
    def t_fixed(self) -> float:
        """Embeddings on the first stage, final norm and head on the last."""
        return sum(stage.t_fixed for stage in self.stages)

    def stage_of(self, item: int) -> tuple[int, int]:
        """(stage, the item's index within that stage)."""
        if not 0 <= item < self.num_items:
            raise ValueError(f"item {item} is outside 0..{self.num_items - 1}")
        for k, stage in enumerate(self.stages):
            if item < stage.num_items:
                return k, item
            item -= stage.num_items
        raise AssertionError("unreachable")

    def t_item(self, item: int, n: int) -> float:
        k, local = self.stage_of(item)
        return self.stages[k].t_item(local, n)

    def item_weights(self, n: int, cap: int = DEFAULT_WEIGHT_CAP) -> list[int]:
        """Integer weights of all items on one scale: Δ is the cheapest item kind on the
        fastest stage, so an item on a stage twice as slow weighs about twice as much."""
        if cap < 1:
            raise ValueError(f"weight cap must be >= 1, got {cap}")
        delta = self._unit(n)
        return [integer_weight(self.t_item(item, n), delta, cap) for item in range(self.num_items)]

    def bypass_weights(self, n: int, cap: int = DEFAULT_WEIGHT_CAP) -> list[tuple[int, int, int]]:
        """(first item, end item, weight) of each middle stage: a draft that skips all its items
        also saves the hop into it, on the items' scale (see KnapsackProblem.bypass)."""
        if self.t_hop <= 0 or len(self.stages) < 3:
            return []
        weight = integer_weight(self.t_hop, self._unit(n), cap)
        groups, offset = [], self.stages[0].num_items
        for stage in self.stages[1:-1]:
            groups.append((offset, offset + stage.num_items, weight))
            offset += stage.num_items
        return groups

    def _unit(self, n: int) -> float:
        """Δ: the cheapest item kind on the fastest stage."""
        return min(min(stage.t_attn(n), stage.t_mlp) for stage in self.stages)

    def stages_run(self, skip: Collection[int]) -> list[bool]:
        """Which stages a draft with `skip` runs: the first and last always (embeddings, head)."""
        skipped = set(skip)
        run = []
        offset = 0
        for k, stage in enumerate(self.stages):
            stage_items = range(offset, offset + stage.num_items)
            offset += stage.num_items
            run.append(k in (0, len(self.stages) - 1) or not all(i in skipped for i in stage_items))
        return run

    def t_draft(self, skip: Collection[int], n: int) -> float:
        skipped = set(skip)
        total, offset = 0.0, 0
        run = self.stages_run(skipped)
        for stage, runs in zip(self.stages, run):
            local = {i - offset for i in skipped if offset <= i < offset + stage.num_items}
            offset += stage.num_items
            if runs:
                total += stage.t_draft(local, n)
        return total + (sum(run) - 1) * self.t_hop

    def t_forward(self, n: int) -> float:
        return self.t_draft((), n)

    def t_search(self, branch_tokens: int, n: int) -> float:
        """Each stage runs its own rows, then hands the frontier on: one hop per stage boundary."""
        return sum(stage.t_search(branch_tokens, n) for stage in self.stages) + (len(self.stages) - 1) * self.t_hop

    def t_verify(self, k: int, n: int) -> float:
        """Every stage verifies k tokens at its own measured ratio; the hops carry k rows."""
        if not 1 <= k <= self.max_verify:
            raise ValueError(f"verify of {k} tokens is outside the modelled 1..{self.max_verify}")
        return sum(stage.t_verify(k, n) for stage in self.stages) + (len(self.stages) - 1) * self.t_hop
