"""Map-reduce summarization of documents longer than the model's context.

Pure functions: the caller supplies `count_tokens` (a tokenizer call) and
`summarize` (a batch of requests in, one summary per request out), so this
module needs neither a model nor Ray and is tested with fakes.

A long document is cut into chunks that each fit the budget, every chunk is
summarized (one batch, so a caller can run the parts in parallel), and the
joined summaries are summarized again, recursively, until they fit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.errors import ConfigError, RowError

logger = logging.getLogger(__name__)

CountTokens = Callable[[str], int]

PARAGRAPH_JOIN = "\n\n"
SUMMARY_JOIN = "\n\n"

# A blank line is any line holding only whitespace; `\s*` also swallows runs of them.
_BLANK_LINE = re.compile(r"\n\s*\n")

# Where an oversized paragraph may be cut, from the most to the least natural place.
# Each separator is dropped at the cut (only whitespace is lost). Sentence ends keep
# their punctuation and a closing quote or bracket with the sentence before.
_CUT_LEVELS: tuple[re.Pattern[str], ...] = (
    re.compile(r"[^\S\n]*\n\s*"),  # line breaks
    re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'\u201d\u2019)\]]))\s+"),  # sentence ends
    re.compile(r"\s+"),  # any whitespace
)


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs: blocks separated by blank lines (any whitespace-only line), stripped, empty ones dropped."""
    return [block.strip() for block in _BLANK_LINE.split(text) if block.strip()]


def split_into_chunks(text: str, count_tokens: CountTokens, max_tokens: int) -> list[str]:
    """Consecutive chunks of `text`, each with count_tokens(chunk) <= max_tokens.

    Paragraphs are packed greedily and kept whole, joined with a blank line inside a
    chunk. A paragraph that alone exceeds `max_tokens` is cut at line breaks, then at
    sentence ends, then at whitespace, and as a last resort at character positions
    found by bisection; only that paragraph is cut. The chunks' paragraphs, in order,
    are the document's paragraphs (an oversized one as consecutive pieces).

    Each paragraph is counted once and each assembled chunk is verified once (more
    only when the estimate was wrong), so the tokenizer sees about twice the
    document rather than a quadratic amount of it.
    """
    _check_max_tokens(max_tokens)
    paragraphs = split_paragraphs(text)
    if not paragraphs:
        return []
    # A tokenizer that adds special tokens counts them once per call, not once per
    # paragraph; remove that overhead from the additive estimate.
    overhead = max(0, count_tokens(""))
    join_cost = _join_cost(PARAGRAPH_JOIN, count_tokens, overhead)

    units: list[str] = []
    unit_tokens: list[int] = []
    for paragraph in paragraphs:
        tokens = count_tokens(paragraph)
        if tokens <= max_tokens:
            units.append(paragraph)
            unit_tokens.append(tokens)
            continue
        pieces = _cut_paragraph(paragraph, count_tokens, max_tokens, overhead)
        logger.debug("paragraph of %d tokens cut into %d pieces of <= %d", tokens, len(pieces), max_tokens)
        for piece, piece_tokens in pieces:
            units.append(piece)
            unit_tokens.append(piece_tokens)

    ranges = _pack(
        unit_tokens,
        [join_cost] * len(units),
        lambda i, j: PARAGRAPH_JOIN.join(units[i:j]),
        count_tokens,
        max_tokens,
        overhead,
    )
    chunks = [PARAGRAPH_JOIN.join(units[i:j]) for i, j, _ in ranges]
    logger.debug("%d paragraphs packed into %d chunks of <= %d tokens", len(paragraphs), len(chunks), max_tokens)
    return chunks


@dataclass(frozen=True)
class SummaryRequest:
    text: str  # what to summarize
    # "document": the whole document fits; "part": one chunk of the document;
    # "summaries": the concatenated summaries of parts (final); "part-summaries":
    # a chunk of concatenated summaries at a deeper level.
    kind: str
    level: int  # 0 for the document's own chunks, +1 per reduce level
    index: int  # position among the requests of this level
    count: int  # number of requests at this level


@dataclass(frozen=True)
class MapReduceResult:
    summary: str
    num_chunks: int  # chunks of the original document (1 when it fits)
    levels: int  # reduce levels after the first pass (0 when it fits)
    num_requests: int


