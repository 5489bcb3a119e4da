"""Drafters that re-plan: every `reoptimize_every` steps (and when the context has grown
enough to change the integer item weights) they search for a new (skip set, γ), score
candidates by their top-1 agreement with the full model on the last r committed tokens,
and draft with the chosen skip set — or decode plainly when the plan says so.

KnapSpec (drafter.py) and the baselines (baselines.py) differ only in how they make a plan.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.decoding.drafters import (
    DEFAULT_CONFIDENCE_THRESHOLD,
    BatchPlanning,
    Draft,
    DraftRequest,
    DraftSteps,
    LayerSkipDrafter,
)
from pipeline.decoding.step_cost import MIN_TIMED_STEPS, OnlineStepCost
from pipeline.errors import ConfigError
from pipeline.knapspec.batch_latency import corrected_table
from pipeline.knapspec.knapsack import DEFAULT_THRESHOLD
from pipeline.knapspec.latency import LatencyModel
from pipeline.knapspec.tpt import (
    DEFAULT_MARGIN,
    DEFAULT_PRIOR_MEAN,
    DEFAULT_PRIOR_STRENGTH,
    DraftPlan,
    ScoredCandidate,
    choose_plan,
    smoothed_alpha,
)
from pipeline.model import items
from pipeline.model.sublayer_model import SublayerModel

logger = logging.getLogger(__name__)

# The fewest DP cells per row worth a search: the full model's cell is kept first
# (knapsack.advance), so a DP of one branch never finds a draft.
MIN_SEARCH_BRANCHES = 2


@dataclass(frozen=True)
class KnapSpecConfig:
    # r and the branch cap bound the DP's cost: on 2 CPU cores one search at 2k context
    # took 0.32 s with (16, 8), 0.21 s with (12, 4) — several decode steps' worth.
    num_reference_tokens: int = 12  # r
    reoptimize_every: int = 64  # verification steps between DP runs
    max_draft: int = 10  # D: γ is searched in 1..D
    threshold: float = DEFAULT_THRESHOLD  # τ of the DP
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD
    margin: float = DEFAULT_MARGIN  # how much speculation must beat AR by
    max_branches: int | None = 4  # DP cells kept per row (at least MIN_SEARCH_BRANCHES)
    # The DP's share of the decode time it plans for (the steps until the next search, or to
    # the end of the request), less what earlier searches took and decoding has not yet paid
    # back (SearchHistory.search_debt): fewer branches when that budget is tight, no search
    # when not even two fit. None: unbounded.
    max_search_share: float | None = 0.05
    # And at most this share of the most a perfect draft could save in that time (the optimistic
    # bound's gain over AR): where even a perfect draft would gain little, as at batch 1 on a CPU
    # whose drafts cost most of a forward, a search cannot pay for itself. None: no such bound.
    max_search_share_of_gain: float | None = 0.5
    weight_cap: int = 5
    coupled: bool = False  # skip a layer's attention and MLP together (the paper's ablation)
    prior_mean: float = DEFAULT_PRIOR_MEAN
    prior_strength: float = DEFAULT_PRIOR_STRENGTH

    def __post_init__(self) -> None:
        if self.num_reference_tokens < 2:
            raise ConfigError("num_reference_tokens must be >= 2")
        if self.reoptimize_every < 1 or self.max_draft < 1:
            raise ConfigError("reoptimize_every and max_draft must be >= 1")
        if self.max_branches is not None and self.max_branches < MIN_SEARCH_BRANCHES:
            raise ConfigError(
                f"max_branches must be >= {MIN_SEARCH_BRANCHES} or None, got {self.max_branches}: a DP that keeps "
                "one cell per row keeps only the full model's and finds no draft"
            )
        if self.max_search_share is not None and not 0 < self.max_search_share <= 1:
            raise ConfigError(f"max_search_share must be in (0, 1] or None, got {self.max_search_share}")
        if self.max_search_share_of_gain is not None and not 0 < self.max_search_share_of_gain <= 1:
            raise ConfigError(
                f"max_search_share_of_gain must be in (0, 1] or None, got {self.max_search_share_of_gain}"
            )


# Decode steps whose tokens a SearchHistory remembers: a few requests' worth.
STEP_TOKENS_KEPT = 256


class SearchHistory:
    """Verdicts of the searches of one engine's requests, oldest first.

    Shared by the drafters of successive requests on the same model and device: where
    searches keep choosing plain decoding, a new request starts with that verdict and
    searches again only after the backed-off interval, instead of paying a search
    before its first token.
    """

    def __init__(self, max_len: int = 64) -> None:
        self.verdicts: deque[tuple[tuple[int, ...], bool]] = deque(maxlen=max_len)  # (item weights, chose AR)
        self.search_cost_ratios: deque[float] = deque(maxlen=16)  # measured / estimated search seconds
        # Tokens each recent decode step emitted (its accepted draft and its own token): a search's
        # budget is a share of the decode time left, and a request whose drafts are accepted
        # (copied ones above all) decodes its tokens in fewer steps than it has tokens left.
        self.step_tokens: deque[int] = deque(maxlen=STEP_TOKENS_KEPT)
        # Search seconds that decoding has not yet paid back at the searches' share of it: a
        # search's budget is its share of the decode ahead less this debt, so searches in quick
        # succession (new integer weights a few steps after the last) cannot together take more
        # than their share of the decode.
        self.search_debt = 0.0
        self._repay_share = 0.0

    def searched(self, seconds: float, share: float | None) -> None:
        """A search took `seconds` under a budget of `share` of the decode it planned for
        (search_budget over one second; None: unbounded, and nothing to pay back)."""
        if share is not None and share > 0:
            self.search_debt += seconds
            self._repay_share = share

    def decoded(self, plain_seconds: float) -> None:
        """A decode step went by, as long as `plain_seconds` of plain decoding: it pays back its
        share of the debt."""
        if self.search_debt:
            self.search_debt = max(0.0, self.search_debt - self._repay_share * plain_seconds)

    def search_cost_scale(self) -> float:
        """How much dearer than estimated this engine's searches have been (median; 1.0 before any)."""
        return statistics.median(self.search_cost_ratios) if self.search_cost_ratios else 1.0

    def tokens_per_step(self) -> float:
        """Mean tokens per decode step of this engine's recent requests (1.0 before any)."""
        tokens = list(self.step_tokens)  # one copy: a pipelined replica's lanes append from their threads
        return statistics.fmean(tokens) if tokens else 1.0

    def record(self, weights: tuple[int, ...], chose_ar: bool) -> None:
        self.verdicts.append((weights, chose_ar))

    def consecutive_ar(self, weights: tuple[int, ...]) -> int:
        """AR verdicts since the last speculative one, among searches with these weights."""
        count = 0
        for seen, chose_ar in reversed(self.verdicts):
            if seen != weights:
                continue
            if not chose_ar:
                break
            count += 1
        return count


