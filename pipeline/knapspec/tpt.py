"""Choosing the draft model and draft length by predicted tokens per time (TPT).

With per-token acceptance probability α and γ drafted tokens, one verification
emits on average (1 − α^(γ+1)) / (1 − α) tokens and costs γ·t_draft + t_verify(γ+1)
(KnapSpec, Eq. 3). Plain decoding emits one token per t_verify(1). Speculation is a
bet: when no candidate beats plain decoding by a margin, the plan is AR.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_MARGIN = 0.05
# A Beta prior on α: few reference tokens overestimate it (a prototype read α = 1.0 off
# 8-16 tokens and then accepted 0.44-0.77), so estimates are pulled toward the prior mean.
DEFAULT_PRIOR_MEAN = 0.5
DEFAULT_PRIOR_STRENGTH = 8.0


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens emitted per verification of γ drafts accepted independently with probability α."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def tokens_per_time(alpha: float, gamma: int, t_draft: float, t_verify: float) -> float:
    """TPT(S, γ) = E[tokens] / (γ·t_draft(S) + t_verify(γ + 1))."""
    return expected_tokens(alpha, gamma) / (gamma * t_draft + t_verify)


def smoothed_alpha(
    num_matches: int,
    num_reference: int,
    num_accepted: int = 0,
    num_drafted: int = 0,
    prior_mean: float = DEFAULT_PRIOR_MEAN,
    prior_strength: float = DEFAULT_PRIOR_STRENGTH,
) -> float:
    """Posterior mean of α from the DP's reference tokens plus acceptances seen in decoding."""
    successes = num_matches + num_accepted + prior_mean * prior_strength
    return successes / (num_reference + num_drafted + prior_strength)


@dataclass(frozen=True)
class ScoredCandidate:
    skip: frozenset[int]
    alpha: float
    t_draft: float  # seconds per drafted token


@dataclass(frozen=True)
class DraftPlan:
    skip: frozenset[int] | None  # None: decode plainly
    gamma: int
    alpha: float
    predicted_tpt: float  # tokens per second this plan expects
    ar_tpt: float  # tokens per second of plain decoding

    @property
    def use_ar(self) -> bool:
        return self.skip is None


def choose_plan(
    candidates: Sequence[ScoredCandidate],
    t_verify: Callable[[int], float],
    max_draft: int,
    margin: float = DEFAULT_MARGIN,
) -> DraftPlan:
    """The (candidate, γ ∈ 1..max_draft) with the best predicted TPT, or AR unless it wins by `margin`."""
    ar_tpt = 1.0 / t_verify(1)
    best = DraftPlan(skip=None, gamma=0, alpha=0.0, predicted_tpt=ar_tpt, ar_tpt=ar_tpt)
    best_spec: DraftPlan | None = None
    for candidate in candidates:
        if not candidate.skip:
            continue  # drafting with the full model never pays
        for gamma in range(1, max_draft + 1):
            tpt = tokens_per_time(candidate.alpha, gamma, candidate.t_draft, t_verify(gamma + 1))
            if best_spec is None or tpt > best_spec.predicted_tpt:
                best_spec = DraftPlan(candidate.skip, gamma, candidate.alpha, tpt, ar_tpt)
    if best_spec is not None and best_spec.predicted_tpt > ar_tpt * (1.0 + margin):
        return best_spec
    return best
