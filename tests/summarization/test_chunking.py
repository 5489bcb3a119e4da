"""Chunking and map-reduce summarization of documents longer than the context."""

from __future__ import annotations

import functools
import random
import re
import string

import pytest

from pipeline.errors import ConfigError, RowError
from pipeline.summarization.chunking import (
    MapReduceResult,
    SummaryRequest,
    check_chunk_budget,
    map_reduce,
    split_into_chunks,
    split_paragraphs,
)
from tests.builders import sample_documents

DOCS = {d["id"]: d["text"] for d in sample_documents()}
# Different shapes of text: a short report, a report with a 3,500-character
# paragraph, fiction with dialogue, and an RFC with ASCII art and indented lines.
REAL_DOC_IDS = ["gao-26-109008", "crs-r47194", "pg1952-the-yellow-wallpaper", "rfc3986"]


def count_words(text: str) -> int:
    return len(text.split())


def count_chars(text: str) -> int:
    return len(text)


@pytest.fixture(scope="module")
def count_real():
    from pipeline.model import checkpoint

    tok = checkpoint.load_tokenizer(checkpoint.resolve_checkpoint(None))

    # Cached: the checks below count the same paragraphs again for every chunk size.
    @functools.cache
    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    return count


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def assert_chunks_reconstruct(text: str, chunks: list[str], count_tokens, max_tokens: int) -> None:
    """Every chunk fits; the chunks' paragraphs, in order, are the document's paragraphs,
    whole when they fit, else as consecutive pieces that concatenate back to it."""
    assert chunks, "a non-empty document gives at least one chunk"
    pieces = []
    for chunk in chunks:
        assert count_tokens(chunk) <= max_tokens
        paragraphs = split_paragraphs(chunk)
        assert chunk == "\n\n".join(paragraphs)
        pieces.extend(paragraphs)
    k = 0
    for paragraph in split_paragraphs(text):
        if count_tokens(paragraph) <= max_tokens:
            assert pieces[k] == paragraph
            k += 1
            continue
        target, joined, first = squash(paragraph), "", k
        while joined != target:
            joined += squash(pieces[k])
            assert target.startswith(joined)
            k += 1
        assert k - first >= 2, "an oversized paragraph is cut"
    assert k == len(pieces), "no text beyond the document's"


# --- split_paragraphs -------------------------------------------------------------


def test_split_paragraphs_at_blank_and_whitespace_only_lines():
    text = "  First line\nsame paragraph.  \n\nSecond.\n \t \nThird\r\n\r\nFourth\n\n\n\n"
    assert split_paragraphs(text) == ["First line\nsame paragraph.", "Second.", "Third", "Fourth"]
    assert split_paragraphs("") == []
    assert split_paragraphs(" \n\n \n") == []


# --- split_into_chunks ------------------------------------------------------------


def test_paragraphs_are_packed_greedily_and_kept_whole():
    paragraphs = ["one two three", "four five", "six seven eight nine", "ten"]
    chunks = split_into_chunks("\n\n\n".join(paragraphs), count_words, 5)
    assert chunks == ["one two three\n\nfour five", "six seven eight nine\n\nten"]
    assert split_into_chunks("a b\n\nc", count_words, 100) == ["a b\n\nc"]
    assert split_into_chunks(" \n \n", count_words, 10) == []


def test_oversized_paragraph_is_cut_at_lines_then_sentences_then_words():
    lines = "a b c d e\nf g h i j\nk l m n o"
    assert split_into_chunks(lines, count_words, 6) == ["a b c d e", "f g h i j", "k l m n o"]
    assert split_into_chunks(lines, count_words, 10) == ["a b c d e\nf g h i j", "k l m n o"]

    sentences = 'One two three four. Five six seven eight! He said "nine ten." Eleven twelve?'
    assert split_into_chunks(sentences, count_words, 9) == [
        "One two three four. Five six seven eight!",
        'He said "nine ten." Eleven twelve?',
    ]

    words = " ".join(f"w{i}" for i in range(20))
    chunks = split_into_chunks(words, count_words, 7)
    assert [count_words(c) for c in chunks] == [7, 7, 6]
    assert " ".join(chunks) == words


