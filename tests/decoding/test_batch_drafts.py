"""Draft lengths for a batch (batch_drafts.py): the positions kept maximize the batch's
expected tokens per second under the latency table's step cost, checked against brute
force; cut drafts stay exact in a batch, greedy (tokens equal `ar` alone) and sampled (χ²)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pipeline.decoding.batch_drafts import batch_step_seconds, row_seconds, trim_drafts
from pipeline.decoding.drafters import Draft, DraftRequest, NoDraft
from pipeline.decoding.loop import DecodeConfig, DecodingRequest, decode, decode_batch, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
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


def expected_rate(kept, survival, contexts, latency, padded) -> float:
    tokens = len(kept) + sum(sum(p[:k]) for k, p in zip(kept, survival) if p is not None)
    return tokens / batch_step_seconds(latency, contexts, [1 + k for k in kept], padded)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("growth", [0.02, 0.1, 0.3])
def test_kept_positions_are_the_best_prefixes(growth, padded):
    """On random small batches, no choice of prefixes has a higher expected rate (some
    drafts without an estimate, which are kept whole)."""
    latency = synthetic_latency(4, verify_growth=growth)
    rng = random.Random(int(growth * 100) + padded)
    for _ in range(60):
        size = rng.randint(1, 4)
        lengths = [rng.randint(0, 3) for _ in range(size)]
        survival = [None if rng.random() < 0.2 else sorted((rng.random() for _ in range(n)), reverse=True) for n in lengths]
        contexts = [rng.randint(10, 3000) for _ in range(size)]
        kept = trim_drafts(lengths, survival, contexts, latency, padded)
        assert all(0 <= k <= n for k, n in zip(kept, lengths))
        assert all(k == n for k, n, p in zip(kept, lengths, survival) if p is None)
        choices = itertools.product(*(range(n + 1) if p is not None else [n] for n, p in zip(lengths, survival)))
        best = max(expected_rate(list(choice), survival, contexts, latency, padded) for choice in choices)
        assert expected_rate(kept, survival, contexts, latency, padded) == pytest.approx(best, rel=1e-9)


def test_a_pool_weighs_the_widest_draft_for_every_slot():
    """Two of eight pooled requests draft: widening the pool's block widens all eight slots'
    attention, so at long context the pool keeps shorter drafts than separate caches would."""
    latency = synthetic_latency(4, verify_growth=0.15)
    lengths, survival = [3, 3] + [0] * 6, [[0.6, 0.4, 0.3]] * 2 + [[]] * 6
    for context, apart in ((200, [1, 1]), (6000, [3, 3])):
        assert trim_drafts(lengths, survival, [context] * 8, latency)[:2] == apart
        assert trim_drafts(lengths, survival, [context] * 8, latency, padded=True)[:2] == [1, 1]


def test_cheap_rows_keep_drafts_and_dear_rows_cut_them():
    lengths, survival, contexts = [3, 3], [[0.9, 0.8, 0.7], [0.3, 0.2, 0.1]], [500, 500]
    assert trim_drafts(lengths, survival, contexts, synthetic_latency(4, verify_growth=0.0)) == [3, 3]
    assert trim_drafts(lengths, survival, contexts, synthetic_latency(4, verify_growth=0.4)) == [3, 0]
    assert trim_drafts(lengths, survival, contexts, synthetic_latency(4, verify_growth=5.0)) == [0, 0]
    # A draft without an estimate is verified whole, and its rows still count.
    assert trim_drafts([2, 3], [None, [0.3, 0.2, 0.1]], contexts, synthetic_latency(4, 0.4)) == [2, 0]


def test_the_step_cost_shares_the_weights_and_not_the_attention():
    latency = synthetic_latency(4, verify_growth=0.1)
    one = batch_step_seconds(latency, [1000], [1])
    assert one == pytest.approx(latency.t_forward(1000))
    assert batch_step_seconds(latency, [1000], [5]) == pytest.approx(latency.t_verify(5, 1000))
    two = batch_step_seconds(latency, [1000, 3000], [1, 1])
    attention = latency.t_forward(3000) - latency.t_forward(0)
    assert two == pytest.approx(one + attention + row_seconds(latency, 3000))
    with pytest.raises(ValueError):
        batch_step_seconds(latency, [1000], [0])
    with pytest.raises(ValueError):
        trim_drafts([3], [[0.9]], [100], latency)


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
    batched = decode_batch(model, requests)
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

    def __init__(self, after: dict[int, int], survival: float, latency) -> None:
        self.after, self.survival, self.latency = after, survival, latency

    def propose(self, request: DraftRequest) -> Draft:
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
    kept = trim_drafts([1] * 6, [[e] for e in estimates], [prompt.numel()] * 6, latency)
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
        for result in decode_batch(model, requests):
            tally.add(result)
    tally.assert_follows(exact)
