"""The latency model of a pipelined replica: each stage's own table, plus the hops.

Every stage is calibrated on the device it runs on (`StageModel.calibrate`), so a slow
device's items weigh more in the knapsack and get skipped first. A draft token pays
each stage it runs, and one hop per stage after the first; a middle stage whose items
are all skipped is bypassed and costs nothing. `PipelineLatency` answers the questions
the KnapSpec search asks of a `LatencyModel` (item_weights, t_item, t_draft, t_forward,
t_verify), so the search runs over a pipeline unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pipeline.knapspec.latency import DEFAULT_WEIGHT_CAP, LatencyModel, _weight


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
        return 2 * self.num_layers

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
        return [_weight(self.t_item(item, n), delta, cap) for item in range(self.num_items)]

    def bypass_weights(self, n: int, cap: int = DEFAULT_WEIGHT_CAP) -> list[tuple[int, int, int]]:
        """(first item, end item, weight) of each middle stage: a draft that skips all its items
        also saves the hop into it, on the items' scale (see KnapsackProblem.bypass)."""
        if self.t_hop <= 0 or len(self.stages) < 3:
            return []
        weight = _weight(self.t_hop, self._unit(n), cap)
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
            items = range(offset, offset + stage.num_items)
            offset += stage.num_items
            run.append(k in (0, len(self.stages) - 1) or not all(i in skipped for i in items))
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
