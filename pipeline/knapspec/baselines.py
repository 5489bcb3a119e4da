"""Self-speculative baselines in the same engine, so that comparisons are fair.

- CLaSp: a layer-granular cosine DP, blind to latency, skipping a fixed number of
  layers; it always speculates.
- SWIFT: a skip set searched on the fly during the first decoding steps (random
  candidates of a fixed skip ratio scored on the reference tokens, the best kept),
  then frozen.
- Early exit (LayerSkip / DEL style): draft with the first k layers and the LM head;
  DEL's dynamic rule picks k (and γ) by the tokens-per-time each exit depth predicts.
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from pipeline.decoding.drafters import DraftRequest
from pipeline.knapspec.knapsack import KnapsackProblem, branch_runner, default_always_execute, run_knapsack
from pipeline.knapspec.latency import LatencyModel
from pipeline.knapspec.replanning import KnapSpecConfig, ReplanningDrafter, top1_tokens
from pipeline.knapspec.tpt import DraftPlan, choose_plan, tokens_per_time
from pipeline.model import items
from pipeline.model.sublayer_model import SublayerModel

DEFAULT_CLASP_SKIP_FRACTION = 0.4
DEFAULT_SWIFT_SKIP_FRACTION = 0.45
DEFAULT_SWIFT_CANDIDATES = 8  # scored per search round
DEFAULT_SWIFT_ROUNDS = 4  # search rounds before the skip set is frozen
# SWIFT searches at the start of decoding: rounds come faster than KnapSpec's re-optimizations.
DEFAULT_SWIFT_INTERVAL = 8
DEFAULT_EXIT_DEPTHS = (0.25, 1 / 3, 0.5, 2 / 3, 0.75)


class ClaspDrafter(ReplanningDrafter):
    """CLaSp: layers of weight 1 (latency-blind), a fixed number of them skipped."""

    def __init__(
        self, latency: LatencyModel, config: KnapSpecConfig, skip_fraction: float = DEFAULT_CLASP_SKIP_FRACTION
    ) -> None:
        super().__init__(latency, config)
        self.num_skip_layers = max(1, round(skip_fraction * latency.num_layers))

    def make_plan(self, request: DraftRequest) -> DraftPlan:
        model, cache, context = request.model, request.cache, request.cache.length
        ref_ids, prefix = self.reference(request)
        num_layers = model.spec.num_layers
        problem = KnapsackProblem(
            weights=(1,) * num_layers,
            budget=self.num_skip_layers,
            threshold=self.config.threshold,
            always_execute=frozenset({0, num_layers - 1}),
            max_branches=self.config.max_branches,
        )
        frontier = run_knapsack(model, cache, ref_ids, problem, prefix, layer_rows=True)
        top1 = top1_tokens(model, frontier.hidden)
        full = top1[frontier.weights.index(0)]
        # The deepest budget the DP reached: CLaSp skips as many layers as it is told to.
        b = max(range(len(frontier.weights)), key=frontier.weights.__getitem__)
        skip = items.items_of_layers(frontier.skips[b])
        scored = self.score(skip, top1[b], full, context)
        return _always_speculate(scored.skip, scored.alpha, scored.t_draft, self, context)


class SwiftDrafter(ReplanningDrafter):
    """SWIFT: sample skip sets, keep the best by acceptance, freeze after a few rounds."""

    def __init__(
        self,
        latency: LatencyModel,
        config: KnapSpecConfig,
        skip_fraction: float = DEFAULT_SWIFT_SKIP_FRACTION,
        num_candidates: int = DEFAULT_SWIFT_CANDIDATES,
        num_rounds: int = DEFAULT_SWIFT_ROUNDS,
        seed: int = 0,
    ) -> None:
        super().__init__(latency, _with_interval(config, DEFAULT_SWIFT_INTERVAL))
        self.skip_fraction = skip_fraction
        self.num_candidates = num_candidates
        self.num_rounds = num_rounds
        self.rng = random.Random(seed)
        self.best: tuple[float, frozenset[int]] | None = None

    def _due(self, context: int) -> bool:
        if len(self.plans) >= self.num_rounds:
            return False  # frozen
        return self.plan is None or self._steps_since_plan >= self.config.reoptimize_every

    def make_plan(self, request: DraftRequest) -> DraftPlan:
        model, context = request.model, request.cache.length
        ref_ids, prefix = self.reference(request)
        skippable = sorted(set(range(model.spec.num_items)) - default_always_execute(model.spec.num_layers))
        num_skip = round(self.skip_fraction * len(skippable))
        candidates = [frozenset(self.rng.sample(skippable, num_skip)) for _ in range(self.num_candidates)]
        if self.best is not None:
            candidates.append(self.best[1])  # the incumbent is re-scored with what decoding saw
        top1 = evaluate_skip_sets(model, request.cache, ref_ids, prefix, [frozenset(), *candidates])
        for skip, tokens in zip(candidates, top1[1:]):
            scored = self.score(skip, tokens, top1[0], context)
            if self.best is None or scored.alpha > self.best[0]:
                self.best = (scored.alpha, skip)
        alpha, skip = self.best
        return _always_speculate(skip, alpha, self.latency.t_draft(skip, context), self, context)


class EarlyExitDrafter(ReplanningDrafter):
    """Draft with the first k layers and the LM head; k and γ chosen by predicted TPT."""

    def __init__(self, latency: LatencyModel, config: KnapSpecConfig, depths=DEFAULT_EXIT_DEPTHS) -> None:
        super().__init__(latency, config)
        self.depths = depths

    def make_plan(self, request: DraftRequest) -> DraftPlan:
        model, cache, context = request.model, request.cache, request.cache.length
        ref_ids, prefix = self.reference(request)
        num_layers = model.spec.num_layers
        exits = sorted({min(num_layers - 1, max(1, round(f * num_layers))) for f in self.depths})
        h = model.embed_tokens(ref_ids)[None]
        hidden_at_exit = {}
        run_layer = branch_runner(lambda item, h: model.run_item_branches(item, h, cache, prefix), layer_rows=True)
        for layer in range(num_layers):
            h = run_layer(layer, h)
            if layer + 1 in exits:
                hidden_at_exit[layer + 1] = h[0]
        full = top1_tokens(model, h)[0]
        scored = []
        for depth, hidden in hidden_at_exit.items():
            skip = frozenset(items.item_range(depth, num_layers))
            scored.append(self.score(skip, top1_tokens(model, hidden[None])[0], full, context))
        # DEL always speculates: the best exit by TPT, with no fallback to AR.
        return choose_plan(scored, lambda k: self.latency.t_verify(k, context), self.config.max_draft, margin=-1.0)


def evaluate_skip_sets(
    model: SublayerModel, cache, ref_ids: torch.Tensor, prefix: int, skips: list[frozenset[int]]
) -> torch.Tensor:
    """Top-1 tokens [B, r] of each skip set on the reference tokens, in one batched pass."""
    h = model.embed_tokens(ref_ids)[None].expand(len(skips), -1, -1).contiguous()  # [B, r, d]
    for item in range(model.spec.num_items):
        skipped = torch.tensor([item in skip for skip in skips], device=h.device)
        if bool(skipped.all()):
            continue
        executed = model.run_item_branches(item, h, cache, prefix)
        h = torch.where(skipped[:, None, None], h, executed)
    return top1_tokens(model, h)


def _always_speculate(
    skip: frozenset[int], alpha: float, t_draft: float, drafter: ReplanningDrafter, context: int
) -> DraftPlan:
    """A latency-blind plan: γ = max_draft, whatever TPT predicts (reported for comparison).
    Only an empty skip set (everything pruned) decodes plainly: drafting with the full model is waste."""
    gamma = drafter.config.max_draft
    t_verify = drafter.latency.t_verify
    if not skip:
        return DraftPlan(None, 0, 1.0, 1.0 / t_verify(1, context), 1.0 / t_verify(1, context))
    return DraftPlan(
        skip=skip,
        gamma=gamma,
        alpha=alpha,
        predicted_tpt=tokens_per_time(alpha, gamma, t_draft, t_verify(gamma + 1, context)),
        ar_tpt=1.0 / t_verify(1, context),
    )


def _with_interval(config: KnapSpecConfig, interval: int) -> KnapSpecConfig:
    return replace(config, reoptimize_every=min(config.reoptimize_every, interval))