def test_only_the_oversized_paragraph_is_cut():
    text = "short one\n\n" + " ".join(["x"] * 25) + "\n\nshort two\n\nshort three"
    chunks = split_into_chunks(text, count_words, 10)
    x10 = " ".join(["x"] * 10)
    assert chunks == ["short one", x10, x10, "x x x x x\n\nshort two\n\nshort three"]
    assert_chunks_reconstruct(text, chunks, count_words, 10)


def test_text_without_whitespace_is_cut_by_bisection():
    text = "intro\n\n" + "x" * 95 + "\n\nsuffix"
    chunks = split_into_chunks(text, count_chars, 10)
    assert all(len(c) <= 10 for c in chunks)
    assert "".join(squash(c) for c in chunks) == squash(text)
    assert chunks[1:10] == ["x" * 10] * 9


def test_giant_paragraph_without_spaces_fits_with_real_tokenizer(count_real):
    rng = random.Random(0)
    blob = "".join(rng.choice(string.ascii_letters + string.digits + "+/=") for _ in range(30_000))
    text = "Intro paragraph.\n\n" + blob + "\n\nClosing paragraph."
    chunks = split_into_chunks(text, count_real, 256)
    assert len(chunks) > 10
    assert_chunks_reconstruct(text, chunks, count_real, 256)
    assert chunks[0].startswith("Intro paragraph.")
    assert chunks[-1].endswith("Closing paragraph.")


@pytest.mark.parametrize("max_tokens", [256, 1000, 4000])
def test_real_documents_fit_and_keep_paragraphs(count_real, max_tokens):
    for doc_id in REAL_DOC_IDS:
        text = DOCS[doc_id]
        chunks = split_into_chunks(text, count_real, max_tokens)
        assert_chunks_reconstruct(text, chunks, count_real, max_tokens)
        if max_tokens == 256:
            assert len(chunks) > 1


def test_tokenizer_sees_about_twice_the_document(count_real):
    """Paragraphs are counted once and each chunk once, not prefixes over and over."""
    seen = []

    def counting(text: str) -> int:
        seen.append(len(text))
        return count_real.__wrapped__(text)

    text = DOCS["crs-r48883"]
    for max_tokens in (256, 4000):
        seen.clear()
        split_into_chunks(text, counting, max_tokens)
        assert sum(seen) < 3 * len(text)

    rng = random.Random(1)
    blob = "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(15_000))
    seen.clear()
    split_into_chunks(blob, counting, 256)
    # Probes stay near one piece in size; probing the whole rest would grow with the length.
    assert sum(seen) < 20 * len(blob)


def test_whitespace_only_separators_do_not_need_to_count():
    # A counter that charges for whitespace: the verified count decides, not the estimate.
    text = "aaaa bbbb\n\ncccc\n\ndddd eeee ffff"
    chunks = split_into_chunks(text, count_chars, 12)
    assert all(len(c) <= 12 for c in chunks)
    assert_chunks_reconstruct(text, chunks, count_chars, 12)


def test_bad_chunk_size_is_a_config_error():
    with pytest.raises(ConfigError):
        split_into_chunks("text", count_words, 0)


def test_a_character_longer_than_the_budget_is_a_row_error():
    with pytest.raises(RowError, match="single character"):
        split_into_chunks("abc", lambda s: 2 * len(s), 1)


# --- map_reduce -------------------------------------------------------------------


class FirstWords:
    """A fake summarizer: the first `k` words of each request; records every call."""

    def __init__(self, k: int):
        self.k = k
        self.calls: list[list[SummaryRequest]] = []

    def __call__(self, requests: list[SummaryRequest]) -> list[str]:
        self.calls.append(list(requests))
        return [" ".join(r.text.split()[: self.k]) for r in requests]


def test_document_that_fits_is_one_request():
    summarize = FirstWords(3)
    result = map_reduce("a short document of seven words", count_tokens=count_words, max_tokens=50, summarize=summarize)
    assert result == MapReduceResult("a short document", num_chunks=1, levels=0, num_requests=1)
    assert summarize.calls == [[SummaryRequest("a short document of seven words", "document", 0, 0, 1)]]


