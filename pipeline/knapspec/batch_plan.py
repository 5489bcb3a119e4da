"""KnapSpec for a batch: one sub-network for every request of a batched step.

An MLP item saves time only if no request of the step runs it, so the knapsack picks one
skip set for the batch. Its weights are the batched step's (batch_latency.py: MLPs shared
by the batch, attention growing with its total context); its value is the mean cosine over
reference tokens pooled from the requests (a few recent tokens of each, every request's
attention items over its own cache), run as the usual DP with the branches batched. Each
candidate's acceptance α is estimated per request (its reference tokens' top-1 agreement
and what it accepted under the current plan), and the plan maximizes the tokens the batch
expects per second of its steps:

    TPT(S, γ) = Σᵢ (1 − αᵢ^(γ+1)) / (1 − αᵢ) / (γ · T_draft(S) + T_verify(γ + 1))

against R / T_verify(1) of plain decoding (the AR fallback, for the whole batch). Each
request's draft still stops early at its own confidence stop. The plan is re-made every
`reoptimize_every` steps (backed off after AR verdicts) and when the batch's integer weights
change; a request joining the batch adopts the current plan.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.decoding.batch_drafts import pooled
from pipeline.decoding.step_cost import MIN_TIMED_STEPS, OnlineStepCost
from pipeline.knapspec.batch_latency import BatchLatency, BatchShape
from pipeline.knapspec.knapsack import (
    KnapsackProblem,
    RunItem,
    RunsKnapsack,
    branch_runner,
    default_always_execute,
    most_saved,
    run_dp,
)
from pipeline.knapspec.latency import LatencyModel
from pipeline.knapspec.replanning import (
    KnapSpecConfig,
    SearchHistory,
    search_budget,
    search_interval,
    steps_planned_for,
    top1_tokens,
)
from pipeline.knapspec.search_problem import branch_cap, knapsack_problem
from pipeline.knapspec.tpt import DraftPlan, expected_tokens, smoothed_alpha
from pipeline.model import items

logger = logging.getLogger(__name__)

# Requests whose reference tokens a batch search reads, and the fewest tokens from each: the
# DP's rows grow with the tokens, and a handful from each of eight requests tell more about
# the batch than many from one.
MAX_SAMPLED_REQUESTS = 4
MIN_TOKENS_PER_REQUEST = 2
# Searches whose record a planner keeps (a replica's planner lives as long as its job).
SEARCHES_KEPT = 1024


@dataclass(frozen=True)
class ReferenceSpan:
    """One request's reference tokens: its committed tokens at [start, start + len(ids))."""

    cache: object  # the request's KV cache (only read)
    ids: torch.Tensor  # [r_i]
    start: int


@dataclass(frozen=True)
class BatchCandidate:
    skip: frozenset[int]
    alphas: tuple[float, ...]  # each request's acceptance estimate


def pooled_runner(model, spans: Sequence[ReferenceSpan]) -> RunItem:
    """The DP's item runner over the spans' tokens side by side [B, Σ rᵢ, d]: an MLP item on
    all of them at once, an attention item on each span over its own cache."""
    bounds = [0]
    for span in spans:
        bounds.append(bounds[-1] + span.ids.numel())

    def run(item: int, hidden: torch.Tensor) -> torch.Tensor:
        first = spans[0]
        if not items.is_attention(item):
            return model.run_item_branches(item, hidden, first.cache, first.start)
        parts = [
            model.run_item_branches(item, hidden[:, a:b], span.cache, span.start)
            for span, a, b in zip(spans, bounds, bounds[1:])
        ]
        return torch.cat(parts, dim=1)

    return run


def search_batch_candidates(
    model, spans: Sequence[ReferenceSpan], problem: KnapsackProblem, layer_rows: bool = False
) -> list[tuple[frozenset[int], list[torch.Tensor]]]:
    """The batch DP on the spans' pooled tokens: (skip set, top-1 tokens per span) of every
    candidate, the full model first. `layer_rows`: layer-granular items (the coupled ablation;
    `problem` is then over layers)."""
    token_ids = torch.cat([span.ids for span in spans])
    frontier = run_dp(model.embed_tokens(token_ids), problem, branch_runner(pooled_runner(model, spans), layer_rows))
    top1 = top1_tokens(model, frontier.hidden)  # [B, Σ r_i]
    sizes = [span.ids.numel() for span in spans]
    order = sorted(range(len(frontier.skips)), key=lambda b: frontier.weights[b])
    out = []
    for b in order:
        skip = frontier.skips[b]
        if layer_rows:
            skip = items.items_of_layers(skip)
        out.append((skip, list(torch.split(top1[b], sizes))))
    return out


