"""Prompt-lookup drafting: n-gram matching, greedy equality, and exact sampling."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import DEFAULT_MAX_DRAFT, DraftRequest, NoDraft
from pipeline.decoding.hf_reference import run_hf_generate
from pipeline.decoding.loop import DecodeConfig, prefill
from pipeline.decoding.prompt_lookup import DEFAULT_LOOKUP_MAX_DRAFT, PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.engine import StrategyConfig
from pipeline.errors import ConfigError
from pipeline.summarization.prompts import build_prompt
from tests.builders import chi_square_p_value, exact_joint_law, load_tiny, sample_documents

EOS = frozenset({2})
GREEDY = SamplingParams()
NEW_TOKENS = 48  # for the real model


def request(token_ids: list[int], max_tokens: int = 10, params=GREEDY, eos=frozenset(), vocab_size: int = 100):
    # Matching reads only the tokens; the model is consulted for the one-hot rows' shape and device.
    model = SimpleNamespace(spec=SimpleNamespace(vocab_size=vocab_size), device=torch.device("cpu"))
    return DraftRequest(model, None, token_ids, max_tokens, params, None, eos)


def brute_force(tokens: list[int], min_ngram: int, max_ngram: int, max_draft: int) -> list[int]:
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :]
        if len(tokens) <= n:
            continue
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + max_draft]
    return []


# ------------------------------------------------------------------ matching


def test_most_recent_match_wins():
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=2, max_draft=3)
    tokens = [5, 6, 7, 8, 5, 6, 9, 10, 1, 5, 6]
    assert drafter.propose(request(tokens)).token_ids == [9, 10, 1]


def test_longer_ngram_preferred():
    tokens = [4, 5, 6, 7, 7, 9, 5, 6, 8, 8, 4, 5, 6]
    # (4, 5, 6) occurred once, early; (5, 6) most recently before 8, 8.
    assert PromptLookupDrafter(max_ngram=3, min_ngram=2).propose(request(tokens)).token_ids == [7, 7, 9]
    assert PromptLookupDrafter(max_ngram=2, min_ngram=2).propose(request(tokens)).token_ids == [8, 8, 4]


def test_no_match_gives_an_empty_draft():
    drafter = PromptLookupDrafter()
    assert drafter.propose(request([1, 2, 3, 4, 5])).token_ids == []
    # 5 occurred before, but a single-token match is below min_ngram = 2.
    draft = drafter.propose(request([5, 9, 1, 2, 5]))
    assert draft.token_ids == [] and draft.probs is None
    assert PromptLookupDrafter(min_ngram=1).propose(request([5, 9, 1, 2, 5])).token_ids == [9, 1, 2]
    assert drafter.propose(request([7])).token_ids == []


def test_overlapping_match_and_short_continuation():
    # The latest earlier (7, 7, 7) ends one token before the end: one token follows it.
    assert PromptLookupDrafter().propose(request([7, 7, 7, 7])).token_ids == [7]


def test_respects_max_tokens_and_eos():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    drafter = PromptLookupDrafter(max_draft=4)
    assert drafter.propose(request(tokens)).token_ids == [3, 4, 5, 6]
    assert drafter.propose(request(tokens, max_tokens=2)).token_ids == [3, 4]
    assert drafter.propose(request(tokens, max_tokens=0)).token_ids == []
    # The EOS token is drafted (the target may accept it) but nothing after it.
    assert drafter.propose(request(tokens, eos=frozenset({4}))).token_ids == [3, 4]
    assert drafter.propose(request(tokens, eos=frozenset({3}))).token_ids == [3]


def test_sampling_drafts_carry_one_hot_distributions():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    params = SamplingParams(temperature=1.0)
    draft = PromptLookupDrafter().propose(request(tokens, params=params, vocab_size=10))
    assert draft.token_ids == [3, 4, 5]
    assert draft.probs.shape == (3, 10) and draft.probs.dtype == torch.float32
    assert torch.equal(draft.probs, torch.eye(10)[[3, 4, 5]])


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 1), (2, 3), (1, 4)])
def test_incremental_index_agrees_with_brute_force(min_ngram, max_ngram):
    """Streams grow by appends (as in one request) and are replaced by new ones (as the
    same drafter serves several requests): a shorter stream, a longer one that shares
    no prefix, and one that changes a single early token."""
    rng = random.Random(min_ngram * 10 + max_ngram)
    drafter = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=4)
    num_checked = num_matched = 0
    tokens: list[int] = []
    for stream in range(12):
        if stream % 3 == 1:
            tokens = tokens[: rng.randrange(1, len(tokens) + 1)]  # a new request with a shorter history
        elif stream % 3 == 2 and len(tokens) > 3:
            tokens = list(tokens)
            tokens[1] = (tokens[1] + 1) % 5  # same length or longer, a different prefix
        else:
            tokens = [rng.randrange(5)]  # small alphabet: many repeats
        for _ in range(60):
            history = list(tokens)
            expected = brute_force(history, min_ngram, max_ngram, 4)
            assert drafter.propose(request(history)).token_ids == expected, history
            num_checked += 1
            num_matched += bool(expected)
            tokens = tokens + [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
    assert num_matched > num_checked // 2


def test_growing_history_is_indexed_incrementally():
    """In decoding the history is one list that grows in place."""
    rng = random.Random(3)
    drafter = PromptLookupDrafter(max_draft=3)
    history = [rng.randrange(6) for _ in range(200)]
    for _ in range(100):
        assert drafter.propose(request(history)).token_ids == brute_force(history, 2, 3, 3)
        history.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_acceptance_rate_over_recent_steps():
    drafter = PromptLookupDrafter(acceptance_window=2)
    assert drafter.acceptance_rate == 0.0
    drafter.observe(3, 0)
    drafter.observe(0, 0)  # no draft: no evidence either way
    drafter.observe(3, 3)
    assert drafter.acceptance_rate == pytest.approx(0.5)
    drafter.observe(2, 2)  # the 0-of-3 step leaves the window
    assert drafter.acceptance_rate == pytest.approx(1.0)
    assert (drafter.num_steps, drafter.num_draft_steps, drafter.num_drafted, drafter.num_accepted) == (4, 3, 8, 5)


def test_settings_are_checked():
    with pytest.raises(ConfigError):
        PromptLookupDrafter(min_ngram=3, max_ngram=2)
    with pytest.raises(ConfigError):
        PromptLookupDrafter(min_ngram=0)
    with pytest.raises(ConfigError):
        PromptLookupDrafter(max_draft=0)


def test_strategy_default_draft_lengths():
    assert StrategyConfig("lookup").max_draft == DEFAULT_LOOKUP_MAX_DRAFT
    assert StrategyConfig("hf-lookup").max_draft == DEFAULT_LOOKUP_MAX_DRAFT
    assert StrategyConfig("static").max_draft == DEFAULT_MAX_DRAFT
    assert StrategyConfig("lookup", max_draft=5).max_draft == 5
    # A verify of the draft and one more token stays within the row-exact kernels' 32 rows.
    assert StrategyConfig("static", max_draft=31).max_draft == 31
    with pytest.raises(ConfigError, match="max_draft 32 is too long"):
        StrategyConfig("static", max_draft=32)


# ------------------------------------------------------------ decoding loop


def repetitive_prompt(seed: int) -> torch.Tensor:
    """A random segment three times over, then its start: the model's continuation
    often copies it, so lookups find matches and some are right."""
    segment = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([segment, segment, segment, segment[:4]])


def run(model, prompt, drafter, max_new=40, params=GREEDY, eos=EOS):
    config = DecodeConfig(max_new_tokens=max_new, eos_token_ids=eos)
    return decode(model, prefill(model, prompt, max_new), config, params, drafter, prompt.tolist())


def test_greedy_lookup_equals_ar(tiny_checkpoint):
    _, model = load_tiny(tiny_checkpoint)
    num_drafted = num_accepted = 0
    for seed in range(3):
        # Random prompts too: random models fall into loops of their own, which lookups copy.
        random_prompt = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(seed))
        for prompt in (repetitive_prompt(seed), random_prompt):
            ar = run(model, prompt, NoDraft())
            lookup = run(model, prompt, PromptLookupDrafter())
            assert lookup.token_ids == ar.token_ids, f"seed {seed}"
            num_drafted += lookup.stats.drafted_tokens
            num_accepted += lookup.stats.accepted_tokens
    # Not `< num_drafted`: the tiny Qwen3 repeats one token forever, so its drafts are all
    # right; rejections are asserted in test_lookup_limits_and_eos.
    assert num_drafted > 0 and num_accepted > 0


def test_lookup_limits_and_eos(tiny_llama):
    _, model = load_tiny(tiny_llama)
    prompt = repetitive_prompt(0)
    for max_new in (1, 2, 5, 17):
        result = run(model, prompt, PromptLookupDrafter(max_draft=4), max_new=max_new, eos=frozenset())
        assert len(result.token_ids) == max_new
        assert result.finish_reason == "length"
    full = run(model, prompt, NoDraft(), max_new=30, eos=frozenset())
    eos = full.token_ids[7]
    stopped = run(model, prompt, PromptLookupDrafter(), max_new=30, eos=frozenset({eos}))
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
    assert stopped.finish_reason == "eos"
    stats = run(model, prompt, PromptLookupDrafter(), max_new=30, eos=frozenset()).stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # both branches of verification ran


def test_hf_prompt_lookup_equals_hf_greedy(tiny_llama):
    """The reference itself: transformers' prompt lookup must not change greedy output."""
    hf, _ = load_tiny(tiny_llama)
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        plain = run_hf_generate(hf, prompt, 40, EOS, GREEDY, pad_token_id=0)
        lookup = run_hf_generate(hf, prompt, 40, EOS, GREEDY, pad_token_id=0, prompt_lookup_num_tokens=3)
        assert lookup.token_ids == plain.token_ids
        assert plain.num_forwards == len(plain.token_ids) - 1
        assert lookup.num_forwards <= plain.num_forwards


