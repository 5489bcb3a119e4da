"""The DP's best candidates decoded as fixed draft models, with no AR fallback (--no-fallback):
what the latency model predicted for each, against what it measured."""

from __future__ import annotations

import logging

import torch

from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import LayerSkipDrafter
from pipeline.decoding.loop import DecodeConfig
from pipeline.decoding.sampling import SamplingParams
from pipeline.engine import Engine
from pipeline.knapspec.drafter import KnapSpecDrafter, search_candidates
from pipeline.knapspec.replanning import KnapSpecConfig
from pipeline.knapspec.tpt import choose_plan

logger = logging.getLogger(__name__)


def forced_candidates(
    engine: Engine, prompt: torch.Tensor, prefilled, doc_id: str, max_new_tokens: int, num_forced: int
) -> list[dict]:
    """Decode with the DP's best candidates as fixed draft models, no AR fallback: what
    the latency model predicted for each, against what it measured."""
    model, config = engine.model, KnapSpecConfig()
    context = prefilled.cache.length
    drafter = KnapSpecDrafter(engine.latency, config)
    r = config.num_reference_tokens
    weights = tuple(engine.latency.item_weights(context, config.weight_cap))
    candidates = search_candidates(model, prefilled.cache, prompt[-r:], context - r, weights, config)
    plans = []
    for skip, top1 in candidates[1:]:  # the first is the full model
        scored = drafter.score(skip, top1, candidates[0][1], context)
        plans.append(choose_plan([scored], lambda k: engine.latency.t_verify(k, context), config.max_draft, -1.0))
    plans.sort(key=lambda p: p.predicted_tpt, reverse=True)
    rows = []
    decode_config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=engine.eos_token_ids)
    for plan in plans[:num_forced]:
        fixed = LayerSkipDrafter(plan.skip, model.spec.num_items, plan.gamma)
        result = decode(model, prefilled.copy(), decode_config, SamplingParams(), fixed, prompt.tolist())
        rows.append(
            {
                "doc_id": doc_id,
                "context_tokens": context,
                "skip": sorted(plan.skip),
                "gamma": plan.gamma,
                "alpha": plan.alpha,
                "predicted_tpt": plan.predicted_tpt,
                "predicted_vs_ar": plan.predicted_tpt / plan.ar_tpt,
                "measured_tpt": result.stats.tokens_per_s,
                "acceptance_rate": result.stats.acceptance_rate,
            }
        )
        logger.info(
            "forced %s γ=%d: predicted %.1f, measured %.1f tok/s",
            sorted(plan.skip),
            plan.gamma,
            plan.predicted_tpt,
            result.stats.tokens_per_s,
        )
    return rows
