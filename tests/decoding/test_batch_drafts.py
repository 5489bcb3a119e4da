"""Draft lengths for a batch (batch_drafts.py): the positions kept maximize the batch's
expected tokens per second under the step's cost, checked against brute force; the step
cost from a table and fitted to timed steps (step_cost.py); cut drafts stay exact in a
batch, greedy (tokens equal `ar` alone) and sampled (χ²)."""

from __future__ import annotations

import itertools
import random
import statistics

import numpy as np
import pytest
import torch

from pipeline.decoding.batch_drafts import trim_drafts
from pipeline.decoding.decode import decode, decode_requests
from pipeline.decoding.drafters import Draft, DraftRequest, DraftSteps, NoDraft
from pipeline.decoding.loop import DecodeConfig, DecodingRequest, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.step_cost import OnlineStepCost, StepCost, nonnegative_lstsq
from pipeline.knapspec.hybrid import KnapSpecLookupDrafter
from tests.builders import (
    SEARCH_CONFIG,
    SampleTally,
    assert_same_or_near_tie,
    exact_joint_law,
    load_tiny,
    repeating_prompt,
    synthetic_latency,
)


def table_cost(num_layers: int, verify_growth: float) -> StepCost:
    return StepCost.from_table(synthetic_latency(num_layers, verify_growth))


def expected_rate(kept, survival, contexts, cost, padded) -> float:
    tokens = len(kept) + sum(sum(p[:k]) for k, p in zip(kept, survival) if p is not None)
    return tokens / cost.seconds(contexts, [1 + k for k in kept], padded)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("growth", [0.02, 0.1, 0.3])
def test_kept_positions_are_the_best_prefixes(growth, padded):
    """On random small batches, no choice of prefixes has a higher expected rate (some
    drafts without an estimate, which are kept whole)."""
    cost = table_cost(4, verify_growth=growth)
    rng = random.Random(int(growth * 100) + padded)
    for _ in range(60):
        size = rng.randint(1, 4)
        lengths = [rng.randint(0, 3) for _ in range(size)]
        survival = [
            None if rng.random() < 0.2 else sorted((rng.random() for _ in range(n)), reverse=True) for n in lengths
        ]
        contexts = [rng.randint(10, 3000) for _ in range(size)]
        kept = trim_drafts(lengths, survival, contexts, cost, padded)
        assert all(0 <= k <= n for k, n in zip(kept, lengths))
        assert all(k == n for k, n, p in zip(kept, lengths, survival) if p is None)
        choices = itertools.product(*(range(n + 1) if p is not None else [n] for n, p in zip(lengths, survival)))
        best = max(expected_rate(list(choice), survival, contexts, cost, padded) for choice in choices)
        assert expected_rate(kept, survival, contexts, cost, padded) == pytest.approx(best, rel=1e-9)


def test_a_pool_weighs_the_widest_draft_for_every_slot():
    """Two of eight pooled requests draft: widening the pool's block widens all eight slots'
    attention, so at long context the pool keeps shorter drafts than separate caches would."""
    cost = table_cost(4, verify_growth=0.15)
    lengths, survival = [3, 3] + [0] * 6, [[0.6, 0.4, 0.3]] * 2 + [[]] * 6
    for context, apart in ((200, [1, 1]), (6000, [3, 3])):
        assert trim_drafts(lengths, survival, [context] * 8, cost)[:2] == apart
        assert trim_drafts(lengths, survival, [context] * 8, cost, padded=True)[:2] == [1, 1]


def test_cheap_rows_keep_drafts_and_dear_rows_cut_them():
    lengths, survival, contexts = [3, 3], [[0.9, 0.8, 0.7], [0.3, 0.2, 0.1]], [500, 500]
    assert trim_drafts(lengths, survival, contexts, table_cost(4, verify_growth=0.0)) == [3, 3]
    assert trim_drafts(lengths, survival, contexts, table_cost(4, verify_growth=0.4)) == [3, 0]
    assert trim_drafts(lengths, survival, contexts, table_cost(4, verify_growth=5.0)) == [0, 0]
    # A draft without an estimate is verified whole, and its rows still count.
    assert trim_drafts([2, 3], [None, [0.3, 0.2, 0.1]], contexts, table_cost(4, 0.4)) == [2, 0]
    with pytest.raises(ValueError):
        trim_drafts([3], [[0.9]], [100], table_cost(4, 0.4))


