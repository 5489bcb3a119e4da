"""KnapSpec's latency model of a batched step: what an item costs when many requests share it.

A batched step over R requests, request i with nᵢ cached tokens and qᵢ query rows (M rows
in all), costs (decoding/step_cost.py)

    T = fixed + per_row · M + per_key · Σ nᵢ + per_key_row · Σ nᵢ (qᵢ − 1)

The first two terms are the linears: they read every weight once for the whole batch and
grow by rows. The last two are attention: each request reads its own cache. So the linear
part is shared among the items by their share of one row's linear cost on the device (an
attention item's projections, an MLP item, and the embedding, final norm and LM head that no
skip set removes: the table's `attn_base`, `t_mlp`, `t_fixed`), and the key part belongs to
the attention items alone, a 1/L share each. An MLP item's cost is then split R ways while an
attention item's grows with the batch's total context: as batch × context grows, attention
items weigh more and the knapsack skips them first.

The coefficients are a `StepCost`: the device's latency table at first, the engine's own
timed steps once it has some (OnlineStepCost). What the steps taught goes back into a table
(`corrected_table`), so that a request planning alone and the next job start from it. Pure
arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pipeline.decoding.step_cost import StepCost
from pipeline.knapspec.latency import DEFAULT_WEIGHT_CAP, LatencyModel, integer_weight
from pipeline.model import items


@dataclass(frozen=True)
class BatchShape:
    """Who a step serves: each request's cached tokens and query rows; `padded`: the caches
    are slots of one KV pool, whose attention computes the widest block for every slot."""

    contexts: tuple[int, ...]
    rows: tuple[int, ...]
    padded: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "contexts", tuple(int(n) for n in self.contexts))
        object.__setattr__(self, "rows", tuple(int(q) for q in self.rows))
        if not self.contexts or len(self.contexts) != len(self.rows):
            raise ValueError(f"a batch step needs one row count per request, got {self.contexts} and {self.rows}")
        if min(self.rows) < 1 or min(self.contexts) < 0:
            raise ValueError(f"rows must be >= 1 and contexts >= 0, got {self.rows} and {self.contexts}")

    @classmethod
    def decoding(cls, contexts: Sequence[int], rows: int = 1, padded: bool = False) -> BatchShape:
        """Every request runs `rows` rows: 1 to decode or draft, γ + 1 to verify."""
        return cls(tuple(contexts), (rows,) * len(contexts), padded)


@dataclass(frozen=True)
class ItemCosts:
    """Seconds of one batched step's parts: one attention item, one MLP item, and the rest."""

    attention: float
    mlp: float
    rest: float  # embedding, final norm and LM head: run whatever is skipped


