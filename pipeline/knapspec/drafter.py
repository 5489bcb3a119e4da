"""The KnapSpec drafter: a latency-aware knapsack picks the draft model, TPT picks γ.

Every `reoptimize_every` steps (and when the context has grown enough to change the
integer item weights) it runs the knapsack DP on the last r committed tokens,
estimates each candidate's acceptance α from its top-1 agreement with the full
model there, and chooses the (skip set, γ) with the best predicted tokens per time —
or plain decoding when speculation is not predicted to win.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from pipeline.decoding.drafters import DraftRequest
from pipeline.knapspec.knapsack import default_always_execute, most_saved, run_knapsack
from pipeline.knapspec.replanning import (
    KnapSpecConfig,
    ReplanningDrafter,
    search_budget,
    steps_planned_for,
    top1_tokens,
)
from pipeline.knapspec.search_problem import branch_cap, knapsack_problem
from pipeline.knapspec.tpt import DraftPlan, ScoredCandidate, choose_plan, smoothed_alpha
from pipeline.model import items
from pipeline.model.sublayer_model import SublayerModel


class KnapSpecDrafter(ReplanningDrafter):
    """The latency-aware knapsack over items, TPT over γ, AR when speculation would not pay."""

    def make_plan(self, request: DraftRequest) -> DraftPlan | None:
        config, context = self.config, request.cache.length
        weights = tuple(self.latency.item_weights(context, config.weight_cap))

        def t_verify(k: int) -> float:
            return self.latency.t_verify(k, context)

        bound = choose_plan(
            [self.optimistic_candidate(weights, context, request.model.spec.num_layers)],
            t_verify,
            config.max_draft,
            config.margin,
        )
        if bound.use_ar:
            # Not even a perfect draft at the cheapest cost the budget allows would win: skip the DP.
            return choose_plan([], t_verify, config.max_draft, config.margin)
        gain = bound.predicted_tpt / bound.ar_tpt
        branches = self.search_branches(context, request.max_tokens + 1, gain)
        if branches == 0:
            return None
        ref_ids, prefix = self.reference(request)
        bypass = tuple(self.latency.bypass_weights(context, config.weight_cap))
        search = replace(config, max_branches=branches)
        t0 = time.perf_counter()
        candidates = search_candidates(request.model, request.cache, ref_ids, prefix, weights, search, bypass)
        seconds = time.perf_counter() - t0
        # Unbounded (no cap, no budget), the search's cells are not known beforehand: nothing to correct.
        estimate = self.search_cost(branches, context) if branches is not None else 0.0
        if estimate > 0:
            self.history.search_cost_ratios.append(seconds / estimate)
        self.history.searched(seconds, search_budget(config, 1.0, gain))
        scored = [self.score(skip, top1, candidates[0][1], context) for skip, top1 in candidates]
        return choose_plan(scored, t_verify, config.max_draft, config.margin)

    def search_cost(self, branches: int, context: int) -> float:
        """Seconds of one DP search with at most `branches` cells per row, as the latency model
        predicts it (before the engine's correction by what its searches took)."""
        return self.latency.t_search(branches * self.config.num_reference_tokens, context)

    def search_branches(self, context: int, steps_left: int, bound_gain: float | None = None) -> int | None:
        """The branch cap that keeps a search within its budget (replanning.search_budget) over
        the decode time it plans for, less the engine's search debt: the configured cap when that
        fits, fewer when not, 0 when not even MIN_SEARCH_BRANCHES do. `steps_left`: the
        request's tokens left, decoded at the engine's recent tokens per step; `bound_gain`: the
        optimistic bound's tokens/s over AR's."""
        steps = steps_planned_for(self._interval(), steps_left, self.history.tokens_per_step())
        scale = self.history.search_cost_scale()
        return branch_cap(
            self.config,
            steps * self.latency.t_verify(1, context),
            bound_gain,
            self.history.search_debt,
            # Uncapped, the DP keeps at most one cell per budget: half the total weight, + 1.
            lambda: sum(self.latency.item_weights(context, self.config.weight_cap)) // 2 + 1,
            lambda branches: self.search_cost(branches, context) * scale,
        )

    def optimistic_candidate(self, weights: tuple[int, ...], context: int, num_layers: int) -> ScoredCandidate:
        """An upper bound on any candidate: α as if every reference token matched, and the
        draft cost less the most time a budget of half the weight can save (fractional knapsack)."""
        config = self.config
        always = default_always_execute(num_layers)
        items = [i for i in range(len(weights)) if i not in always]
        costs = [self.latency.t_item(i, context) for i in range(len(weights))]
        saved = most_saved(costs, weights, items, sum(weights) // 2)
        r = config.num_reference_tokens
        alpha = smoothed_alpha(r, r, 0, 0, config.prior_mean, config.prior_strength)
        return ScoredCandidate(frozenset(items), alpha, self.latency.t_forward(context) - saved)


def search_candidates(
    model: SublayerModel,
    cache,
    ref_ids: torch.Tensor,
    prefix: int,
    weights: tuple[int, ...],
    config: KnapSpecConfig,
    bypass: tuple[tuple[int, int, int], ...] = (),
) -> list[tuple[frozenset[int], torch.Tensor]]:
    """Run the DP on reference tokens at [prefix, prefix + r); returns (skip set, top-1
    tokens [r]) per candidate, the full model (empty skip) first. `bypass`: on a pipeline,
    (first item, end item, weight) of each stage a draft can bypass, and the hop it saves."""
    problem = knapsack_problem(config, weights, model.spec.num_layers, config.max_branches, bypass)
    frontier = run_knapsack(model, cache, ref_ids, problem, prefix, layer_rows=config.coupled)
    skips = frontier.skips
    if config.coupled:
        skips = [items.items_of_layers(skip) for skip in skips]
    top1 = top1_tokens(model, frontier.hidden)
    order = sorted(range(len(skips)), key=lambda b: frontier.weights[b])
    return [(skips[b], top1[b]) for b in order]