class ReplanningDrafter:
    """Drafts with a layer-skip plan that it recomputes every `reoptimize_every` steps
    (and whenever the context has grown enough to change the integer item weights).

    Subclasses decide the plan; this class times the search, keeps the acceptance
    observed under the current plan, and drafts with the plan's skip set and γ.
    """

    def __init__(
        self,
        latency: LatencyModel,
        config: KnapSpecConfig,
        history: SearchHistory | None = None,
        batch_planner: BatchPlanning | None = None,
    ) -> None:
        """`batch_planner`: who plans this drafter's drafts with the other requests of a batch
        that share it (knapspec/batch_plan.py); None: it plans for itself alone."""
        self.table = latency  # the device's, as given
        self.latency = latency  # what plans are made from: the table, or the table as timed steps corrected it
        self.config = config
        self.history = history if history is not None else SearchHistory()
        self.max_draft = config.max_draft
        self._timed: OnlineStepCost | None = None  # the step-cost fit of the steps this request runs in
        self.plan: DraftPlan | None = None
        self._weights: tuple[int, ...] | None = None
        self._steps_since_plan = 0
        self._accepted = self._drafted = 0  # under the current plan
        self._drafter: LayerSkipDrafter | None = None
        # Reported in GenerationResult.extra.
        self.optimize_s = 0.0
        self.plans: list[DraftPlan] = []
        self.num_postponed = 0  # checks that found no time for a search
        # The batch planner's searches this request took part in (the same record for every
        # member: `id` tells them apart), and its checks that found no time for one.
        self.batch_searches: list[dict] = []
        self.batch_postponed = 0
        # While the batch planner plans for this request with the others, this drafter drafts
        # with the batch's plan and does not search.
        self.batch_planner = batch_planner
        self._adopted = False

    @property
    def layer_drafter(self) -> ReplanningDrafter:
        """The drafter that holds the request's layer plan (a batch planner's to set): itself."""
        return self

    def propose_steps(self, request: DraftRequest) -> DraftSteps:
        """Re-plan when due (the search runs here, for this request alone), then draft with the
        plan's sub-network, step by step."""
        context = request.cache.length
        self.count_step(context)
        if self._adopted:
            pass  # the batch's plan
        elif self._due(context):
            self._take_timed_table()
            if self.plan is None and self.history.consecutive_ar(self._weights_at(context)):
                # Earlier requests' searches found nothing at this context: start plainly.
                plan = choose_plan([], lambda k: self.latency.t_verify(k, context), self.config.max_draft)
                self._set_plan(plan, request.model, context, searched=False)
            elif context > self.config.num_reference_tokens:
                self._replan(request, context)
        if self._drafter is None:
            return Draft([])
        return (yield from self._drafter.propose_steps(request))

    def _replan(self, request: DraftRequest, context: int) -> None:
        t0 = time.perf_counter()
        plan = self.make_plan(request)
        if plan is None:
            # No search fits the time budget: decode plainly until the next check.
            plan = choose_plan([], lambda k: self.latency.t_verify(k, context), self.config.max_draft)
            self._set_plan(plan, request.model, context, searched=False)
            self.num_postponed += 1
        else:
            self._set_plan(plan, request.model, context)
        self.optimize_s += time.perf_counter() - t0

    def follow(self, timed: OnlineStepCost | None) -> None:
        """Plan from `timed` (the fit of the steps this request runs in: decoding/step_cost.py)
        from the next plan on. A stored table can be far off on this machine today (measured while
        it was busy, or corrected by a job that shared its cores); the fit is not, after a few steps."""
        self._timed = timed

    def _take_timed_table(self) -> None:
        # Only when a plan is due: a table changed between plans would change the integer weights
        # and so call for a search of its own.
        timed = self._timed
        if timed is not None and timed.num_steps >= MIN_TIMED_STEPS and isinstance(self.table, LatencyModel):
            self.latency = corrected_table(self.table, timed.current())

    def count_step(self, context: int) -> None:
        """A decode step of this request at `context`: alone, it pays back its share of the
        engine's search debt (inside a batch plan, the batch's planner counts the batch's steps)."""
        if not self._adopted:
            self.history.decoded(self.latency.t_verify(1, context))

    def adopt(self, plan: DraftPlan, model: SublayerModel, context: int, searched: bool) -> None:
        """Draft with a batch's plan from now on (`searched`: a batch search just made it)."""
        self._adopted = True
        if searched or plan is not self.plan:
            self._set_plan(plan, model, context, searched=False)
            if searched:
                self.plans.append(plan)

    def release(self) -> None:
        """No batch plans for this request any more: it plans alone again, from its next step."""
        if self._adopted:
            self._adopted = False
            self.plan, self._drafter = None, None

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.history.step_tokens.append(num_accepted + 1)
        self._steps_since_plan += 1
        self._drafted += num_drafted
        self._accepted += num_accepted

    def summary(self) -> dict:
        plans = [p for p in self.plans if not p.use_ar]
        return {
            "optimize_s": self.optimize_s,
            "num_optimizations": len(self.plans),
            "num_chose_ar": len(self.plans) - len(plans),
            "num_searches_postponed": self.num_postponed,
            "predicted_tpt": self.plan.predicted_tpt if self.plan else None,
            "mean_skipped_attn": _mean([items.count_kinds(p.skip)[0] for p in plans]),
            "mean_skipped_mlp": _mean([items.count_kinds(p.skip)[1] for p in plans]),
            "batch_searches": list(self.batch_searches),
            "num_batch_searches_postponed": self.batch_postponed,
        }

    def score(self, skip: frozenset[int], top1: torch.Tensor, full_top1: torch.Tensor, context: int) -> ScoredCandidate:
        """α from top-1 agreement on the reference tokens and what decoding accepted."""
        matches = int((top1 == full_top1).sum())
        accepted, drafted = self.observed(skip)
        alpha = smoothed_alpha(
            matches, top1.numel(), accepted, drafted, self.config.prior_mean, self.config.prior_strength
        )
        return ScoredCandidate(skip, alpha, self.latency.t_draft(skip, context))

    def make_plan(self, request: DraftRequest) -> DraftPlan | None:
        """The plan from here on, or None when there is no time to search now."""
        raise NotImplementedError

    def _interval(self) -> int:
        return search_interval(self.config, self.history, self._weights)

    def _weights_at(self, context: int) -> tuple[int, ...]:
        return tuple(self.latency.item_weights(context, self.config.weight_cap))

    def observed(self, skip: frozenset[int]) -> tuple[int, int]:
        """(accepted, drafted) seen so far under the current plan, if it drafts with `skip`."""
        if self.plan is not None and self.plan.skip == skip:
            return self._accepted, self._drafted
        return 0, 0

    def reference(self, request: DraftRequest) -> tuple[torch.Tensor, int]:
        """The last r committed tokens [r] and the position they start at."""
        context = request.cache.length
        prefix = context - self.config.num_reference_tokens
        return torch.tensor(request.token_ids[prefix:context], device=request.model.device), prefix

    def _due(self, context: int) -> bool:
        if self.plan is None or self._steps_since_plan >= self._interval():
            return True
        # A longer context makes attention dearer; new integer weights mean a new knapsack.
        return self._weights_at(context) != self._weights

    def _set_plan(self, plan: DraftPlan, model: SublayerModel, context: int, searched: bool = True) -> None:
        self.plan = plan
        self._weights = self._weights_at(context)
        if searched:
            self.plans.append(plan)
            self.history.record(self._weights, plan.use_ar)
        self._steps_since_plan = 0
        self._accepted = self._drafted = 0
        self._drafter = (
            None
            if plan.use_ar
            else LayerSkipDrafter(plan.skip, model.spec.num_items, plan.gamma, self.config.confidence_threshold)
        )
        logger.debug(
            "context %d: %s, predicted %.1f tok/s vs AR %.1f",
            context,
            "AR" if plan.use_ar else f"skip {sorted(plan.skip)} γ={plan.gamma} α={plan.alpha:.2f}",
            plan.predicted_tpt,
            plan.ar_tpt,
        )


