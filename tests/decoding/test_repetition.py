"""Repetition control inside the exact loop: the processors equal transformers' bit for bit,
every strategy's greedy tokens equal `ar`'s (and `generate()`'s in fp32) under them, alone
and in a batch, copied drafts never carry a banned n-gram, and sampling stays exact (χ²)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from pipeline.decoding.decode import decode, decode_requests
from pipeline.decoding.drafters import DraftRequest, LayerSkipDrafter, NoDraft
from pipeline.decoding.hf_reference import run_hf_generate
from pipeline.decoding.loop import DecodeConfig, DecodingRequest, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.repetition import RepetitionState
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.errors import ConfigError
from pipeline.knapspec.baselines import ClaspDrafter, EarlyExitDrafter, SwiftDrafter
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.knapspec.hybrid import KnapSpecLookupDrafter
from tests.builders import (
    SEARCH_CONFIG,
    SampleTally,
    assert_same_or_near_tie,
    chi_square_p_value,
    exact_joint_law,
    load_tiny,
    repeating_prompt,
    synthetic_latency,
)

EOS = frozenset({2})
SETTINGS = {
    "ngram": dict(no_repeat_ngram_size=3),
    "penalty": dict(repetition_penalty=1.3),
    "both": dict(no_repeat_ngram_size=2, repetition_penalty=1.2),
    "answer-penalty": dict(repetition_penalty=1.5, repetition_scope="answer"),
}


def transformers_processed(history: list[int], logits: torch.Tensor, penalty: float, ngram: int) -> torch.Tensor:
    """transformers' own processors over `history` (what their generate() would apply)."""
    ids = torch.tensor([history], dtype=torch.long)
    scores = logits[None].float().clone()
    if penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores) if history else scores
    if ngram:
        scores = NoRepeatNGramLogitsProcessor(ngram)(ids, scores)
    return scores[0]


def naive_banned(history: list[int], n: int) -> set[int]:
    """Every token that would complete an n-gram already in `history`."""
    if len(history) < n:
        return set()
    key = history[len(history) - n + 1 :]
    return {history[s + n - 1] for s in range(len(history) - n + 1) if history[s : s + n - 1] == key}


# ------------------------------------------------------------------ the processors