@dataclass(frozen=True)
class BatchChoice:
    """A batch's plan (its TPTs per request, as a single request's plan has them), the batch's
    predicted tokens per second under it and under plain decoding, and the best drafting plan
    found (chosen or not: what it would have gained is the reason for an AR verdict)."""

    plan: DraftPlan
    tpt: float
    ar_tpt: float
    best_draft: DraftPlan | None = None
    best_draft_tpt: float = 0.0


def choose_batch_plan(
    candidates: Sequence[BatchCandidate],
    latency: BatchLatency,
    contexts: Sequence[int],
    padded: bool,
    max_draft: int,
    margin: float,
) -> BatchChoice:
    """The (candidate, γ) with the most tokens per second for the batch, or AR unless it wins
    by `margin`."""
    num = len(contexts)
    ar_step = latency.t_step((), BatchShape.decoding(contexts, 1, padded))
    ar_tpt = num / ar_step
    t_verify_of = [
        latency.t_step((), BatchShape.decoding(contexts, gamma + 1, padded)) for gamma in range(max_draft + 1)
    ]
    best: tuple[float, DraftPlan] | None = None
    for candidate in candidates:
        if not candidate.skip:
            continue  # drafting with the full model never pays
        t_draft = latency.t_step(candidate.skip, BatchShape.decoding(contexts, 1, padded))
        mean_alpha = sum(candidate.alphas) / len(candidate.alphas)
        for gamma in range(1, max_draft + 1):
            t_verify = t_verify_of[gamma]
            tokens = sum(expected_tokens(alpha, gamma) for alpha in candidate.alphas)
            tpt = tokens / (gamma * t_draft + t_verify)
            if best is None or tpt > best[0]:
                best = (tpt, DraftPlan(candidate.skip, gamma, mean_alpha, tpt / num, ar_tpt / num))
    best_tpt, best_plan = best if best is not None else (0.0, None)
    if best_plan is not None and best_tpt > ar_tpt * (1.0 + margin):
        return BatchChoice(best_plan, best_tpt, ar_tpt, best_plan, best_tpt)
    return BatchChoice(DraftPlan(None, 0, 0.0, ar_tpt / num, ar_tpt / num), ar_tpt, ar_tpt, best_plan, best_tpt)