def map_reduce(
    text: str,
    *,
    count_tokens: CountTokens,
    max_tokens: int,
    summarize: Callable[[list[SummaryRequest]], list[str]],
    max_levels: int = 8,
) -> MapReduceResult:
    """Summarize `text` with requests of at most `max_tokens` tokens each.

    A document that fits is one "document" request. Otherwise its chunks are one
    batch of "part" requests; their non-empty summaries are joined and, if that
    fits, summarized by one final "summaries" request, else chunked again into
    "part-summaries" requests, and so on. Every level must shorten the text and
    at most `max_levels` reduce levels are run; RowError otherwise.
    """
    _check_max_tokens(max_tokens)
    if max_levels < 1:
        raise ConfigError(f"max_levels must be at least 1, got {max_levels}")
    if not isinstance(text, str) or not text.strip():
        raise RowError("the document is empty")

    current, current_tokens = text, count_tokens(text)
    level, num_chunks, num_requests = 0, 1, 0
    while True:
        if level > max_levels:
            raise RowError(
                f"map-reduce summarization needs more than max_levels={max_levels} reduce levels; "
                f"the summaries still take {current_tokens} tokens, more than the chunk size of {max_tokens}. "
                "Use a larger chunk size or a smaller max_new_tokens"
            )
        chunks = [current] if current_tokens <= max_tokens else split_into_chunks(current, count_tokens, max_tokens)
        if level == 0:
            num_chunks = len(chunks)
        if len(chunks) == 1:
            # Also reached when only whitespace normalisation made the text fit.
            kind = "document" if level == 0 else "summaries"
            (summary,) = _run(summarize, [SummaryRequest(chunks[0], kind, level, 0, 1)])
            num_requests += 1
            if not summary.strip():
                raise RowError(f"the final summary (level {level}) is empty")
            return MapReduceResult(summary.strip(), num_chunks=num_chunks, levels=level, num_requests=num_requests)

        kind = "part" if level == 0 else "part-summaries"
        requests = [SummaryRequest(chunk, kind, level, i, len(chunks)) for i, chunk in enumerate(chunks)]
        summaries = _run(summarize, requests)
        num_requests += len(requests)
        kept = [s.strip() for s in summaries if s.strip()]
        if not kept:
            raise RowError(f"all {len(requests)} summaries at level {level} are empty")
        joined = SUMMARY_JOIN.join(kept)
        joined_tokens = count_tokens(joined)
        logger.debug(
            "level %d: %d %s requests, %d -> %d tokens", level, len(requests), kind, current_tokens, joined_tokens
        )
        if joined_tokens >= current_tokens:
            raise RowError(
                f"map-reduce summarization makes no progress at level {level}: the {len(kept)} summaries take "
                f"{joined_tokens} tokens, not fewer than the {current_tokens} tokens they summarize. "
                "Use a larger chunk size or a smaller max_new_tokens"
            )
        current, current_tokens, level = joined, joined_tokens, level + 1


def check_chunk_budget(max_tokens: int, max_new_tokens: int) -> None:
    """ConfigError unless max_tokens >= 4 * max_new_tokens.

    Greedy packing leaves any two neighbouring chunks together longer than one
    chunk, so chunks are on average about half full or more; with a summary at
    most a quarter of a chunk, each reduce level roughly halves the text and the
    recursion ends.
    """
    _check_max_tokens(max_tokens)
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if max_tokens < 4 * max_new_tokens:
        raise ConfigError(
            f"chunks of {max_tokens} tokens are too small for summaries of up to {max_new_tokens} tokens: "
            f"map-reduce needs a chunk size of at least 4 * max_new_tokens = {4 * max_new_tokens} "
            "so that every reduce level shortens the text"
        )


def _check_max_tokens(max_tokens: int) -> None:
    if max_tokens < 1:
        raise ConfigError(f"the chunk size must be at least 1 token, got {max_tokens}")


def _run(summarize: Callable[[list[SummaryRequest]], list[str]], requests: list[SummaryRequest]) -> list[str]:
    summaries = list(summarize(requests))
    if len(summaries) != len(requests):
        # A broken summarizer, not a bad row: let it surface as a bug.
        raise ValueError(f"summarize returned {len(summaries)} summaries for {len(requests)} requests")
    return [s if isinstance(s, str) else "" for s in summaries]


def _join_cost(separator: str, count_tokens: CountTokens, overhead: int) -> int:
    """Tokens that `separator` adds between two texts.

    Measured in context rather than as count_tokens(separator): a byte-level BPE
    tokenizer may encode "\n\n" alone as one token but as two between words.
    """
    left, right = "end.", "Next"
    joined = count_tokens(left + separator + right)
    return max(0, joined - count_tokens(left) - count_tokens(right) + overhead)