def test_document_that_fits_after_whitespace_normalisation_is_one_request():
    summarize = FirstWords(1)
    text = "aaaa" + "\n" * 40 + "bbbb"
    result = map_reduce(text, count_tokens=count_chars, max_tokens=20, summarize=summarize)
    assert summarize.calls == [[SummaryRequest("aaaa\n\nbbbb", "document", 0, 0, 1)]]
    assert (result.num_chunks, result.levels, result.num_requests) == (1, 0, 1)


def test_long_document_recursion_ends_and_reports_counts():
    text = DOCS["pg35-the-time-machine"]
    summarize = FirstWords(20)
    result = map_reduce(text, count_tokens=count_words, max_tokens=300, summarize=summarize)

    parts = split_into_chunks(text, count_words, 300)
    assert result.num_chunks == len(parts) > 1
    assert result.levels == len(summarize.calls) - 1 >= 2
    assert result.num_requests == sum(len(c) for c in summarize.calls)
    # The parts of one level arrive in a single call, in order.
    assert [r.text for r in summarize.calls[0]] == parts
    for level, call in enumerate(summarize.calls[:-1]):
        kind = "part" if level == 0 else "part-summaries"
        assert [(r.kind, r.level, r.index, r.count) for r in call] == [
            (kind, level, i, len(call)) for i in range(len(call))
        ]
        assert len(call) > 1
    assert [(r.kind, r.level, r.index, r.count) for r in summarize.calls[-1]] == [("summaries", result.levels, 0, 1)]
    assert all(count_words(r.text) <= 300 for call in summarize.calls for r in call)
    assert result.summary == " ".join(summarize.calls[-1][0].text.split()[:20])


def test_requests_fit_with_real_tokenizer(count_real):
    summarize = FirstWords(30)
    result = map_reduce(DOCS["crs-r47194"], count_tokens=count_real, max_tokens=1000, summarize=summarize)
    assert result.num_chunks == len(summarize.calls[0]) > 1
    assert result.levels >= 1
    assert all(count_real(r.text) <= 1000 for call in summarize.calls for r in call)


def test_no_progress_is_a_row_error():
    text = DOCS["gao-26-109008"]
    with pytest.raises(RowError, match="no progress"):
        map_reduce(text, count_tokens=count_words, max_tokens=500, summarize=lambda rs: [r.text for r in rs])


def test_exceeding_max_levels_is_a_row_error():
    text = DOCS["pg35-the-time-machine"]
    summarize = FirstWords(20)
    with pytest.raises(RowError, match="max_levels=1"):
        map_reduce(text, count_tokens=count_words, max_tokens=300, summarize=summarize, max_levels=1)
    # Raised before any request beyond the allowed level is sent.
    assert max(r.level for call in summarize.calls for r in call) <= 1


def test_empty_summaries_are_dropped_and_all_empty_is_a_row_error():
    text = "\n\n".join(" ".join(f"p{p}w{w}" for w in range(10)) for p in range(6))

    def every_other_empty(requests):
        return ["" if r.index % 2 else " ".join(r.text.split()[:2]) for r in requests]

    result = map_reduce(text, count_tokens=count_words, max_tokens=20, summarize=every_other_empty)
    assert result.summary == "p0w0 p0w1"
    assert (result.num_chunks, result.levels, result.num_requests) == (3, 1, 4)

    with pytest.raises(RowError, match="empty"):
        map_reduce(text, count_tokens=count_words, max_tokens=20, summarize=lambda rs: [" "] * len(rs))
    with pytest.raises(RowError, match="empty"):
        map_reduce(" \n ", count_tokens=count_words, max_tokens=20, summarize=FirstWords(1))


def test_map_reduce_settings_are_checked():
    with pytest.raises(ConfigError):
        map_reduce("text", count_tokens=count_words, max_tokens=0, summarize=FirstWords(1))
    with pytest.raises(ConfigError):
        map_reduce("text", count_tokens=count_words, max_tokens=10, summarize=FirstWords(1), max_levels=0)


# --- check_chunk_budget -----------------------------------------------------------


def test_check_chunk_budget():
    check_chunk_budget(4000, 1000)
    check_chunk_budget(4, 1)
    for max_tokens, max_new_tokens in [(3999, 1000), (0, 0), (100, 0), (0, 10)]:
        with pytest.raises(ConfigError):
            check_chunk_budget(max_tokens, max_new_tokens)