def test_the_step_cost_of_a_table_shares_the_weights_and_not_the_attention():
    latency = synthetic_latency(4, verify_growth=0.1)
    cost = StepCost.from_table(latency)
    assert cost.seconds([1000], [1]) == pytest.approx(latency.t_forward(1000))
    assert cost.seconds([1000], [5]) == pytest.approx(latency.t_verify(5, 1000))  # one request: the table
    two = cost.seconds([1000, 3000], [1, 1])
    attention = latency.t_forward(3000) - latency.t_forward(0)
    assert two == pytest.approx(latency.t_forward(1000) + attention + cost.per_row)
    # In a pool every slot computes the widest block.
    assert cost.seconds([1000, 3000], [4, 1], padded=True) == pytest.approx(
        two + 3 * cost.per_row + 3 * cost.per_key_row * 4000
    )
    with pytest.raises(ValueError):
        cost.seconds([1000], [0])


def synthetic_steps(truth: StepCost, count: int, seed: int, slowdown: float = 1.0):
    """Timed steps of batches of 2-8 requests at 0.3k-6k context, some drafting, some pooled,
    with 5% noise and one step in twenty stalled (3× as long)."""
    rng = random.Random(seed)
    for k in range(count):
        size = rng.randint(2, 8)
        contexts = [rng.randint(300, 6000) for _ in range(size)]
        rows = [1 + (rng.randint(0, 4) if rng.random() < 0.5 else 0) for _ in range(size)]
        padded = rng.random() < 0.5
        seconds = truth.seconds(contexts, rows, padded) * slowdown * rng.uniform(0.95, 1.05)
        yield contexts, rows, padded, seconds * (3.0 if k % 20 == 7 else 1.0)


def worst_error(cost: StepCost, truth: StepCost, seed: int, slowdown: float = 1.0) -> float:
    errors = []
    for contexts, rows, padded, _ in synthetic_steps(truth, 200, seed):
        expected = truth.seconds(contexts, rows, padded) * slowdown
        errors.append(abs(cost.seconds(contexts, rows, padded) - expected) / expected)
    return max(errors)


def test_timed_steps_correct_a_table_twice_off_and_follow_a_slower_device():
    truth = StepCost(fixed=0.02, per_row=0.003, per_key=6e-6, per_key_row=1.5e-6)
    online = OnlineStepCost(StepCost(*(2 * v for v in truth.as_tuple())))  # a table measured 2× slow
    assert worst_error(online.current(), truth, seed=1) > 0.9
    for step in synthetic_steps(truth, 40, seed=2):
        online.observe(*step)
    assert worst_error(online.current(), truth, seed=3) < 0.15
    for step in synthetic_steps(truth, 100, seed=4, slowdown=1.5):  # the device slows down mid-run
        online.observe(*step)
    assert worst_error(online.current(), truth, seed=5, slowdown=1.5) < 0.15


def test_a_device_several_times_slower_is_followed_within_a_few_dozen_steps():
    """A relative-error fit over old and new steps would sit near the old speed, and the stall
    rule would drop the new steps: a run of steps missed the same way restarts the fit."""
    truth = StepCost(fixed=0.02, per_row=0.003, per_key=6e-6, per_key_row=1.5e-6)
    online = OnlineStepCost(truth)
    for step in synthetic_steps(truth, 60, seed=2):  # noise and stalls, but no change of speed
        online.observe(*step)
    assert online.num_changes == 0
    for step in synthetic_steps(truth, 24, seed=4, slowdown=10.0):
        online.observe(*step)
    assert online.num_changes == 1
    assert worst_error(online.current(), truth, seed=5, slowdown=10.0) < 0.15


def test_the_nonnegative_solve_is_lawson_and_hansons():
    from scipy.optimize import nnls

    generator = np.random.default_rng(11)
    scales = np.array([1.0, 1e3, 1e-2, 5.0])  # columns as unlike as the fit's
    for _ in range(50):
        a = generator.standard_normal((60, 4)) * scales
        b = generator.standard_normal(60)
        np.testing.assert_allclose(nonnegative_lstsq(a, b), nnls(a, b)[0], atol=1e-9, rtol=1e-6)
    assert nonnegative_lstsq(np.eye(3), np.array([1.0, -2.0, 3.0])).tolist() == [1.0, 0.0, 3.0]