def _pack(
    tokens: Sequence[int],
    join_costs: Sequence[int],
    assemble: Callable[[int, int], str],
    count_tokens: CountTokens,
    max_tokens: int,
    overhead: int,
) -> list[tuple[int, int, int]]:
    """Greedy ranges [i, j) of units whose assembled text fits `max_tokens`, with its token count.

    Every unit fits alone (tokens[k] <= max_tokens). The additive estimate picks
    the range; the assembled text is then counted once, and if tokens merged
    across a join the range is shrunk by bisection (its first unit always fits).
    """
    ranges: list[tuple[int, int, int]] = []
    i, n = 0, len(tokens)
    while i < n:
        j, estimate = i + 1, tokens[i]
        while j < n and estimate + join_costs[j] + tokens[j] - overhead <= max_tokens:
            estimate += join_costs[j] + tokens[j] - overhead
            j += 1
        total = tokens[i] if j - i == 1 else count_tokens(assemble(i, j))
        if total > max_tokens:
            lo, lo_total, hi = i + 1, tokens[i], j  # invariant: [i, lo) fits, [i, hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                mid_total = count_tokens(assemble(i, mid))
                if mid_total <= max_tokens:
                    lo, lo_total = mid, mid_total
                else:
                    hi = mid
            j, total = lo, lo_total
        ranges.append((i, j, total))
        i = j
    return ranges


def _cut_paragraph(paragraph: str, count_tokens: CountTokens, max_tokens: int, overhead: int) -> list[tuple[str, int]]:
    """Pieces of an oversized paragraph, each fitting, as long as possible."""
    spans = _fitting_spans(paragraph, 0, len(paragraph), 0, count_tokens, max_tokens)
    newline_cost = _join_cost("\n", count_tokens, overhead)
    # Whitespace other than a line break is absorbed into the next token by
    # subword tokenizers and ignored by word counters, so only newlines cost.
    join_costs = [0] + [
        newline_cost if "\n" in paragraph[spans[k - 1][1] : spans[k][0]] else 0 for k in range(1, len(spans))
    ]
    ranges = _pack(
        [t for _, _, t in spans],
        join_costs,
        lambda i, j: paragraph[spans[i][0] : spans[j - 1][1]],
        count_tokens,
        max_tokens,
        overhead,
    )
    return [(paragraph[spans[i][0] : spans[j - 1][1]], total) for i, j, total in ranges]


def _fitting_spans(
    text: str, start: int, end: int, level: int, count_tokens: CountTokens, max_tokens: int
) -> list[tuple[int, int, int]]:
    """(start, end, tokens) spans covering text[start:end] minus separators, each fitting.

    The span is cut at the separators of `level`; a segment that is still too long
    is cut at the next level's separators, down to single characters.
    """
    if level == len(_CUT_LEVELS):
        return _cut_by_characters(text, start, end, count_tokens, max_tokens)
    segments = []
    position = start
    for match in _CUT_LEVELS[level].finditer(text, start, end):
        segments.append((position, match.start()))
        position = match.end()
    segments.append((position, end))
    segments = [(a, b) for a, b in segments if b > a]
    if len(segments) == 1 and segments[0] == (start, end):
        # No separator of this level: the segment is known to be too long, skip counting it again.
        return _fitting_spans(text, start, end, level + 1, count_tokens, max_tokens)
    spans: list[tuple[int, int, int]] = []
    for a, b in segments:
        tokens = count_tokens(text[a:b])
        if tokens <= max_tokens:
            spans.append((a, b, tokens))
        else:
            spans.extend(_fitting_spans(text, a, b, level + 1, count_tokens, max_tokens))
    return spans


def _cut_by_characters(
    text: str, start: int, end: int, count_tokens: CountTokens, max_tokens: int
) -> list[tuple[int, int, int]]:
    """Longest fitting prefixes of text[start:end], found by galloping then bisection.

    Galloping from the previous piece's length keeps every probe near one piece's
    size, so a long run without whitespace costs O(log) calls per piece rather than
    calls over the whole remaining text.
    """
    spans: list[tuple[int, int, int]] = []
    guess = max_tokens  # characters: at least one per token is a fair first probe
    a = start
    while a < end:
        lo, lo_tokens = a + 1, count_tokens(text[a : a + 1])
        if lo_tokens > max_tokens:
            raise RowError(
                f"a single character ({text[a]!r}) takes {lo_tokens} tokens, more than the chunk size of "
                f"{max_tokens}; use a larger chunk size"
            )
        hi = None  # first probe known not to fit
        probe = min(end, max(a + guess, lo + 1))
        while probe > lo:
            tokens = count_tokens(text[a:probe])
            if tokens > max_tokens:
                hi = probe
                break
            lo, lo_tokens = probe, tokens
            probe = min(end, a + 2 * (probe - a))
        if hi is not None:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                tokens = count_tokens(text[a:mid])
                if tokens <= max_tokens:
                    lo, lo_tokens = mid, tokens
                else:
                    hi = mid
        spans.append((a, lo, lo_tokens))
        guess = lo - a
        a = lo
    return spans