@pytest.mark.parametrize("penalty,ngram", [(1.3, 0), (0.7, 0), (1.0, 1), (1.0, 2), (1.0, 3), (1.25, 4)])
def test_processing_equals_transformers_bit_for_bit(penalty, ngram):
    rng = random.Random(penalty * 10 + ngram)
    vocab = 40
    for trial in range(30):
        # A small alphabet repeats n-grams often, inside the history and across into the draft.
        history = [rng.randrange(6) for _ in range(rng.randrange(0, 25))]
        draft = [rng.randrange(6) for _ in range(rng.randrange(0, 6))]
        logits = torch.randn(len(draft) + 1, vocab, generator=torch.Generator().manual_seed(trial))
        state = RepetitionState(penalty, ngram, history[: len(history) // 2])
        state.extend(history[len(history) // 2 :])  # grown in two parts, as a request grows
        got = state.process(logits, draft)
        for i in range(len(draft) + 1):
            expected = transformers_processed(history + draft[:i], logits[i], penalty, ngram)
            assert torch.equal(got[i], expected), (trial, i)
            assert torch.equal(state.process_row(logits[i], draft[:i]), expected)
            if ngram:
                assert state.banned(draft[:i]) == naive_banned(history + draft[:i], ngram)


def test_allowed_stops_before_the_first_banned_token():
    state = RepetitionState(1.0, 3, [5, 6, 7, 8, 5, 6])
    assert state.banned() == {7}
    assert state.allowed([7, 8]) == 0
    assert state.allowed([9, 5, 6, 9]) == 3  # (5, 6, 9) is new; (6, 9) ... 9 then repeats (5, 6, 9)
    assert RepetitionState(1.3, 0, [1, 2, 1]).allowed([1, 2, 1]) == 3  # a penalty bans nothing


def test_settings_are_checked():
    for bad in (dict(repetition_penalty=0.0), dict(no_repeat_ngram_size=-1), dict(repetition_scope="prompt")):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    assert SamplingParams().repetition([1, 2]) is None
    assert SamplingParams(repetition_penalty=1.1, repetition_scope="answer").repetition([1, 2]).tokens == []
    # Over the prompt, the loop must be told what the prompt was.
    with pytest.raises(ConfigError, match="prompt_ids"):
        DecodingRequest(_Prefilled(), DecodeConfig(4), SamplingParams(repetition_penalty=1.2))


class _Prefilled:
    cache, logits, prompt_tokens, seconds = None, torch.zeros(8), 1, 0.0


# ------------------------------------------------------------------ greedy: alone


def _drafters(model):
    items = model.spec.num_items
    return {
        "ar": NoDraft(),
        "static": LayerSkipDrafter([1, 3], items, max_draft=3, confidence_threshold=0.0),
        "lookup": PromptLookupDrafter(min_ngram=1),  # drafts often, so copies are cut by the ban
    }


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_every_strategy_equals_generate_under_repetition_control(tiny_checkpoint, setting):
    hf, model = load_tiny(tiny_checkpoint)
    params = SamplingParams(**SETTINGS[setting])
    drafted, changed = 0, False
    for seed in range(3):
        prompt = repeating_prompt(30, seed)
        reference = run_hf_generate(hf, prompt, 40, EOS, params, pad_token_id=0).token_ids
        for name, drafter in _drafters(model).items():
            result = decode(model, prefill(model, prompt, 40), DecodeConfig(40, EOS), params, drafter, prompt.tolist())
            assert result.token_ids == reference, (name, seed)
            drafted += result.stats.drafted_tokens
        changed |= run_hf_generate(hf, prompt, 40, EOS, SamplingParams(), pad_token_id=0).token_ids != reference
    assert drafted > 0
    assert changed, "the setting must change what is generated"


def test_answer_scope_ngram_ban_equals_a_plain_greedy_loop(tiny_llama):
    """transformers has no answer-only n-gram ban: the reference is a greedy loop over the full
    forward with transformers' processor applied to the answer's tokens alone."""
    hf, model = load_tiny(tiny_llama)
    params = SamplingParams(no_repeat_ngram_size=2, repetition_scope="answer")
    for seed in range(3):
        prompt = repeating_prompt(20, seed)
        answer: list[int] = []
        with torch.inference_mode():
            for _ in range(30):
                logits = hf(torch.tensor([prompt.tolist() + answer])).logits[0, -1]
                answer.append(int(transformers_processed(answer, logits, 1.0, 2).argmax()))
        for name, drafter in _drafters(model).items():
            result = decode(model, prefill(model, prompt, 30), DecodeConfig(30), params, drafter, prompt.tolist())
            assert result.token_ids == answer, (name, seed)
        assert len(set(zip(answer, answer[1:]))) == len(answer) - 1  # no bigram twice


def test_searching_strategies_and_baselines_equal_ar_under_repetition_control(tiny_deep_llama):
    _, model = load_tiny(tiny_deep_llama)
    latency = synthetic_latency(model.spec.num_layers, verify_growth=0.0)
    params = SamplingParams(no_repeat_ngram_size=3, repetition_penalty=1.2, repetition_scope="answer")
    drafted = 0
    for seed in range(2):
        prompt = repeating_prompt(40, seed)

        def run(drafter):
            prefilled = prefill(model, prompt, 40)
            return decode(model, prefilled, DecodeConfig(40), params, drafter, prompt.tolist())

        ar = run(NoDraft())
        for drafter in (
            KnapSpecDrafter(latency, SEARCH_CONFIG),
            KnapSpecDrafter(latency, dataclasses.replace(SEARCH_CONFIG, coupled=True)),
            ClaspDrafter(latency, SEARCH_CONFIG),
            SwiftDrafter(latency, SEARCH_CONFIG),
            EarlyExitDrafter(latency, SEARCH_CONFIG),
            KnapSpecLookupDrafter(latency, SEARCH_CONFIG, PromptLookupDrafter(min_ngram=1)),
        ):
            result = run(drafter)
            assert result.token_ids == ar.token_ids, type(drafter).__name__
            drafted += result.stats.drafted_tokens
    assert drafted > 0


# ------------------------------------------------------------------ copied drafts


def test_lookup_never_drafts_a_banned_ngram():
    rng = random.Random(3)
    model = type("M", (), {"device": torch.device("cpu")})()
    proposed = 0
    for trial in range(300):
        n = rng.choice([2, 3, 4])
        tokens = [rng.randrange(5) for _ in range(rng.randrange(4, 40))]
        state = RepetitionState(1.0, n, tokens)
        request = DraftRequest(model, None, tokens, 6, SamplingParams(), None, frozenset(), state)
        draft = PromptLookupDrafter(min_ngram=1, max_draft=6).propose(request).token_ids
        for j, token in enumerate(draft):
            assert token not in naive_banned(tokens + draft[:j], n), (trial, draft)
        # It stops at the first banned token, not before: the plain copy agrees up to there.
        plain = PromptLookupDrafter(min_ngram=1, max_draft=6).propose(
            DraftRequest(model, None, tokens, 6, SamplingParams(), None, frozenset())
        )
        assert draft == plain.token_ids[: len(draft)]
        if len(draft) < len(plain.token_ids):
            assert plain.token_ids[len(draft)] in naive_banned(tokens + draft, n)
        proposed += len(draft)
    assert proposed > 0


# ------------------------------------------------------------------ greedy: in a batch


def _mixed(model, i: int):
    items = model.spec.num_items
    return [
        NoDraft(),
        PromptLookupDrafter(min_ngram=1),
        LayerSkipDrafter([2, 3], items, max_draft=3, confidence_threshold=0.0),
        PromptLookupDrafter(),
    ][i % 4]


def test_requests_in_a_batch_keep_their_own_repetition_control(tiny_checkpoint):
    """Five requests, each with its own setting (one with none), decoded together by decode_batch
    and by the continuous batcher with staggered joins: each equals `ar` alone with its setting."""
    _, model = load_tiny(tiny_checkpoint)
    settings = [SamplingParams(**s) for s in SETTINGS.values()] + [SamplingParams()]
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((5, 40, 90, 23, 60))]
    limits = [30, 12, 25, 20, 18]
    expected = [
        decode(model, prefill(model, p, m), DecodeConfig(m, EOS), q, NoDraft(), p.tolist()).token_ids
        for p, m, q in zip(prompts, limits, settings)
    ]
    requests = [
        DecodingRequest(prefill(model, p, m), DecodeConfig(m, EOS), q, _mixed(model, i), p.tolist())
        for i, (p, m, q) in enumerate(zip(prompts, limits, settings))
    ]
    results = decode_requests(model, requests)
    batcher = ContinuousBatcher(model, max_batch=3, prefill_chunk=16)
    tickets = [
        batcher.submit(GenerationRequest(p, DecodeConfig(m, EOS), q, _mixed(model, i + 1)))
        for i, (p, m, q) in enumerate(zip(prompts, limits, settings))
    ]
    done = {f.ticket: f for f in batcher.run()}
    assert sum(r.stats.drafted_tokens for r in results) > 0
    for prompt, q, result, ticket, reference in zip(prompts, settings, results, tickets, expected):
        assert_same_or_near_tie(model, prompt, result.token_ids, reference, q)
        assert done[ticket].error is None
        assert_same_or_near_tie(model, prompt, done[ticket].result.token_ids, reference, q)


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize("drafter", ["layers", "lookup"])
def test_speculative_sampling_under_a_repetition_penalty_is_exact(tiny_llama, drafter):
    """χ² of (t1, t2, t3) against the law of plain sampling from the processed distributions,
    which differs from the unprocessed one enough for the test to tell them apart."""
    _, model = load_tiny(tiny_llama)
    if drafter == "layers":
        prompt = repeating_prompt(4, seed=5)
        base = dict(temperature=1.0, top_k=4, repetition_penalty=2.0, no_repeat_ngram_size=2)
    else:
        # The model's own greedy text twice over, so copies are likely enough to be kept; no
        # n-gram ban, since a copy after a match of n - 1 tokens is always banned.
        seed_prompt = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(4))
        greedy = decode(model, prefill(model, seed_prompt, 24), DecodeConfig(24), SamplingParams()).token_ids
        prompt = torch.tensor(seed_prompt.tolist() + greedy)
        base = dict(temperature=1.0, top_k=4, repetition_penalty=1.5, repetition_scope="answer")
    exact = exact_joint_law(model, prompt, SamplingParams(**base))
    config = DecodeConfig(max_new_tokens=3)
    prefilled = prefill(model, prompt, 3)
    tally = SampleTally()
    for seed in range(3000):
        if drafter == "layers":
            d = LayerSkipDrafter([1, 2, 5], model.spec.num_items, max_draft=2, confidence_threshold=0.0)
        else:
            d = PromptLookupDrafter(max_ngram=2, min_ngram=1, max_draft=2)
        params = SamplingParams(**base, seed=seed)
        tally.add(decode(model, prefilled.copy(), config, params, d, prompt.tolist()))
    tally.assert_follows(exact)
    unpenalized = exact_joint_law(model, prompt, SamplingParams(temperature=1.0, top_k=4))
    assert chi_square_p_value(tally.counts, unpenalized, sum(tally.counts.values())) < 1e-6


# ------------------------------------------------------------------ the real model


@pytest.mark.slow
def test_real_model_under_repetition_control_equals_generate_and_ar():
    """SmolLM2 on a sample document: in fp32 `ar`, `static`, `lookup` and the hybrid equal
    transformers' generate() under both processors; in the CPU default mode (fp16 weights),
    with the answer-only scope, every strategy equals `ar`, alone and four in a batch."""
    from pipeline.engine import Engine, EngineConfig, StrategyConfig
    from pipeline.knapspec.latency import LatencyModel
    from pipeline.summarization.prompts import build_prompt
    from tests.builders import sample_documents

    text = next(d["text"] for d in sample_documents() if d["id"] == "crs-r48179")
    free_verify = LatencyModel(
        attn_slope=2e-7, attn_base=4e-4, t_mlp=5e-4, t_fixed=1e-3, verify_ratios=(1.0,) * 11, num_layers=30
    )
    everywhere = SamplingParams(no_repeat_ngram_size=3, repetition_penalty=1.2)
    engine = Engine(EngineConfig(dtype="fp32", latency=free_verify))
    prompt = build_prompt(engine.tokenizer, text, max_prompt_tokens=900).token_ids
    reference = engine.generate(prompt, StrategyConfig("hf"), 40, everywhere).token_ids
    assert reference != engine.generate(prompt, StrategyConfig("hf"), 40).token_ids
    for name in ("ar", "static", "lookup", "knapspec-lookup"):
        assert engine.generate(prompt, StrategyConfig(name), 40, everywhere).token_ids == reference, name

    answer = SamplingParams(no_repeat_ngram_size=4, repetition_penalty=1.1, repetition_scope="answer")
    engine = Engine(EngineConfig(dtype="fp16w", latency=free_verify))
    prompts = [build_prompt(engine.tokenizer, text[i * 3000 :], max_prompt_tokens=600).token_ids for i in range(4)]
    ar = [engine.generate(p, StrategyConfig("ar"), 40, answer).token_ids for p in prompts]
    drafted = 0
    for name in ("static", "lookup", "knapspec-lookup"):
        result = engine.generate(prompts[0], StrategyConfig(name), 40, answer)
        assert result.token_ids == ar[0], name
        drafted += result.stats.drafted_tokens
        for prompt, got, expected in zip(
            prompts, engine.generate_batch(prompts, StrategyConfig(name), 40, answer, max_batch=4), ar
        ):
            assert_same_or_near_tie(engine.model, prompt, got.token_ids, expected, answer)
    assert drafted > 0
