"""TPT arithmetic, α smoothing and the AR fallback."""

from __future__ import annotations

import pytest

from pipeline.knapspec.tpt import ScoredCandidate, choose_plan, expected_tokens, smoothed_alpha, tokens_per_time


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_tokens_per_time():
    # 1.75 tokens for 2 drafts of 10 ms and a verify of 30 ms.
    assert tokens_per_time(0.5, 2, 0.010, 0.030) == pytest.approx(1.75 / 0.050)


def test_smoothed_alpha_is_pulled_toward_the_prior():
    assert smoothed_alpha(16, 16, prior_mean=0.5, prior_strength=8) == pytest.approx(20 / 24)
    assert smoothed_alpha(0, 0, prior_mean=0.6) == pytest.approx(0.6)
    # Observed acceptance outweighs a few reference tokens.
    assert smoothed_alpha(16, 16, num_accepted=10, num_drafted=100) < 0.5


def flat_verify(t_one):
    return lambda k: t_one


def test_choose_plan_prefers_speculation_when_verification_is_cheap():
    cheap = ScoredCandidate(frozenset({4, 6}), alpha=0.9, t_draft=0.005)
    plan = choose_plan([cheap], flat_verify(0.030), max_draft=10)
    assert not plan.use_ar and plan.skip == cheap.skip
    best = max(range(1, 11), key=lambda g: tokens_per_time(0.9, g, 0.005, 0.030))
    assert plan.gamma == best
    assert plan.predicted_tpt > plan.ar_tpt == pytest.approx(1 / 0.030)


def test_ar_fallback_when_verification_is_dear():
    candidate = ScoredCandidate(frozenset({4, 6}), alpha=0.9, t_draft=0.025)
    # Verifying k tokens costs k times one: nothing can beat plain decoding.
    plan = choose_plan([candidate], lambda k: 0.030 * k, max_draft=10)
    assert plan.use_ar and plan.gamma == 0
    assert plan.predicted_tpt == plan.ar_tpt


def test_ar_fallback_within_margin_and_for_the_full_model():
    full = ScoredCandidate(frozenset(), alpha=1.0, t_draft=0.001)
    assert choose_plan([full], flat_verify(0.030), max_draft=4).use_ar
    # Predicted 3% better than AR: inside a 5% margin.
    marginal = ScoredCandidate(frozenset({2}), alpha=0.03 / 1.03, t_draft=1e-9)
    assert choose_plan([marginal], flat_verify(0.030), max_draft=1, margin=0.05).use_ar
    assert not choose_plan([marginal], flat_verify(0.030), max_draft=1, margin=0.0).use_ar