def search_interval(config: KnapSpecConfig, history: SearchHistory, weights: tuple[int, ...] | None) -> int:
    """Steps until the next search. After consecutive AR verdicts at these weights the re-check
    backs off (doubling, up to 8x): a search that keeps finding nothing should not keep costing."""
    num_ar = history.consecutive_ar(weights) if weights is not None else 0
    return config.reoptimize_every * 2 ** min(max(num_ar - 1, 0), 3)


def steps_planned_for(interval: int, tokens_left: int, tokens_per_step: float) -> float:
    """The decode steps a search plans for: until the next search, or until the tokens left run
    out at the engine's recent tokens per step (accepted and copied drafts shorten a decode)."""
    return min(float(interval), max(tokens_left / tokens_per_step, 1.0))


def branches_within(budget: float, most: int, seconds: Callable[[int], float]) -> int:
    """The most branches, up to `most`, whose search `seconds(branches)` fits the budget; 0 when
    not even MIN_SEARCH_BRANCHES do (fewer would search and never find a draft)."""
    return next((b for b in range(most, MIN_SEARCH_BRANCHES - 1, -1) if seconds(b) <= budget), 0)


def search_budget(config: KnapSpecConfig, plain_seconds: float, bound_gain: float | None) -> float | None:
    """Seconds a search may take when it plans for `plain_seconds` of plain decoding: its share of
    that time, and its share of the most a perfect draft could save there (`bound_gain`: the
    optimistic bound's tokens/s over AR's; None: not known). None: unbounded."""
    budgets = []
    if config.max_search_share is not None:
        budgets.append(config.max_search_share * plain_seconds)
    if config.max_search_share_of_gain is not None and bound_gain is not None:
        budgets.append(config.max_search_share_of_gain * plain_seconds * max(1.0 - 1.0 / bound_gain, 0.0))
    return min(budgets) if budgets else None


def top1_tokens(model: SublayerModel, hidden: torch.Tensor) -> torch.Tensor:
    """The full model's top-1 token after each of B branches' residual streams [B, r, d] -> [B, r]."""
    num_branches, num_tokens, d = hidden.shape
    return model.logits(hidden.reshape(-1, d)).argmax(-1).view(num_branches, num_tokens)


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0
