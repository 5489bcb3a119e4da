"""The knapsack DP: brute-force optimality where the objective decomposes, weights,
budgets, pruning, and the batched branch runner it drives on a real model."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.knapspec.knapsack import Frontier, KnapsackProblem, advance, default_always_execute, run_dp
from pipeline.knapspec.replanning import KnapSpecConfig, branches_within
from tests.builders import brute_force, load_tiny, random_knapsack


def orthogonal_items(magnitudes):
    """Item i adds m_i along its own axis; the embeddings sit on axis 0.

    The cosine to the full model after item i is then sqrt(c² + kept value) / |full_i|
    with value m_i², increasing in the value kept so far: the DP's per-cell choice is
    exactly the knapsack's optimal substructure, and its candidates must equal brute force.
    """
    num_items = len(magnitudes)
    calls = []

    def run_item(item, hidden):
        calls.append(hidden.shape[0])
        step = torch.zeros(num_items + 1)
        step[item + 1] = magnitudes[item]
        return hidden + step

    start = torch.zeros(3, num_items + 1)  # r = 3 identical reference tokens
    start[:, 0] = 1.0
    return start, run_item, calls


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_on_additive_items(seed):
    num_items = 8
    magnitudes, weights = random_knapsack(seed, num_items)
    budget = sum(weights) // 2
    always = frozenset({0, num_items - 1}) if seed % 2 else frozenset()
    problem = KnapsackProblem(weights=weights, budget=budget, threshold=-1.0, always_execute=always)
    start, run_item, calls = orthogonal_items(magnitudes)

    frontier = run_dp(start, problem, run_item)
    values = [m * m for m in magnitudes]
    expected = brute_force(values, weights, budget, always)
    got = {c.skipped_weight: sum(values) - sum(values[i] for i in c.skip) for c in frontier.candidates()}
    assert set(got) == set(expected)
    for weight, kept in expected.items():
        assert got[weight] == pytest.approx(kept, rel=1e-5)
    for c in frontier.candidates():
        assert c.skipped_weight == sum(weights[i] for i in c.skip) <= budget
        assert not c.skip & always
    # One batched call per item, over every live cell of its row.
    assert len(calls) == num_items
    assert frontier.num_branch_rows == sum(calls)


def test_threshold_prunes_and_degrades_to_no_skip():
    magnitudes = [1.0] * 6
    start, run_item, _ = orthogonal_items(magnitudes)
    problem = KnapsackProblem(weights=(1,) * 6, budget=3, threshold=0.999)
    candidates = run_dp(start, problem, run_item).candidates()
    assert [(c.skipped_weight, c.skip) for c in candidates] == [(0, frozenset())]
    assert candidates[0].score == pytest.approx(1.0)

    loose = run_dp(start, KnapsackProblem(weights=(1,) * 6, budget=3, threshold=0.8), run_item).candidates()
    assert all(c.score >= 0.8 for c in loose)
    unpruned = run_dp(start, KnapsackProblem(weights=(1,) * 6, budget=3, threshold=-1), run_item).candidates()
    assert len(loose) < len(unpruned) == 4


def test_branch_cap_keeps_the_full_model_and_the_best_cells():
    start, run_item, calls = orthogonal_items([1.0, 0.2, 0.3, 0.1, 2.0, 0.5])
    problem = KnapsackProblem(weights=(1,) * 6, budget=5, threshold=-1, max_branches=2)
    frontier = run_dp(start, problem, run_item)
    assert max(calls) <= 2 and len(frontier.weights) <= 2
    assert 0 in frontier.weights


def test_a_dp_of_one_branch_finds_no_draft_so_a_search_keeps_two():
    """The full model's cell is kept first: one branch per row is the full model alone, a search
    that costs a forward over its reference tokens and can never draft."""
    start, run_item, _ = orthogonal_items([1.0, 0.2, 0.3, 0.1, 2.0, 0.5])
    frontier = run_dp(start, KnapsackProblem(weights=(1,) * 6, budget=5, threshold=-1, max_branches=1), run_item)
    assert [c.skip for c in frontier.candidates()] == [frozenset()]
    assert branches_within(budget=1.0, most=4, seconds=lambda b: 0.4 * b) == 2
    assert branches_within(budget=0.5, most=4, seconds=lambda b: 0.4 * b) == 0  # one would fit: not worth it
    with pytest.raises(ConfigError, match="max_branches"):
        KnapSpecConfig(max_branches=1)


def test_skipping_a_whole_bypass_group_saves_its_hop_too():
    """Items 1..3 form a middle pipeline stage whose bypass saves weight 5: the cell that skips
    all three is labelled with their weights plus the hop's, and only that cell."""
    start, run_item, _ = orthogonal_items([1.0, 0.01, 0.01, 0.01, 1.0, 1.0])
    problem = KnapsackProblem(weights=(1,) * 6, budget=3, threshold=-1, bypass=((1, 4, 5),))
    candidates = run_dp(start, problem, run_item).candidates()
    for c in candidates:
        bonus = 5 if {1, 2, 3} <= c.skip else 0
        assert c.skipped_weight == sum(problem.weights[i] for i in c.skip) + bonus
    bypassed = [c for c in candidates if c.skip == frozenset({1, 2, 3})]
    assert [c.skipped_weight for c in bypassed] == [8]
    # Without the group, the same skip set is an ordinary weight-3 candidate.
    plain = run_dp(start, KnapsackProblem(weights=(1,) * 6, budget=3, threshold=-1), run_item).candidates()
    assert any(c.skip == frozenset({1, 2, 3}) and c.skipped_weight == 3 for c in plain)
    with pytest.raises(ConfigError):
        KnapsackProblem(weights=(1,) * 6, budget=3, bypass=((4, 7, 1),))


