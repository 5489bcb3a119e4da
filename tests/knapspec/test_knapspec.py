"""KnapSpec and the baselines in the engine: lossless greedy output, AR fallback, re-planning."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import NoDraft
from pipeline.decoding.loop import DecodeConfig, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.knapspec.baselines import ClaspDrafter, EarlyExitDrafter, SwiftDrafter, evaluate_skip_sets
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.knapspec.hybrid import KnapSpecLookupDrafter
from pipeline.knapspec.replanning import KnapSpecConfig, SearchHistory, search_budget, steps_planned_for
from tests.builders import SEARCH_CONFIG, load_tiny, synthetic_latency

# Few reference tokens and a weak prior: tiny models give the DP little to go on. Searches
# every 6 steps could never fit a 5% time budget; these tests are about what they find.




def prompt_ids(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 96, (12,), generator=g)
    return torch.cat([torch.randint(3, 96, (20,), generator=g), phrase, torch.randint(3, 96, (8,), generator=g), phrase])


def run(model, prompt, drafter, max_new=40):
    config = DecodeConfig(max_new_tokens=max_new, eos_token_ids=frozenset())
    return decode(model, prefill(model, prompt, max_new), config, SamplingParams(), drafter, prompt.tolist())


DRAFTERS = {
    "knapspec": lambda lat: KnapSpecDrafter(lat, SEARCH_CONFIG),
    "knapspec-coupled": lambda lat: KnapSpecDrafter(lat, replace(SEARCH_CONFIG, coupled=True)),
    "clasp": lambda lat: ClaspDrafter(lat, SEARCH_CONFIG),
    "swift": lambda lat: SwiftDrafter(lat, SEARCH_CONFIG),
    "early-exit": lambda lat: EarlyExitDrafter(lat, SEARCH_CONFIG),
    "knapspec-lookup": lambda lat: KnapSpecLookupDrafter(lat, SEARCH_CONFIG, PromptLookupDrafter()),
}


def check_equals_ar(model, name: str) -> None:
    cheap_verify = synthetic_latency(model.spec.num_layers, verify_growth=0.0)
    for seed in range(2):
        prompt = prompt_ids(seed)
        reference = run(model, prompt, NoDraft()).token_ids
        result = run(model, prompt, DRAFTERS[name](cheap_verify))
        assert result.token_ids == reference
        assert result.stats.drafted_tokens > 0, "cheap verification must make it speculate"
        assert result.extra["num_optimizations"] >= 1


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_output_equals_ar(tiny_deep_llama, name):
    check_equals_ar(load_tiny(tiny_deep_llama)[1], name)


def test_knapspec_greedy_output_equals_ar_in_every_family(tiny_checkpoint):
    _, model = load_tiny(tiny_checkpoint)
    prompt = prompt_ids(3)
    drafter = KnapSpecDrafter(synthetic_latency(model.spec.num_layers, verify_growth=0.0), SEARCH_CONFIG)
    assert run(model, prompt, drafter).token_ids == run(model, prompt, NoDraft()).token_ids


def test_knapspec_falls_back_to_ar_when_verification_is_dear(tiny_llama):
    _, model = load_tiny(tiny_llama)
    dear_verify = synthetic_latency(model.spec.num_layers, verify_growth=1.0)  # k tokens cost k steps
    drafter = KnapSpecDrafter(dear_verify, SEARCH_CONFIG)
    prompt = prompt_ids(0)
    result = run(model, prompt, drafter)
    assert result.token_ids == run(model, prompt, NoDraft()).token_ids
    assert result.stats.drafted_tokens == 0
    assert result.extra["num_chose_ar"] == result.extra["num_optimizations"] >= 2  # re-checked periodically


def test_dp_is_skipped_when_no_draft_could_win(tiny_deep_llama, monkeypatch):
    from pipeline.knapspec import drafter as knapspec

    calls = []
    real = knapspec.search_candidates
    monkeypatch.setattr(knapspec, "search_candidates", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, model = load_tiny(tiny_deep_llama)
    run(model, prompt_ids(0), KnapSpecDrafter(synthetic_latency(model.spec.num_layers, verify_growth=1.0), SEARCH_CONFIG))
    assert calls == []
    run(model, prompt_ids(0), KnapSpecDrafter(synthetic_latency(model.spec.num_layers, verify_growth=0.0), SEARCH_CONFIG))
    assert calls


def test_ar_verdicts_back_off_the_search(tiny_deep_llama):
    _, model = load_tiny(tiny_deep_llama)
    drafter = KnapSpecDrafter(synthetic_latency(model.spec.num_layers, verify_growth=1.0), replace(SEARCH_CONFIG, reoptimize_every=2))
    run(model, prompt_ids(0), drafter, max_new=40)
    # Intervals 2, 2, 4, 8, 16, 16...: 39 steps hold at most 6 searches, not 20.
    assert 3 <= len(drafter.plans) <= 6 and all(p.use_ar for p in drafter.plans)


def test_knapspec_replans_every_n_steps(tiny_deep_llama):
    _, model = load_tiny(tiny_deep_llama)
    drafter = KnapSpecDrafter(synthetic_latency(model.spec.num_layers, 0.0), replace(SEARCH_CONFIG, max_draft=1))
    result = run(model, prompt_ids(1), drafter, max_new=30)
    # At most one token is accepted per step, so there are >= 15 steps and >= 3 plans.
    assert result.extra["num_optimizations"] >= result.stats.steps // SEARCH_CONFIG.reoptimize_every
    assert all(p.gamma <= 1 for p in drafter.plans)


def test_knapspec_plans_use_weights_and_keep_first_and_last_layer(tiny_deep_llama):
    _, model = load_tiny(tiny_deep_llama)
    lat = synthetic_latency(model.spec.num_layers, 0.0)
    drafter = KnapSpecDrafter(lat, SEARCH_CONFIG)
    run(model, prompt_ids(0), drafter)
    num_items = model.spec.num_items
    assert any(plan.skip for plan in drafter.plans)
    for plan in drafter.plans:
        if plan.skip:
            assert not plan.skip & {0, 1, num_items - 2, num_items - 1}
            weights = lat.item_weights(40)
            assert sum(weights[i] for i in plan.skip) <= sum(weights) // 2


def test_evaluate_skip_sets_matches_full_forward(tiny_llama):
    _, model = load_tiny(tiny_llama)
    tokens = prompt_ids(2)
    cache = model.new_cache(64)
    model.prefill(cache, tokens[:40])
    full = model.forward(cache.copy(), tokens[40:], 40, logits="all").logits.argmax(-1)
    top1 = evaluate_skip_sets(model, cache, tokens[40:], 40, [frozenset(), frozenset({2, 3})])
    assert torch.equal(top1[0], full)
    skipped = model.forward(cache.copy(), tokens[40:], 40, skip={2, 3}, logits="all").logits.argmax(-1)
    assert torch.equal(top1[1], skipped)


def test_hybrid_counts_copied_runs_per_position():
    lat = synthetic_latency(8, verify_growth=0.0)
    hybrid = KnapSpecLookupDrafter(lat, SEARCH_CONFIG, PromptLookupDrafter())
    prior = [hybrid.expected_accepted(g) for g in (1, 2, 3)]
    assert prior == pytest.approx([0.8, 0.8 + 0.64, 0.8 + 0.64 + 0.512])
    hybrid._used_lookup = True
    for _ in range(20):  # copies are right as a whole: all three accepted
        hybrid.observe(3, 3)
    assert hybrid.expected_accepted(3) > 2.5
    for _ in range(40):  # then wrong from the first token
        hybrid.observe(3, 0)
    assert hybrid.expected_accepted(1) < 0.4
    assert hybrid.summary()["num_lookup_steps"] == 60


def test_hybrid_scores_the_copies_it_declines():
    hybrid = KnapSpecLookupDrafter(synthetic_latency(8, verify_growth=0.0), SEARCH_CONFIG, PromptLookupDrafter())
    prompt = [5, 6, 7, 8]
    hybrid._shadows = [(4, [1, 2, 3]), (4, [1, 9, 9]), (5, [2, 3, 4]), (5, [7])]
    hybrid.score_declined(prompt + [1, 2])
    # [1, 9, 9] missed at position 1 and [7] at 0; [1, 2, 3] and [2, 3, 4] are right so far: they wait.
    assert hybrid._tries[:3] == [2, 1, 1] and hybrid._reached[:3] == [1, 0, 0]
    assert hybrid._shadows == [(4, [1, 2, 3]), (5, [2, 3, 4])]
    hybrid.score_declined(prompt + [1, 2, 3, 5])
    assert hybrid._tries[:3] == [4, 3, 3] and hybrid._reached[:3] == [3, 2, 1] and hybrid._shadows == []


def test_hybrid_scores_the_part_of_a_copy_a_batch_cut():
    """A batch may verify only the first tokens of a copy (batch_drafts.py): the rest is scored
    by the tokens emitted next, as a declined copy is, or counted as missed after a miss."""
    hybrid = KnapSpecLookupDrafter(synthetic_latency(8, verify_growth=0.0), SEARCH_CONFIG, PromptLookupDrafter())
    prompt = [5, 6, 7, 8]
    hybrid._used_lookup, hybrid._proposed = True, (4, [1, 2, 3])
    hybrid.observe(1, 1)  # [1] verified and accepted: [2, 3] wait for the tokens after it
    assert hybrid._tries[:3] == [0, 0, 0] and hybrid._shadows == [(4, [1, 2, 3])]
    hybrid.score_declined(prompt + [1, 2, 4])
    assert hybrid._tries[:3] == [1, 1, 1] and hybrid._reached[:3] == [1, 1, 0]
    hybrid._proposed = (7, [4, 4, 4])
    hybrid.observe(2, 0)  # a miss in the verified part: the cut position was not reached either
    assert hybrid._tries[:3] == [2, 2, 2] and hybrid._reached[:3] == [1, 1, 0]
    assert hybrid.summary()["num_lookup_steps"] == 2


def test_hybrid_keeps_learning_after_early_misses(tiny_deep_llama):
    """A hybrid that only learned from copies it drafted would stop copying for good after
    a run of misses; scoring the declined ones lets a copy that starts to pay be taken again."""
    lat = synthetic_latency(8, verify_growth=0.3)
    hybrid = KnapSpecLookupDrafter(lat, SEARCH_CONFIG, PromptLookupDrafter())
    hybrid._tries[:3] = [20, 20, 20]  # twenty misses in a row
    assert (1 + hybrid.expected_accepted(1)) / lat.t_verify(2, 100) < 1 / lat.t_verify(1, 100)  # copying loses
    tokens = list(range(100))
    for start in range(40, 70):  # then thirty declined copies, each right
        hybrid._shadows.append((start, tokens[start : start + 3]))
        hybrid.score_declined(tokens[: start + 3])
    assert (1 + hybrid.expected_accepted(3)) / lat.t_verify(4, 100) > 1.4 / lat.t_verify(1, 100)  # wins again

    # In decoding: exact tokens, and the copies it declines are scored.
    _, model = load_tiny(tiny_deep_llama)
    lat = synthetic_latency(model.spec.num_layers, verify_growth=0.3)
    prompt = prompt_ids(5)
    hybrid = KnapSpecLookupDrafter(lat, SEARCH_CONFIG, PromptLookupDrafter())
    hybrid._tries[:3] = [20, 20, 20]
    result = run(model, prompt, hybrid, max_new=40)
    assert result.token_ids == run(model, prompt, NoDraft(), max_new=40).token_ids
    assert hybrid.num_lookup_steps == 0 and hybrid._tries[0] > 20


def test_later_requests_inherit_ar_verdicts(tiny_deep_llama, monkeypatch):
    from pipeline.knapspec import drafter as knapspec
    from pipeline.knapspec.replanning import SearchHistory

    _, model = load_tiny(tiny_deep_llama)
    lat = replace(synthetic_latency(model.spec.num_layers, verify_growth=0.3), t_fixed=0.05)  # dear fixed cost: AR wins
    calls = []
    real = knapspec.search_candidates
    monkeypatch.setattr(knapspec, "search_candidates", lambda *a, **k: calls.append(1) or real(*a, **k))
    history = SearchHistory()
    prompt = prompt_ids(0)
    first = run(model, prompt, KnapSpecDrafter(lat, SEARCH_CONFIG, history), max_new=5)
    assert first.extra["num_optimizations"] == first.extra["num_chose_ar"] == 1
    calls.clear()
    second = run(model, prompt, KnapSpecDrafter(lat, SEARCH_CONFIG, history), max_new=5)
    assert calls == [] and second.extra["num_optimizations"] == 0
    assert second.token_ids == first.token_ids


def test_search_budget_sets_the_branch_cap():
    """One search costs about (1 + B·r/12) forwards; it may take 5% of the steps it plans for."""
    lat = synthetic_latency(8, verify_growth=0.0)
    bounded = replace(SEARCH_CONFIG, max_search_share=0.05, reoptimize_every=64, max_branches=4)
    drafter = KnapSpecDrafter(lat, bounded)
    # 64 steps: budget 3.2 forwards -> (3.2 - 1)·12/8 = 3.3 -> 3 branches.
    assert drafter.search_branches(context=100, steps_left=500) == 3
    assert drafter.search_branches(context=100, steps_left=48) == 2  # 2.4 forwards
    # 2.0 forwards: one branch would fit, but a DP of one branch keeps only the full model.
    assert drafter.search_branches(context=100, steps_left=40) == 0
    assert KnapSpecDrafter(lat, replace(bounded, max_search_share=0.5)).search_branches(100, 500) == 4  # the cap
    unbounded = replace(bounded, max_search_share=None, max_branches=None)
    assert KnapSpecDrafter(lat, unbounded).search_branches(100, 5) is None
    # A device whose searches cost no more on four branches than on one gets the whole cap.
    flat = replace(lat, search_base=2.0, search_per_token=0.0)
    assert KnapSpecDrafter(flat, bounded).search_branches(context=100, steps_left=500) == 4
    # An engine whose searches ran twice as long as estimated gets half the branches' worth.
    drafter.history.search_cost_ratios.extend([2.0, 2.0])
    assert drafter.search_branches(context=100, steps_left=500) == 0


def test_search_budget_is_the_smaller_of_its_shares():
    """5% of the decode planned for, and half of what a perfect draft could save in it."""
    config = replace(SEARCH_CONFIG, max_search_share=0.05, max_search_share_of_gain=0.5)
    assert search_budget(config, 10.0, bound_gain=None) == pytest.approx(0.5)
    assert search_budget(config, 10.0, bound_gain=2.0) == pytest.approx(0.5)  # could save 5 s: the 5% binds
    assert search_budget(config, 10.0, bound_gain=1.05) == pytest.approx(0.5 * 10.0 * (1 - 1 / 1.05))
    assert search_budget(config, 10.0, bound_gain=0.9) == 0.0  # a bound below AR saves nothing
    assert search_budget(replace(config, max_search_share=None), 10.0, 1.25) == pytest.approx(1.0)
    assert search_budget(replace(config, max_search_share_of_gain=None), 10.0, 1.01) == pytest.approx(0.5)
    assert search_budget(SEARCH_CONFIG, 10.0, 1.01) is None


def test_a_search_debt_is_paid_back_at_the_searches_share_of_decoding():
    history = SearchHistory()
    history.searched(0.3, share=0.05)
    assert history.search_debt == pytest.approx(0.3)
    history.decoded(2.0)  # 5% of 2 s of decoding
    assert history.search_debt == pytest.approx(0.2)
    history.decoded(10.0)
    assert history.search_debt == 0.0
    history.searched(0.3, share=None)  # an unbounded search owes nothing
    assert history.search_debt == 0.0


def test_searches_in_quick_succession_share_one_budget():
    """A search that took its whole budget leaves none for one a few steps later (new integer
    weights): at 4 x 4k two searches of 4.7% each took 9.4% of a decode. Decoding pays it back."""
    lat = synthetic_latency(8, verify_growth=0.0)
    bounded = replace(SEARCH_CONFIG, max_search_share=0.05, reoptimize_every=64, max_branches=4)
    drafter = KnapSpecDrafter(lat, bounded)
    step = lat.t_verify(1, 100)
    assert drafter.search_branches(context=100, steps_left=500) == 3  # 3.2 forwards
    drafter.history.searched(3.0 * step, share=0.05)
    assert drafter.search_branches(context=100, steps_left=500) == 0
    for _ in range(20):  # 20 steps pay back one forward's worth
        drafter.count_step(100)
    assert drafter.search_branches(context=100, steps_left=500) == 0  # 3.2 - 2.0 forwards: too few
    for _ in range(40):
        drafter.count_step(100)
    assert drafter.search_branches(context=100, steps_left=500) == 3


def test_a_request_search_runs_up_a_debt_that_its_decode_pays_back(tiny_deep_llama):
    _, model = load_tiny(tiny_deep_llama)
    lat = synthetic_latency(model.spec.num_layers, verify_growth=0.0)
    drafter = KnapSpecDrafter(lat, replace(SEARCH_CONFIG, max_search_share=0.05, reoptimize_every=1000))
    history = drafter.history
    spent = []
    real = history.searched
    history.searched = lambda seconds, share: spent.append((seconds, share)) or real(seconds, share)
    run(model, prompt_ids(0), drafter, max_new=60)
    assert len(spent) == 1 and spent[0][1] == pytest.approx(0.05)
    assert history.search_debt < spent[0][0]  # the steps after it paid some of it back


def test_a_search_plans_for_the_steps_its_decode_will_take():
    """Until the next search, or until the tokens left run out at the recent tokens per step."""
    assert steps_planned_for(64, 64, 1.0) == 64
    assert steps_planned_for(64, 64, 1.6) == pytest.approx(40)  # copied drafts: fewer steps
    assert steps_planned_for(40, 200, 1.0) == 40
    assert steps_planned_for(64, 0, 1.0) == 1.0


def test_a_search_that_cannot_pay_for_itself_gets_fewer_branches_or_none():
    """Where a perfect draft would gain 5%, half of that over 64 steps is 1.5 forwards: not
    one branch (a search costs about 1 + B·r/12 forwards); at 10%, 2.9 forwards: 2 branches."""
    lat = synthetic_latency(8, verify_growth=0.0)
    bounded = replace(SEARCH_CONFIG, max_search_share=0.05, max_search_share_of_gain=0.5, reoptimize_every=64)
    drafter = KnapSpecDrafter(lat, replace(bounded, max_branches=4))
    assert drafter.search_branches(context=100, steps_left=500, bound_gain=2.0) == 3  # as without the bound
    assert drafter.search_branches(context=100, steps_left=500, bound_gain=1.1) == 2
    assert drafter.search_branches(context=100, steps_left=500, bound_gain=1.05) == 0


def test_a_request_whose_search_cannot_pay_decodes_plainly_and_exactly(tiny_deep_llama, monkeypatch):
    from pipeline.knapspec import drafter as knapspec

    calls = []
    real = knapspec.search_candidates
    monkeypatch.setattr(knapspec, "search_candidates", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, model = load_tiny(tiny_deep_llama)
    lat = synthetic_latency(model.spec.num_layers, verify_growth=0.0)
    prompt = prompt_ids(0)
    expected = run(model, prompt, NoDraft(), max_new=30).token_ids
    stingy = KnapSpecDrafter(lat, replace(SEARCH_CONFIG, max_search_share_of_gain=1e-4))
    result = run(model, prompt, stingy, max_new=30)
    assert calls == [] and result.extra["num_searches_postponed"] >= 1 and not stingy.plans
    assert result.token_ids == expected
    # (Searching every 30 steps: a budget of 6 steps' share fits one branch, and one never drafts.)
    generous = KnapSpecDrafter(lat, replace(SEARCH_CONFIG, max_search_share_of_gain=1.0, reoptimize_every=30))
    assert run(model, prompt, generous, max_new=30).token_ids == expected
    assert calls and generous.plans  # the same request with room for a search searches


def test_search_budget_counts_the_steps_left_not_the_tokens():
    """Where the engine's recent steps emitted two tokens each (accepted drafts), 80 tokens left
    are 40 steps of decoding: the search gets the budget of 40 steps, not of 64."""
    lat = synthetic_latency(8, verify_growth=0.0)
    bounded = replace(SEARCH_CONFIG, max_search_share=0.05, reoptimize_every=64, max_branches=4)
    drafter = KnapSpecDrafter(lat, bounded)
    assert drafter.search_branches(context=100, steps_left=80) == 3
    for accepted in (0, 1, 0, 1):  # each step: accepted drafted tokens, plus the model's own
        drafter.observe(num_drafted=2, num_accepted=accepted)
    assert drafter.history.tokens_per_step() == 1.5
    assert drafter.search_branches(context=100, steps_left=80) == 2  # 53 steps: 2.7 forwards


def test_short_requests_postpone_the_search_and_stay_exact(tiny_deep_llama, monkeypatch):
    from pipeline.knapspec import drafter as knapspec

    calls = []
    real = knapspec.search_candidates
    monkeypatch.setattr(knapspec, "search_candidates", lambda *a, **k: calls.append(k or a[5]) or real(*a, **k))
    _, model = load_tiny(tiny_deep_llama)
    lat = synthetic_latency(model.spec.num_layers, verify_growth=0.0)
    prompt = prompt_ids(0)
    bounded = replace(SEARCH_CONFIG, max_search_share=0.05, reoptimize_every=64)
    short = run(model, prompt, KnapSpecDrafter(lat, bounded), max_new=20)
    assert calls == [] and short.extra["num_searches_postponed"] >= 1
    assert short.token_ids == run(model, prompt, NoDraft(), max_new=20).token_ids
    drafter = KnapSpecDrafter(lat, bounded)
    run(model, prompt, drafter, max_new=100)
    assert calls and calls[0].max_branches == 3  # 64 steps planned: 3 of the 4 branches fit
    # Every search is timed against its estimate; later caps follow what searches really cost.
    assert len(drafter.history.search_cost_ratios) == len(calls)


def test_an_unbounded_exact_search_runs(tiny_deep_llama):
    _, model = load_tiny(tiny_deep_llama)
    exact = KnapSpecDrafter(synthetic_latency(model.spec.num_layers, 0.0), replace(SEARCH_CONFIG, max_branches=None))
    prompt = prompt_ids(0)
    assert run(model, prompt, exact).token_ids == run(model, prompt, NoDraft()).token_ids
    assert exact.plans and not exact.history.search_cost_ratios


def test_search_budget_is_validated():
    with pytest.raises(Exception, match="max_search_share"):
        KnapSpecConfig(max_search_share=0.0)
    with pytest.raises(Exception, match="max_search_share_of_gain"):
        KnapSpecConfig(max_search_share_of_gain=1.5)