def test_a_request_alone_corrects_a_table_that_overstates_its_step():
    """A request decoding alone: every step one row at a context one longer. The steps say only
    what that one shape costs, so the fit shares the correction among the coefficients that
    shape uses in proportion to their shares (the table's split, and so its verify slope, is
    kept) and none goes below zero (a fit that shared it equally, solved freely and cut its
    negative coefficients to zero stayed ~30% slow)."""
    truth = StepCost(fixed=0.018, per_row=0.002, per_key=5e-6, per_key_row=1e-6)
    table = StepCost(fixed=0.041, per_row=0.0021, per_key=4e-6, per_key_row=2e-7)  # one row at 1k: 1.7x slow
    rng = random.Random(3)
    for context in (1000, 4000):
        online = OnlineStepCost(table)
        for i in range(48):
            online.observe([context + i], [1], False, truth.seconds([context + i], [1]) * rng.uniform(0.96, 1.04))
        later = [fitted for _, fitted in list(online.errors)[16:]]
        assert max(later) < 0.15, (context, max(later))
        fitted = online.current()
        assert min(fitted.as_tuple()) >= 0.0
        assert fitted.per_row / fitted.fixed == pytest.approx(table.per_row / table.fixed, rel=0.1)
        assert fitted.per_key / fitted.fixed == pytest.approx(table.per_key / table.fixed, rel=0.1)


def test_steps_that_never_draft_keep_the_tables_draft_costs():
    """A batch that only decodes says nothing of what query rows cost: those stay the table's."""
    table = StepCost(fixed=0.02, per_row=0.003, per_key=6e-6, per_key_row=1.5e-6)
    online = OnlineStepCost(table)
    rng = random.Random(0)
    for _ in range(60):
        contexts = [rng.randint(300, 6000) for _ in range(rng.randint(2, 8))]
        online.observe(contexts, [1] * len(contexts), True, table.seconds(contexts, [1] * len(contexts)))
    assert online.current().per_key_row == pytest.approx(table.per_key_row, rel=0.05)
    assert online.current().per_key == pytest.approx(table.per_key, rel=0.05)


def test_a_device_uniformly_slower_than_its_table_is_the_table_scaled():
    """A table measured at full speed on a device now 30 times slower (a throttled device, or a
    store corrected by a job that shared its cores): the pull is toward the table's proportions
    at any scale, so the fit follows within a few dozen steps and scales what the steps never
    show (these batches never draft) with the rest, instead of holding it at the table's."""
    truth = StepCost(fixed=0.6, per_row=0.09, per_key=1.8e-4, per_key_row=4.5e-5)
    table = StepCost(*(v / 30 for v in truth.as_tuple()))
    online = OnlineStepCost(table)
    rng = random.Random(5)
    for _ in range(40):
        contexts = [rng.randint(300, 6000) for _ in range(rng.randint(2, 8))]
        rows = [1] * len(contexts)
        online.observe(contexts, rows, True, truth.seconds(contexts, rows, True) * rng.uniform(0.97, 1.03))
    later = [fitted for _, fitted in list(online.errors)[16:]]
    assert max(later) < 0.15, max(later)
    assert online.current().per_key_row == pytest.approx(truth.per_key_row, rel=0.1)


def test_steps_stalled_by_a_neighbour_do_not_pull_the_fit():
    """A third of the steps 30-80% longer, in bursts (a neighbour's work on a shared core): the
    fit stays near the steps that ran undisturbed: ~3% off them here, where a final solve by
    plain least squares over every step within STALL (the stalled ones are) was ~6% off, and
    in a tiny model's run under the test throttle 10-15% (its median step error at the limit)."""
    truth = StepCost(fixed=0.02, per_row=0.003, per_key=6e-6, per_key_row=1.5e-6)
    online = OnlineStepCost(truth)
    rng = random.Random(9)
    undisturbed = []
    for step in range(90):
        contexts = [rng.randint(300, 6000) for _ in range(rng.randint(2, 8))]
        rows = [1 + rng.randint(0, 3) for _ in contexts]
        expected = truth.seconds(contexts, rows)
        burst = step % 9 in (5, 6, 7)
        online.observe(contexts, rows, False, expected * (rng.uniform(1.3, 1.8) if burst else 1.0))
        if not burst and step >= 30:
            undisturbed.append(abs(online.current().seconds(contexts, rows) - expected) / expected)
    assert statistics.median(undisturbed) < 0.04, statistics.median(undisturbed)