def optimistic_batch_tpt(latency: BatchLatency, weights: Sequence[int], contexts, padded, max_draft, alpha) -> float:
    """An upper bound on any candidate's batch TPT: every request accepting with `alpha`, and a
    draft step cheaper by the most a budget of half the weight can skip (fractional knapsack)."""
    shape = BatchShape.decoding(contexts, 1, padded)
    costs = latency.item_costs(shape)
    always = default_always_execute(latency.num_layers)
    skippable = [i for i in range(len(weights)) if i not in always]
    cost_of = [costs.attention if items.is_attention(i) else costs.mlp for i in range(len(weights))]
    t_draft = latency.t_step((), shape) - most_saved(cost_of, weights, skippable, sum(weights) // 2)
    best = 0.0
    for gamma in range(1, max_draft + 1):
        t_verify = latency.t_step((), BatchShape.decoding(contexts, gamma + 1, padded))
        best = max(best, len(contexts) * expected_tokens(alpha, gamma) / (gamma * t_draft + t_verify))
    return best


class BatchPlanner:
    """One plan for the KnapSpec requests of a batch (the drafters built with this planner)."""

    def __init__(self, latency: LatencyModel, config: KnapSpecConfig, history: SearchHistory | None = None) -> None:
        self.latency = latency
        self.config = config
        self.history = history if history is not None else SearchHistory()
        self.plan: DraftPlan | None = None
        self._weights: tuple[int, ...] | None = None
        self._steps = 0
        self._members: set[int] = set()  # ids of the drafters that hold the current plan
        self._warmup: DraftPlan | None = None  # plain decoding while the first steps are timed
        # What the last SEARCHES_KEPT searches chose and predicted (each member request's result has its own).
        self.searches: deque[dict] = deque(maxlen=SEARCHES_KEPT)
        self.num_searches = 0  # all of them
        self.num_postponed = 0
        # Measured / predicted seconds of this planner's searches (a batch search has more calls
        # per row than a request's: the single-request correction does not carry over).
        self._cost_ratios: deque[float] = deque(maxlen=16)

    # ------------------------------------------------------------ per step

    def prepare(self, model, requests: Sequence, cost: OnlineStepCost | None) -> None:
        """Before a batch step: the plan of `requests` (DecodingRequests whose drafters carry this
        planner), re-made when due, adopted by each. Alone, or on a model this planner cannot
        search (a pipeline runs its DP stage by stage), each request plans for itself, from the
        table as `cost` (the fit of the timed steps) corrects it once it has seen a few steps."""
        drafters = [r.drafter.layer_drafter for r in requests]
        for drafter in drafters:  # for when it plans alone
            drafter.follow(cost)
        if len(requests) < 2 or isinstance(model, RunsKnapsack) or not isinstance(self.latency, LatencyModel):
            for drafter in drafters:
                drafter.release()
            self._members.clear()
            return
        batch = BatchLatency.of(self.latency, cost.current() if cost is not None else None)
        contexts = [r.cache.length for r in requests]
        padded = pooled([r.cache for r in requests])
        self.history.decoded(batch.t_step((), BatchShape.decoding(contexts, 1, padded)))
        weights = tuple(batch.item_weights(BatchShape.decoding(contexts, 1, padded), self.config.weight_cap))
        self._steps += 1
        searched = False
        if cost is not None and cost.num_steps < MIN_TIMED_STEPS:
            # The table alone can be far off for a batch (a busy machine, a pooled attention it never
            # timed): a few plain steps first, for the online fit to start from.
            if self._warmup is None:
                self._warmup = self._plain(batch, contexts, padded)
            for r, drafter in zip(requests, drafters):
                drafter.adopt(self._warmup, model, r.cache.length, searched=False)
            return
        if (
            self.plan is None
            or weights != self._weights
            or self._steps >= search_interval(self.config, self.history, self._weights)
        ):
            plan = self._make_plan(model, requests, drafters, batch, weights, contexts, padded)
            searched = plan is not None
            if plan is None:  # no time for a search now: plain decoding until the next check
                self.num_postponed += 1
                for drafter in drafters:
                    drafter.batch_postponed += 1
                plan = self._plain(batch, contexts, padded)
            self.plan, self._weights, self._steps = plan, weights, 0
            self._members.clear()
        self._adopt_all(model, requests, drafters, self.plan, searched)

    def _adopt_all(self, model, requests, drafters, plan: DraftPlan, searched: bool) -> None:
        for r, drafter in zip(requests, drafters):
            drafter.adopt(plan, model, r.cache.length, searched=searched or id(drafter) not in self._members)
            self._members.add(id(drafter))

    @staticmethod
    def _plain(batch: BatchLatency, contexts, padded) -> DraftPlan:
        ar_tpt = 1.0 / batch.t_step((), BatchShape.decoding(contexts, 1, padded))
        return DraftPlan(None, 0, 0.0, ar_tpt, ar_tpt)

    # ------------------------------------------------------------ planning

    def _make_plan(self, model, requests, drafters, batch, weights, contexts, padded) -> DraftPlan | None:
        config = self.config
        t0 = time.perf_counter()
        r = config.num_reference_tokens
        bound = optimistic_batch_tpt(
            batch,
            weights,
            contexts,
            padded,
            config.max_draft,
            smoothed_alpha(r, r, 0, 0, config.prior_mean, config.prior_strength),
        )
        ar_tpt = len(contexts) / batch.t_step((), BatchShape.decoding(contexts, 1, padded))
        if bound <= ar_tpt * (1.0 + config.margin):
            plan = DraftPlan(None, 0, 0.0, ar_tpt / len(contexts), ar_tpt / len(contexts))
            choice = BatchChoice(plan, ar_tpt, ar_tpt, best_draft_tpt=bound)
            self._record(choice, weights, contexts, time.perf_counter() - t0, requests, searched=False)
            return plan
        spans, sampled = self._spans(model, requests)
        if not spans:
            return None
        gain = bound / ar_tpt
        branches = self._branches(batch, contexts, padded, spans, requests, gain)
        if branches == 0:
            return None
        problem = knapsack_problem(config, weights, model.spec.num_layers, branches)
        candidates = search_batch_candidates(model, spans, problem, layer_rows=config.coupled)
        full = candidates[0][1]
        scored = []
        for skip, top1 in candidates:
            alphas = []
            for k, (span, ids) in enumerate(zip(spans, top1)):
                accepted, drafted = drafters[sampled[k]].observed(skip)
                matches = int((ids == full[k]).sum())
                alphas.append(
                    smoothed_alpha(matches, ids.numel(), accepted, drafted, config.prior_mean, config.prior_strength)
                )
            mean = sum(alphas) / len(alphas)
            by_request = dict(zip(sampled, alphas))
            scored.append(BatchCandidate(skip, tuple(by_request.get(i, mean) for i in range(len(requests)))))
        choice = choose_batch_plan(scored, batch, contexts, padded, config.max_draft, config.margin)
        seconds = time.perf_counter() - t0
        estimate = self.search_cost(branches, spans)
        if estimate > 0:
            self._cost_ratios.append(seconds / estimate)
        self.history.searched(seconds, search_budget(config, 1.0, gain))
        self._record(choice, weights, contexts, seconds, requests, searched=True)
        return choice.plan

    def _spans(self, model, requests) -> tuple[list[ReferenceSpan], list[int]]:
        """A few committed tokens of up to MAX_SAMPLED_REQUESTS requests (those with the longest
        answers so far: their recent tokens are the answer's, not the prompt's)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].output))[:MAX_SAMPLED_REQUESTS]
        per = max(MIN_TOKENS_PER_REQUEST, -(-self.config.num_reference_tokens // len(order)))
        spans, sampled = [], []
        for i in order:
            request = requests[i]
            context = request.cache.length
            if context <= per:
                continue
            ids = torch.tensor(request.history[context - per : context], device=model.device)
            spans.append(ReferenceSpan(request.cache, ids, context - per))
            sampled.append(i)
        return spans, sampled

    def search_cost(self, branches: int, spans: Sequence[ReferenceSpan]) -> float:
        """Seconds of a batch search as the table predicts it: each span's as a request's own
        search at its context (its attention items run span by span; a bound from above for the
        MLP items, which run once for all), before the correction by what searches took."""
        return sum(self.latency.t_search(branches * span.ids.numel(), span.start) for span in spans)

    def _branches(self, batch: BatchLatency, contexts, padded, spans, requests, bound_gain: float) -> int | None:
        """The branch cap that keeps the search within its budget over the batch's decode time
        until the next search (KnapSpecDrafter.search_branches, for a batch)."""
        # The batch decodes until its longest request is done, at its requests' tokens per step.
        tokens_left = max(r.config.max_new_tokens - len(r.output) for r in requests)
        interval = search_interval(self.config, self.history, self._weights)
        steps = steps_planned_for(interval, tokens_left, self.history.tokens_per_step())
        scale = statistics.median(self._cost_ratios) if self._cost_ratios else 1.0
        return branch_cap(
            self.config,
            steps * batch.t_step((), BatchShape.decoding(contexts, 1, padded)),
            bound_gain,
            self.history.search_debt,
            lambda: sum(self.latency.item_weights(_mean(contexts), self.config.weight_cap)) // 2 + 1,
            lambda branches: self.search_cost(branches, spans) * scale,
        )

    def _record(self, choice: BatchChoice, weights, contexts, seconds, requests, searched: bool) -> None:
        plan = choice.plan
        self.history.record(weights, plan.use_ar)
        attn, mlp = items.count_kinds(plan.skip or ())
        self.num_searches += 1
        record = {
            "id": self.num_searches,
            "batch": len(contexts),
            "total_context": sum(contexts),
            "searched": searched,
            "skipped_attn": attn,
            "skipped_mlp": mlp,
            "gamma": plan.gamma,
            "predicted_tpt": choice.tpt,
            "ar_tpt": choice.ar_tpt,
            # Without a search: the optimistic bound (every reference token matched).
            "best_draft_tpt": choice.best_draft_tpt,
            "best_draft_alpha": choice.best_draft.alpha if choice.best_draft else None,
            "best_draft_skipped": len(choice.best_draft.skip) if choice.best_draft else None,
            "seconds": seconds,
        }
        self.searches.append(record)
        share = seconds / len(requests)
        for r in requests:  # the search is every member's: each carries its share of the time
            r.drafter.layer_drafter.optimize_s += share
            r.drafter.layer_drafter.batch_searches.append(record)  # into its result (the drafter's summary)
        logger.debug(
            "batch of %d at %d tokens: %s, predicted %.1f tok/s vs AR %.1f",
            len(contexts),
            sum(contexts),
            "AR" if plan.use_ar else f"skip {attn} attention + {mlp} MLP items, γ={plan.gamma}",
            choice.tpt,
            choice.ar_tpt,
        )


def _mean(values: Sequence[int]) -> int:
    return int(math.fsum(values) / len(values)) if values else 0
