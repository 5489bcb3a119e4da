"""The sentence rule: where a sentence ends in the real tokenizer's stream, and answers that end
on one alike for every strategy, alone and in a batch."""

from __future__ import annotations

import pytest

from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.stopping import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_SENTENCE,
    FINISH_TRIMMED,
    SentenceEnds,
    SentenceStop,
    end_on_sentence,
)
from pipeline.errors import ConfigError
from pipeline.model import checkpoint


@pytest.fixture(scope="module")
def tokenizer():
    return checkpoint.load_tokenizer(checkpoint.resolve_checkpoint(None, None))


@pytest.fixture(scope="module")
def sentences(tokenizer) -> SentenceEnds:
    return SentenceEnds(tokenizer)


def sentence_ends(tokenizer, sentences: SentenceEnds, text: str) -> list[str]:
    """The text before every place in `text`'s tokens where a sentence ends (the stream's own end included)."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    ends = [
        i
        for i in range(1, len(tokens) + 1)
        if sentences.ends_before(tokens[:i], tokens[i] if i < len(tokens) else None)
    ]
    return [tokenizer.decode(tokens[:i]) for i in ends]


@pytest.mark.parametrize(
    "text,ends",
    [
        ("It rose 3.5% in 2019. The end! Next", ["It rose 3.5% in 2019.", "It rose 3.5% in 2019. The end!"]),
        ('He said "yes." Then, e.g. this, and Dr. Smith (J. R. Smith) came.', ['He said "yes."', None]),
        ("Was it?\n\nNo.\n1. First item\n2. Second", ["Was it?", "Was it?\n\nNo."]),
        ("The U.S. Army and the U.K. Navy met at 5 p.m. Monday", []),
        ("Costs (see Fig. 3) fell (sharply.) Then", ["Costs (see Fig. 3) fell (sharply.)"]),
        ("It ends here.", [None]),
        ("version 2.0.1 of it", []),
    ],
)
def test_sentence_ends_in_the_real_tokenizer(tokenizer, sentences, text, ends):
    """None stands for the whole text: its own end counts when it ends a sentence."""
    assert sentence_ends(tokenizer, sentences, text) == [text if end is None else end for end in ends]


def test_a_sentence_stop_at_the_budget_cuts_its_unfinished_sentence(tokenizer, sentences):
    stop = SentenceStop(sentences, after=100)
    trimmed, reason = stop.at_budget(
        tokenizer.encode("First one. Second one. And a third that", add_special_tokens=False)
    )
    assert (tokenizer.decode(trimmed), reason) == ("First one. Second one.", FINISH_TRIMMED)
    whole = tokenizer.encode("First one. Second one.", add_special_tokens=False)
    assert stop.at_budget(whole) == (whole, FINISH_SENTENCE)
    unfinished = tokenizer.encode("one long clause without any end", add_special_tokens=False)
    assert stop.at_budget(unfinished) == (unfinished, FINISH_LENGTH)  # never trimmed to nothing
    with pytest.raises(ConfigError, match="at least 1 token"):
        SentenceStop(sentences, after=0)
    with pytest.raises(ConfigError, match="end_on_sentence_after"):
        SamplingParams(end_on_sentence_after=0)


def test_end_on_sentence_over_a_finished_stream(tokenizer, sentences):
    tokens = tokenizer.encode("Short. Then a longer sentence here. And more words follow", add_special_tokens=False)
    stop = SentenceStop(sentences, after=4)
    # The first end past 4 tokens, not "Short." before it; the token after the end is not kept.
    answer, reason = end_on_sentence(tokens, len(tokens), frozenset(), stop)
    assert (tokenizer.decode(answer), reason) == ("Short. Then a longer sentence here.", FINISH_SENTENCE)
    eos = tokens[3]
    assert end_on_sentence(tokens, len(tokens), {eos}, stop) == (tokens[:4], FINISH_EOS)
    assert end_on_sentence(tokens, len(tokens), frozenset(), None) == (tokens, FINISH_LENGTH)
    # A budget that ends before any end past `after`: cut to the last end.
    assert end_on_sentence(tokens, 3, frozenset(), SentenceStop(sentences, after=3)) == (tokens[:2], FINISH_TRIMMED)


@pytest.mark.slow
def test_every_strategy_ends_alike_alone_and_in_a_batch():
    """On real documents in the CPU default mode: the answer of every strategy, alone and in a
    batch, is the rule applied to plain decoding's full stream, token for token."""
    from pipeline.engine import Engine, EngineConfig, StrategyConfig
    from pipeline.summarization.prompts import build_prompt
    from tests.builders import sample_documents

    from pipeline.knapspec.latency import LatencyModel

    # Verification nearly free: KnapSpec's search then drafts, so its drafts are really checked.
    latency = LatencyModel(
        attn_slope=2e-7, attn_base=4e-4, t_mlp=5e-4, t_fixed=1e-3, verify_ratios=(1.0,) * 11, num_layers=30
    )
    engine = Engine(EngineConfig(latency=latency))
    docs = sample_documents()[:4]
    prompts = [build_prompt(engine.tokenizer, d["text"], max_prompt_tokens=500).token_ids for d in docs]
    budget, plain = 40, SamplingParams(no_repeat_ngram_size=3, repetition_scope="answer")
    streams = [engine.generate(p, StrategyConfig("ar"), budget, plain).token_ids for p in prompts]
    reasons = set()
    for after in (12, budget):
        params = SamplingParams(no_repeat_ngram_size=3, repetition_scope="answer", end_on_sentence_after=after)
        stop = engine.decode_config(budget, params).stop
        expected = [end_on_sentence(s, budget, engine.eos_token_ids, stop) for s in streams]
        reasons |= {reason for _, reason in expected}
        for name in ("ar", "static", "knapspec-lookup"):
            alone = [engine.generate(p, StrategyConfig(name), budget, params) for p in prompts]
            batch = engine.generate_batch(prompts, StrategyConfig(name), budget, params, max_batch=4)
            assert [(r.token_ids, r.finish_reason) for r in batch] == expected
            assert [(r.token_ids, r.finish_reason) for r in alone] == expected
    # Both ways of ending on a sentence were met: stopping past `after`, and cutting at the budget.
    assert {FINISH_SENTENCE, FINISH_TRIMMED} <= reasons


class PieceTokenizer:
    """A tokenizer of fixed pieces, one of them a period with its blank line (as some vocabularies have)."""

    pieces = ["a", " Hello", ".\n\n", "World", ".", " there"]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.pieces.index(text)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_a_token_that_carries_the_space_after_its_sentence_ends_it():
    sentences = SentenceEnds(PieceTokenizer())
    assert sentences.ends_before([1, 2], 3)  # " Hello.\n\n" then "World"
    assert not sentences.ends_before([1, 4], 3)  # " Hello." then "World": no space between
    assert sentences.ends_before([1, 4], 5) and sentences.ends_before([1, 4], None)
    assert sentences.last_end([1, 2, 3]) == 2
