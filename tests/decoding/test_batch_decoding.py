"""Several requests decoded together (decode_batch): each with its own prompt length, limit,
drafter and sampling, one verify forward per step. A request's greedy tokens equal its
tokens decoded alone with `ar`; where a batched kernel rounds a row differently
(DESIGN.md §4), a differing token is allowed only at a top-2 logit gap under 1e-4 of the
request alone, and the test says so. Speculative sampling in a batch stays exact (χ²)."""

from __future__ import annotations

import pytest

from pipeline.decoding.decode import decode, decode_requests
from pipeline.decoding.drafters import LayerSkipDrafter, NoDraft
from pipeline.decoding.loop import DecodeConfig, DecodingRequest, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.model.linear import fp16w_available
from tests.builders import (
    SampleTally,
    assert_same_or_near_tie,
    exact_joint_law,
    load_tiny,
    mixed_drafters,
    repeating_prompt,
)

EOS = frozenset({2})


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["fp32", *(["fp16w", "fp16w-bf16"] if fp16w_available() else []), "bf16"])
def test_greedy_tokens_in_a_batch_equal_each_request_alone(tiny_checkpoint, mode):
    _, model = load_tiny(tiny_checkpoint, mode)
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((5, 40, 90, 23, 60))]
    limits = [30, 12, 25, 1, 18]  # one request has nothing to decode after its first token
    expected = [
        decode(model, prefill(model, p, m), DecodeConfig(m, EOS), SamplingParams(), NoDraft()).token_ids
        for p, m in zip(prompts, limits)
    ]
    requests = [
        DecodingRequest(prefill(model, p, m), DecodeConfig(m, EOS), SamplingParams(), d, p.tolist())
        for p, m, d in zip(prompts, limits, mixed_drafters(model))
    ]
    results = decode_requests(model, requests)
    for prompt, result, reference in zip(prompts, results, expected):
        assert_same_or_near_tie(model, prompt, result.token_ids, reference)
    assert sum(r.stats.drafted_tokens for r in results) > 0, "the batch must carry drafts"
    assert results[0].stats.drafted_tokens == 0 and results[3].stats.steps == 0
    for result, limit in zip(results, limits):
        assert result.stats.output_tokens == len(result.token_ids) <= limit
        assert result.stats.steps >= 1 or limit == 1


def test_a_batch_of_one_is_decode(tiny_deep_llama):
    _, model = load_tiny(tiny_deep_llama)
    prompt = repeating_prompt(30, 7)
    drafter = lambda: LayerSkipDrafter([4, 5], model.spec.num_items, max_draft=3, confidence_threshold=0.0)  # noqa: E731
    alone = decode(model, prefill(model, prompt, 20), DecodeConfig(20), SamplingParams(), drafter())
    (batched,) = decode_requests(
        model, [DecodingRequest(prefill(model, prompt, 20), DecodeConfig(20), SamplingParams(), drafter())]
    )
    assert batched.token_ids == alone.token_ids
    assert (batched.stats.steps, batched.stats.drafted_tokens, batched.stats.accepted_tokens) == (
        alone.stats.steps,
        alone.stats.drafted_tokens,
        alone.stats.accepted_tokens,
    )


def test_speculative_sampling_in_a_batch_matches_the_model_distribution(tiny_llama):
    """χ² of (t1, t2, t3) of one prompt sampled by six requests per batch, each with its own
    seed and draft, against the exact joint law of plain sampling."""
    _, model = load_tiny(tiny_llama)
    prompt = repeating_prompt(4, seed=5)
    base = dict(temperature=1.0, top_k=4)
    exact = exact_joint_law(model, prompt, SamplingParams(**base))
    prefilled = prefill(model, prompt, 3)
    tally = SampleTally()
    num_batches, batch = 500, 6
    for b in range(num_batches):
        requests = [
            DecodingRequest(
                prefilled.copy(),
                DecodeConfig(max_new_tokens=3),
                SamplingParams(**base, seed=b * batch + i),
                LayerSkipDrafter([1, 2, 5], model.spec.num_items, max_draft=1 + i % 2, confidence_threshold=0.0),
            )
            for i in range(batch)
        ]
        for result in decode_requests(model, requests):
            tally.add(result)
    tally.assert_follows(exact)


@pytest.mark.slow
@pytest.mark.exactness
def test_real_documents_decoded_together_keep_their_tokens():
    """SmolLM2 in the CPU default mode, four sample documents of different lengths decoded in one
    batch, plain and with prompt lookup, against each decoded alone with `ar`."""
    from pipeline.engine import Engine, EngineConfig
    from pipeline.summarization.prompts import build_prompt
    from tests.builders import sample_documents

    engine = Engine(EngineConfig())
    model, config = engine.model, DecodeConfig(24, engine.eos_token_ids)
    docs = sample_documents()[:4]
    prompts = [
        build_prompt(engine.tokenizer, d["text"], max_prompt_tokens=n).token_ids
        for d, n in zip(docs, (400, 900, 250, 600))
    ]
    expected = [decode(model, prefill(model, p, 24), config, SamplingParams()).token_ids for p in prompts]
    requests = [
        DecodingRequest(
            prefill(model, p, 24), config, SamplingParams(), PromptLookupDrafter() if i % 2 else None, p.tolist()
        )
        for i, p in enumerate(prompts)
    ]
    for prompt, result, reference in zip(prompts, decode_requests(model, requests), expected):
        assert_same_or_near_tie(model, prompt, result.token_ids, reference)


def test_drafts_of_one_sub_network_share_their_forwards(tiny_deep_llama):
    """Three requests drafting with one skip set draft together: one batched forward per draft
    position for all three (not one per request), and the drafts are those drafted alone."""
    from pipeline.decoding.drafters import DraftRequest, propose
    from pipeline.decoding.loop import propose_together

    _, model = load_tiny(tiny_deep_llama)
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((12, 30, 21))]

    def drafter():
        return LayerSkipDrafter([4, 5, 6], model.spec.num_items, max_draft=3, confidence_threshold=0.0)

    def requests():
        return [DecodingRequest(prefill(model, p, 10), DecodeConfig(10), SamplingParams(), drafter()) for p in prompts]

    alone = []
    for request in requests():
        draft_request = DraftRequest(model, request.cache, request.history, 9, SamplingParams(), None, frozenset())
        alone.append(propose(request.drafter, draft_request).token_ids)
    calls = []
    forward_batch = model.forward_batch
    model.forward_batch = lambda blocks, **kw: calls.append(len(blocks)) or forward_batch(blocks, **kw)
    try:
        drafts = propose_together(model, requests())
    finally:
        del model.forward_batch
    assert calls == [3, 3, 3]
    assert [d.token_ids for d in drafts] == alone