def test_frontier_can_be_split_across_stages():
    start, run_item, _ = orthogonal_items([1.0, 0.5, 0.7, 0.2, 0.9, 0.4])
    problem = KnapsackProblem(weights=(1, 2, 1, 2, 1, 2), budget=4, threshold=-1)
    whole = run_dp(start, problem, run_item)
    first = run_dp(start, problem, run_item, items=range(0, 3))
    second = run_dp(start, problem, run_item, items=range(3, 6), frontier=first)
    assert whole.candidates() == second.candidates()
    with pytest.raises(ValueError):
        advance(first, 5, problem, run_item)


def test_problem_validation():
    with pytest.raises(ConfigError):
        KnapsackProblem(weights=(1, 0), budget=1)
    with pytest.raises(ConfigError):
        KnapsackProblem(weights=(1, 1), budget=-1)
    assert default_always_execute(30) == {0, 1, 58, 59}


def test_branch_runner_matches_forward_hidden_states(tiny_checkpoint):
    _, model = load_tiny(tiny_checkpoint)
    tokens = torch.randint(3, 96, (60,), generator=torch.Generator().manual_seed(3))
    prefix, num_ref = 48, 12
    cache = model.new_cache(64)
    model.prefill(cache, tokens[:prefix])
    reference = model.forward(cache.copy(), tokens[prefix:], prefix, logits="none", return_hidden=True).hidden_states

    before = cache.keys.clone()
    h = model.embed_tokens(tokens[prefix:])[None]  # [1, r, d]
    other = h + 0.3 * torch.randn_like(h)
    h = torch.cat([h, other])  # a second, different branch must not disturb the first
    for item in range(model.spec.num_items):
        h = model.run_item_branches(item, h, cache, prefix)
        torch.testing.assert_close(h[0], reference[item + 1], atol=1e-4, rtol=0)
    assert torch.equal(cache.keys, before), "the DP must only read the cache"
    assert h.shape == (2, num_ref, model.spec.hidden_size)


def test_dp_on_a_real_model_respects_weights_and_budget(tiny_llama):
    _, model = load_tiny(tiny_llama)
    tokens = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(48)
    model.prefill(cache, tokens[:32])
    num_items = model.spec.num_items
    weights = tuple(2 if i % 2 == 0 else 1 for i in range(num_items))
    problem = KnapsackProblem(
        weights=weights, budget=sum(weights) // 2, threshold=0.5, always_execute=default_always_execute(4)
    )
    frontier = run_dp(
        model.embed_tokens(tokens[32:]),
        problem,
        lambda item, hidden: model.run_item_branches(item, hidden, cache, 32),
    )
    candidates = frontier.candidates()
    assert candidates[0].skip == frozenset() and candidates[0].score == pytest.approx(1.0, abs=1e-5)
    for c in candidates:
        assert c.skipped_weight == sum(weights[i] for i in c.skip) <= problem.budget
        assert c.score >= 0.5 and not c.skip & problem.always_execute
    assert len(candidates) > 1
    assert isinstance(Frontier.start(torch.zeros(2, 3)).hidden, torch.Tensor)