@dataclass(frozen=True)
class BatchLatency:
    cost: StepCost  # the whole forward's coefficients
    attn_share: float  # one attention item's share of one row's linear cost
    mlp_share: float  # one MLP item's
    num_layers: int

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"a latency model needs at least one layer, got {self.num_layers}")
        if min(self.attn_share, self.mlp_share) < 0 or self.num_layers * (self.attn_share + self.mlp_share) > 1 + 1e-9:
            raise ValueError(f"item shares must be >= 0 and sum to at most 1, got {self.attn_share}, {self.mlp_share}")

    @classmethod
    def of(cls, latency: LatencyModel, cost: StepCost | None = None) -> BatchLatency:
        """From a device's table: its item shares, and `cost` (default: the table's own)."""
        layers = latency.num_layers
        linear = latency.t_fixed + layers * (latency.attn_base + latency.t_mlp)
        if linear <= 0:
            raise ValueError("a latency table whose items cost nothing cannot weigh them")
        return cls(
            cost if cost is not None else StepCost.from_table(latency),
            latency.attn_base / linear,
            latency.t_mlp / linear,
            layers,
        )

    @property
    def num_items(self) -> int:
        return items.num_items(self.num_layers)

    def item_costs(self, shape: BatchShape) -> ItemCosts:
        c = self.cost
        _, num_rows, keys, extra_rows = StepCost.features(shape.contexts, shape.rows, shape.padded)
        linear = c.fixed + c.per_row * num_rows
        attention = c.per_key * keys + c.per_key_row * extra_rows
        shared = self.num_layers * (self.attn_share + self.mlp_share)
        return ItemCosts(
            attention=self.attn_share * linear + attention / self.num_layers,
            mlp=self.mlp_share * linear,
            rest=max(1.0 - shared, 0.0) * linear,
        )

    def t_step(self, skip: Collection[int], shape: BatchShape) -> float:
        """One batched forward of the model minus `skip` (a draft step, or a verify when empty)."""
        for item in skip:
            if not 0 <= item < self.num_items:
                raise ValueError(f"item {item} is outside 0..{self.num_items - 1}")
        costs = self.item_costs(shape)
        skipped_attn, skipped_mlp = items.count_kinds(set(skip))
        return (
            costs.rest
            + (self.num_layers - skipped_attn) * costs.attention
            + (self.num_layers - skipped_mlp) * costs.mlp
        )

    def item_weights(self, shape: BatchShape, cap: int = DEFAULT_WEIGHT_CAP) -> list[int]:
        """Integer knapsack weights of the 2L items for a step of this shape: the cheaper kind
        weighs 1, the other its cost in those units (as LatencyModel.item_weights at batch 1)."""
        if cap < 1:
            raise ValueError(f"weight cap must be >= 1, got {cap}")
        costs = self.item_costs(shape)
        delta = min(costs.attention, costs.mlp)
        w_attn, w_mlp = (integer_weight(t, delta, cap) for t in (costs.attention, costs.mlp))
        return [w_attn if items.is_attention(item) else w_mlp for item in range(self.num_items)]

    def attention_fraction(self, shape: BatchShape) -> float:
        """The share of a full step spent in attention items (what skipping them can save)."""
        costs = self.item_costs(shape)
        return self.num_layers * costs.attention / self.t_step((), shape)


# A corrected verify ratio never drops below this: a table's ratios must stay positive.
MIN_VERIFY_RATIO = 1e-3


def corrected_table(latency: LatencyModel, cost: StepCost) -> LatencyModel:
    """`latency` made to agree with a step cost fitted to timed steps: `StepCost.from_table` of
    the result gives back the fit's one-row cost (`fixed + per_row`), its per-row slope and its
    per-key cost. Timed steps cannot tell items apart, so the split of one row's cost among
    attention, MLP and the rest stays the table's, and so does the shape of the verify curve,
    stretched to the fit's slope. The fit's `per_key_row` has no place of its own in a table
    (a table ties it to the per-row slope); the online fit learns it again from drafting steps."""
    table = StepCost.from_table(latency)
    base, fitted_base = table.fixed + table.per_row, cost.fixed + cost.per_row
    if base <= 0 or fitted_base <= 0:
        raise ValueError(f"a step cost of one row must be positive, got {base} (table) and {fitted_base} (fit)")
    scale = fitted_base / base
    slope, fitted_slope = table.per_row / base, cost.per_row / fitted_base
    if slope > 0:
        ratios = [1.0 + (r - 1.0) * fitted_slope / slope for r in latency.verify_ratios]
    else:  # a flat (or noisy, falling) curve has no shape to stretch: the fit's straight line
        ratios = [1.0 + fitted_slope * j for j in range(latency.max_verify)]
    return dataclasses.replace(
        latency,
        attn_slope=cost.per_key / latency.num_layers,
        attn_base=latency.attn_base * scale,
        t_mlp=latency.t_mlp * scale,
        t_fixed=latency.t_fixed * scale,
        verify_ratios=(1.0, *(max(r, MIN_VERIFY_RATIO) for r in ratios[1:])),
    )
