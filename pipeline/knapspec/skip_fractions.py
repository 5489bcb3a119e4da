"""Skip sets by size and kind, their acceptance, and what they would gain on another model.

A GPU check times a large model whose weights are random: its step times are real, its
drafts' acceptance is not (random weights agree with nothing). What a draft that skips a
fraction of the attention items, or of the MLP items, keeps of the full model's greedy
choices is measured instead on a real model (SmolLM2 on CPU, jobs/acceptance.py): for each
size and kind, the knapsack DP on unit weights picks the skip set with the best hidden-state
cosine, and decoding with it measures α. `project` then puts that α beside the large model's
measured draft, verify and plain-decoding steps: KnapSpec's predicted speed-up there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pipeline.knapspec.knapsack import DEFAULT_THRESHOLD, KnapsackProblem, default_always_execute, run_knapsack
from pipeline.knapspec.tpt import expected_tokens
from pipeline.model import items

KINDS = ("attention", "mlp", "both")


def skippable(num_layers: int, kind: str) -> frozenset[int]:
    """The items a draft of `kind` may skip: those of its kind outside the first and last
    layers (KnapSpec keeps those), or every such item for "both"."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    keep = default_always_execute(num_layers)
    return frozenset(
        item
        for item in range(items.num_items(num_layers))
        if item not in keep and (kind == "both" or items.is_attention(item) == (kind == "attention"))
    )


def best_skip_sets(
    model,
    cache,
    reference_ids: torch.Tensor,
    prefix: int,
    kind: str,
    max_count: int,
    threshold: float = DEFAULT_THRESHOLD,
) -> dict[int, frozenset[int]]:
    """Per number of skipped items (1..max_count): the skip set of `kind` whose hidden states
    after the last item stay closest (mean cosine) to the full model's on the reference tokens
    at [prefix, prefix + r) — the DP on unit weights. Sizes whose best set falls below
    `threshold` are missing."""
    num_layers = model.spec.num_layers
    allowed = skippable(num_layers, kind)
    problem = KnapsackProblem(
        weights=(1,) * items.num_items(num_layers),
        budget=min(max_count, len(allowed)),
        threshold=threshold,
        always_execute=frozenset(range(items.num_items(num_layers))) - allowed,
    )
    frontier = run_knapsack(model, cache, reference_ids, problem, prefix)
    return {weight: skip for weight, skip in zip(frontier.weights, frontier.skips) if weight > 0}


def alpha_from_tokens(tokens_per_step: float, gamma: int) -> float:
    """The per-token acceptance α that makes `expected_tokens(α, γ)` equal a measured mean of
    tokens per verification (accepted drafts plus the model's own token), by bisection."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if tokens_per_step <= 1.0:
        return 0.0
    if tokens_per_step >= gamma + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(mid, gamma) < tokens_per_step else (low, mid)
    return (low + high) / 2


def spread_skip(num_layers: int, attention: int, mlp: int) -> frozenset[int]:
    """`attention` attention items and `mlp` MLP items spread evenly over the middle layers:
    a skip set of those counts on a model whose items' values are unknown (random weights),
    where only the counts decide what a step costs."""
    middle = list(range(1, num_layers - 1))
    for count in (attention, mlp):
        if not 0 <= count <= len(middle):
            raise ValueError(f"a {num_layers}-layer model has {len(middle)} middle layers, asked to skip {count}")

    def spaced(count: int) -> list[int]:
        return [middle[(2 * k + 1) * len(middle) // (2 * count)] for k in range(count)]

    attention_items = {items.layer_items(layer)[0] for layer in spaced(attention)}
    mlp_items = {items.layer_items(layer)[1] for layer in spaced(mlp)}
    return frozenset(attention_items | mlp_items)


@dataclass(frozen=True)
class Projection:
    speedup: float  # tokens per second drafting with the best γ, over plain decoding's
    gamma: int  # the best γ; 0 when no γ beats plain decoding (then speedup is 1)


def project(alpha: float, t_ar: float, t_draft: float, t_verify: Mapping[int, float]) -> Projection:
    """KnapSpec's predicted speed-up for a draft of acceptance `alpha` on a model whose plain
    step costs `t_ar`, draft step `t_draft` and verify of k rows `t_verify[k]` (measured at
    the same batch and context): the best γ among the verify widths measured, or AR."""
    best = Projection(1.0, 0)
    for k, seconds in sorted(t_verify.items()):
        gamma = k - 1
        if gamma < 1:
            continue
        speedup = expected_tokens(alpha, gamma) * t_ar / (gamma * t_draft + seconds)
        if speedup > best.speedup:
            best = Projection(speedup, gamma)
    return best


def fractions(skip: Sequence[int] | frozenset[int], num_layers: int) -> tuple[float, float]:
    """The shares of all attention items and of all MLP items that `skip` skips."""
    attention, mlp = items.count_kinds(set(skip))
    return attention / num_layers, mlp / num_layers
