"""The KnapSpec knapsack DP over sublayers (items).

`g[i][j]` holds the best hidden states after the first i items among draft models
that skipped total weight exactly j, scored by the mean cosine similarity to the
full model's hidden states after item i on r reference tokens (KnapSpec, Sec. 4;
Lemma 4.1: with near-equal norms, high cosine keeps the greedy token). For item i,
every live cell either executes it (stays at j) or skips it (moves to j + w_i); a
cell keeps the higher-scoring of its arrivals. Cells scoring below the threshold τ
are dropped, budgets above K are not explored, and all live cells of a row run
through the item in one batched call. One pass yields a candidate per budget.

The full model itself is the cell j = 0 (it never skips), so its hidden states at
every depth come out of the same pass and need no separate forward.

The DP is a sequence of `advance` steps over a `Frontier`, so a pipeline stage can
run its own items on a frontier received from the previous stage. On a pipeline a draft
that skips every item of a middle stage also saves the hop into it (the stage is
bypassed): `KnapsackProblem.bypass` adds that saving to a cell's weight when the cell
skips the stage's last item, having skipped all the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from pipeline.errors import ConfigError
from pipeline.model import items
from pipeline.model.kv_cache import KVCache

# run_item(item, hidden [B, r, d]) -> hidden after executing the item on every branch.
RunItem = Callable[[int, torch.Tensor], torch.Tensor]

DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class KnapsackProblem:
    weights: tuple[int, ...]  # integer weight of each item
    budget: int  # K: the most skipped weight explored
    threshold: float = DEFAULT_THRESHOLD  # τ: cells with a lower mean cosine are dropped
    always_execute: frozenset[int] = frozenset()  # items never skipped (first and last layer)
    max_branches: int | None = None  # live cells kept per row (the best-scoring); None keeps all
    # (first item, end item, weight): skipping all of items [first, end) also saves `weight`.
    bypass: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if any(w < 1 for w in self.weights):
            raise ConfigError(f"item weights must be positive integers, got {self.weights}")
        for first, end, weight in self.bypass:
            if not 0 <= first < end <= len(self.weights) or weight < 0:
                raise ConfigError(f"bypass group ({first}, {end}, {weight}) does not fit {len(self.weights)} items")
        if self.budget < 0:
            raise ConfigError(f"budget must be >= 0, got {self.budget}")
        if self.max_branches is not None and self.max_branches < 1:
            raise ConfigError(f"max_branches must be >= 1, got {self.max_branches}")

    @property
    def num_items(self) -> int:
        return len(self.weights)


@dataclass(frozen=True)
class Candidate:
    skip: frozenset[int]  # the items this draft model skips
    skipped_weight: int
    score: float  # mean cosine to the full model after the last item


@dataclass
class Frontier:
    """The live cells of one DP row: cell b skipped weight `weights[b]` via items `skips[b]`."""

    weights: list[int]
    skips: list[frozenset[int]]
    scores: list[float]
    hidden: torch.Tensor  # [B, r, d]
    next_item: int = 0
    num_branch_rows: int = field(default=0)  # branch-item executions so far (the DP's work)

    @classmethod
    def start(cls, hidden: torch.Tensor) -> Frontier:
        """The row before item 0: only the empty skip set, on the embeddings [r, d]."""
        return cls(weights=[0], skips=[frozenset()], scores=[1.0], hidden=hidden[None])

    def candidates(self) -> list[Candidate]:
        """One candidate per reachable skipped weight, by increasing weight."""
        order = sorted(range(len(self.weights)), key=self.weights.__getitem__)
        return [Candidate(self.skips[b], self.weights[b], self.scores[b]) for b in order]


def mean_cosine(hidden: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of cos(hidden[b, t], reference[t]): [B, r, d], [r, d] -> [B]."""
    return torch.nn.functional.cosine_similarity(hidden.float(), reference.float()[None], dim=-1).mean(-1)