@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=4), dict(temperature=0.8, top_k=6, top_p=0.7)])
def test_lookup_sampling_matches_the_model_distribution(tiny_llama, params):
    """χ² goodness of fit of (t1, t2, t3) from lookup sampling against the exact joint law
    of plain sampling; t2 passes through the rejection of a one-hot draft."""
    _, model = load_tiny(tiny_llama)
    base = SamplingParams(**params)
    # The model's own greedy text after a seed, twice over: its n-grams recur, and what
    # followed them is likely enough under sampling that drafts are sometimes kept.
    seed_prompt = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(4))
    greedy = run(model, seed_prompt, NoDraft(), max_new=24, eos=frozenset()).token_ids
    prompt = torch.tensor(seed_prompt.tolist() + greedy)

    exact = exact_joint_law(model, prompt, base)

    # Single-token matches make a draft at almost every step, which this test needs.
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=1, max_draft=2)
    config = DecodeConfig(max_new_tokens=3)
    prefilled = prefill(model, prompt, 3)
    counts: dict[tuple[int, ...], int] = {}
    num_drafted = num_accepted = 0
    num_samples = 3000
    for seed in range(num_samples):
        result = decode(model, prefilled.copy(), config, SamplingParams(**params, seed=seed), drafter, prompt.tolist())
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        num_drafted += result.stats.drafted_tokens
        num_accepted += result.stats.accepted_tokens
    assert set(counts) <= set(exact), "sampled a sequence the model gives zero probability"
    assert num_drafted > num_samples // 2, "too few drafts to test their rejection"
    assert 0.05 < num_accepted / num_drafted < 0.95, "the test must exercise both acceptance and rejection"

    p_value = chi_square_p_value(counts, exact, num_samples)
    assert p_value > 1e-3, f"lookup samples do not follow the model (p = {p_value:.2e})"


# -------------------------------------------------------------- real model


@pytest.mark.slow
def test_fp32_lookup_hf_lookup_and_ar_agree_on_a_document(embedded_engine_fp32):
    engine = embedded_engine_fp32
    text = next(d["text"] for d in sample_documents() if d["id"] == "gao-26-109008")
    prompt = build_prompt(engine.tokenizer, text, max_prompt_tokens=1500)
    assert isinstance(engine.drafter(StrategyConfig("lookup")), PromptLookupDrafter)
    names = ("ar", "lookup", "hf-lookup")
    results = {name: engine.generate(prompt.token_ids, StrategyConfig(name), NEW_TOKENS) for name in names}
    assert len(results["ar"].token_ids) == NEW_TOKENS  # the summary does not end this early
    assert results["lookup"].token_ids == results["ar"].token_ids
    assert results["hf-lookup"].token_ids == results["ar"].token_ids
    assert results["lookup"].stats.drafted_tokens > 0
    assert results["lookup"].stats.accepted_tokens > 0
