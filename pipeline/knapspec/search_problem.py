"""The knapsack search as a request's drafter and a batch's planner both set it up: how many
branches fit its time budget, and the problem it solves."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.knapspec.knapsack import KnapsackProblem, default_always_execute
from pipeline.knapspec.replanning import KnapSpecConfig, branches_within, search_budget
from pipeline.model import items


def branch_cap(
    config: KnapSpecConfig,
    plain_seconds: float,
    bound_gain: float | None,
    search_debt: float,
    most_uncapped: Callable[[], int],
    seconds: Callable[[int], float],
) -> int | None:
    """The branch cap that keeps a search within its budget (search_budget) over the
    `plain_seconds` of decoding it plans for, less the engine's `search_debt` (what earlier
    searches took and decoding has not paid back): the configured cap when that fits (None:
    uncapped and unbounded), fewer when not, 0 when not even MIN_SEARCH_BRANCHES do.
    `most_uncapped`: the most branches worth trying without a configured cap; `seconds`: a
    search's predicted time at a branch count. A request's search and a batch's share it."""
    cap = config.max_branches
    budget = search_budget(config, plain_seconds, bound_gain)
    if budget is None:
        return cap
    most = cap if cap is not None else most_uncapped()
    return branches_within(budget - search_debt, most, seconds)


def knapsack_problem(
    config: KnapSpecConfig,
    weights: tuple[int, ...],
    num_layers: int,
    branches: int | None,
    bypass: tuple[tuple[int, int, int], ...] = (),
) -> KnapsackProblem:
    """The DP over the items' integer `weights` under half their total, keeping at most
    `branches` cells a row; in the coupled ablation over layers (a layer's attention and MLP
    weighed and skipped together, the first and last layers kept). `bypass`: (first item, end
    item, weight) of each pipeline stage a draft can bypass."""
    if config.coupled:
        weights = tuple(sum(weights[item] for item in items.layer_items(layer)) for layer in range(num_layers))
        bypass = tuple((first // 2, end // 2, w) for first, end, w in bypass)
        always = frozenset({0, num_layers - 1})
    else:
        always = default_always_execute(num_layers)
    return KnapsackProblem(
        weights=weights,
        budget=sum(weights) // 2,
        threshold=config.threshold,
        always_execute=always,
        max_branches=branches,
        bypass=bypass,
    )