def advance(frontier: Frontier, item: int, problem: KnapsackProblem, run_item: RunItem) -> Frontier:
    """One DP row: execute or skip `item` from every live cell."""
    if item != frontier.next_item:
        raise ValueError(f"frontier is at item {frontier.next_item}, not {item}")
    executed = run_item(item, frontier.hidden)  # [B, r, d]
    full = frontier.weights.index(0)  # the cell that never skipped: the full model
    reference = executed[full]
    exec_scores = mean_cosine(executed, reference).tolist()

    # best[j] = (score, source row in `stacked`, skip set); stacked = [executed; frontier.hidden]
    best: dict[int, tuple[float, int, frozenset[int]]] = {}

    def offer(weight: int, score: float, row: int, skip: frozenset[int]) -> None:
        if weight == 0 or score >= problem.threshold:
            if weight not in best or score > best[weight][0]:
                best[weight] = (score, row, skip)

    num_live = len(frontier.weights)
    for b in range(num_live):
        offer(frontier.weights[b], exec_scores[b], b, frontier.skips[b])
    if item not in problem.always_execute:
        skip_scores = mean_cosine(frontier.hidden, reference).tolist()
        w = problem.weights[item]
        closing = [(range(first, end), bonus) for first, end, bonus in problem.bypass if end - 1 == item]
        for b in range(num_live):
            weight = frontier.weights[b] + w
            if weight <= problem.budget:
                skip = frontier.skips[b] | {item}
                weight += sum(bonus for rows, bonus in closing if all(i in skip for i in rows))
                offer(weight, skip_scores[b], num_live + b, skip)

    kept = sorted(best.items(), key=lambda kv: (kv[0] != 0, -kv[1][0]))  # the full model first, then by score
    if problem.max_branches is not None:
        kept = kept[: problem.max_branches]
    stacked = torch.cat([executed, frontier.hidden])
    rows = torch.tensor([row for _, (_, row, _) in kept], device=stacked.device)
    return Frontier(
        weights=[weight for weight, _ in kept],
        skips=[skip for _, (_, _, skip) in kept],
        scores=[score for _, (score, _, _) in kept],
        hidden=stacked.index_select(0, rows),
        next_item=item + 1,
        num_branch_rows=frontier.num_branch_rows + num_live,
    )


def run_dp(
    hidden: torch.Tensor,
    problem: KnapsackProblem,
    run_item: RunItem,
    items: Sequence[int] | None = None,
    frontier: Frontier | None = None,
) -> Frontier:
    """Advance from `frontier` (or the embeddings `hidden` [r, d]) through `items` (default: all)."""
    frontier = frontier or Frontier.start(hidden)
    for item in items if items is not None else range(frontier.next_item, problem.num_items):
        frontier = advance(frontier, item, problem, run_item)
    return frontier


def branch_runner(run_item_branches: RunItem, layer_rows: bool = False) -> RunItem:
    """The DP's rows from a model's sublayer items: each row one item, or (`layer_rows`) one
    layer, whose attention and MLP items are executed or skipped together."""
    if not layer_rows:
        return run_item_branches

    def run_layer(layer: int, hidden: torch.Tensor) -> torch.Tensor:
        attn, mlp = items.layer_items(layer)
        return run_item_branches(mlp, run_item_branches(attn, hidden))

    return run_layer


@runtime_checkable
class RunsKnapsack(Protocol):
    """A model that runs the DP's rows where its items live (a pipeline: each stage advances
    the frontier the previous stage hands it)."""

    def run_knapsack(
        self, cache, token_ids: torch.Tensor, problem: KnapsackProblem, prefix_len: int, layer_rows: bool = False
    ) -> Frontier: ...


def run_knapsack(
    model, cache: KVCache, token_ids: torch.Tensor, problem: KnapsackProblem, prefix_len: int, layer_rows: bool = False
) -> Frontier:
    """The DP on reference tokens [r] at positions [prefix_len, prefix_len + r) of `model` (the
    cache is only read); rows are items, or layers when `layer_rows`. Returns the last row."""
    if isinstance(model, RunsKnapsack):
        return model.run_knapsack(cache, token_ids, problem, prefix_len, layer_rows)
    run = branch_runner(lambda item, h: model.run_item_branches(item, h, cache, prefix_len), layer_rows)
    return run_dp(model.embed_tokens(token_ids), problem, run)


def most_saved(costs: Sequence[float], weights: Sequence[int], skippable: Sequence[int], budget: int) -> float:
    """The most time skipping items of total weight <= `budget` could save, items taken in part
    allowed (the fractional knapsack, best cost per weight first): a bound on any skip set."""
    saved = 0.0
    for i in sorted(skippable, key=lambda i: costs[i] / weights[i], reverse=True):
        if budget <= 0:
            break
        take = min(1.0, budget / weights[i])
        saved += take * costs[i]
        budget -= take * weights[i]
    return saved


def default_always_execute(num_layers: int) -> frozenset[int]:
    """The first and last layers' items: skipping them ruins drafts (KnapSpec keeps them)."""
    return items.items_of_layers({0, num_layers - 1})