def test_hybrid_drafts_cut_in_a_batch_keep_every_request_exact(tiny_llama):
    """knapspec-lookup's copies in a batch whose rows the table makes dear: drafts are cut
    (fewer drafted tokens than the same requests drafted alone), tokens stay those of `ar`."""
    _, model = load_tiny(tiny_llama)
    latency = synthetic_latency(model.spec.num_layers, verify_growth=0.3)
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((20, 45, 70, 33))]
    config = DecodeConfig(24)

    def hybrid():
        return KnapSpecLookupDrafter(latency, SEARCH_CONFIG, PromptLookupDrafter())

    expected = [decode(model, prefill(model, p, 24), config, SamplingParams(), NoDraft()).token_ids for p in prompts]
    alone = [decode(model, prefill(model, p, 24), config, SamplingParams(), hybrid(), p.tolist()) for p in prompts]
    requests = [DecodingRequest(prefill(model, p, 24), config, SamplingParams(), hybrid(), p.tolist()) for p in prompts]
    batched = decode_requests(model, requests)
    for prompt, result, reference in zip(prompts, batched, expected):
        assert_same_or_near_tie(model, prompt, result.token_ids, reference)
    lookup_alone = sum(r.extra["num_lookup_steps"] for r in alone)
    assert lookup_alone > 0, "the prompts must give the hybrid copies to draft"
    drafted_alone = sum(r.stats.drafted_tokens for r in alone)
    assert 0 < sum(r.stats.drafted_tokens for r in batched) < drafted_alone


class _LikeliestNext:
    """Drafts the likeliest next token after `pending` (one-hot under sampling) by a table, with a
    fixed survival estimate: a draft the model often accepts, and often not."""

    max_draft = 1
    batch_planner = None

    def __init__(self, after: dict[int, int], survival: float, latency) -> None:
        self.after, self.survival, self.latency = after, survival, latency

    def propose_steps(self, request: DraftRequest) -> DraftSteps:
        return self._propose(request)
        yield

    def summary(self) -> dict:
        return {}

    def _propose(self, request: DraftRequest) -> Draft:
        if request.max_tokens < 1 or request.pending not in self.after:
            return Draft([])
        token = self.after[request.pending]
        probs = torch.nn.functional.one_hot(torch.tensor([token]), request.model.spec.vocab_size).float()
        return Draft([token], probs, [self.survival])

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass


def test_sampling_with_cut_drafts_in_a_batch_matches_the_model_distribution(tiny_llama):
    """χ² of (t1, t2, t3) sampled by six requests per batch, the batch verifying the drafts of
    the requests whose estimates make them pay and cutting the others'."""
    _, model = load_tiny(tiny_llama)
    prompt = repeating_prompt(4, seed=5)
    base = dict(temperature=1.0, top_k=4)
    exact = exact_joint_law(model, prompt, SamplingParams(**base))
    pairs: dict[tuple[int, int], float] = {}
    for (t1, t2, _), p in exact.items():
        pairs[t1, t2] = pairs.get((t1, t2), 0.0) + p
    after = {t1: max((t for a, t in pairs if a == t1), key=lambda t: pairs[t1, t]) for t1, _ in pairs}
    latency = synthetic_latency(model.spec.num_layers, verify_growth=0.1)
    estimates = [0.05, 0.1, 0.2, 0.4, 0.6, 0.9]
    prefilled = prefill(model, prompt, 3)
    # One draft token each (three tokens, the first from the prompt's logits): some pay, some not.
    kept = trim_drafts([1] * 6, [[e] for e in estimates], [prompt.numel()] * 6, StepCost.from_table(latency))
    assert 0 < sum(kept) < 6, "the batch must cut some drafts and keep others"
    tally = SampleTally()
    for b in range(500):
        requests = [
            DecodingRequest(
                prefilled.copy(),
                DecodeConfig(max_new_tokens=3),
                SamplingParams(**base, seed=b * 6 + i),
                _LikeliestNext(after, estimate, latency),
            )
            for i, estimate in enumerate(estimates)
        ]
        for result in decode_requests(model, requests):
            tally.add(result)
    tally.assert_follows(exact)
