"""Where an answer ends: at an end-of-sequence token, at its budget, or on a sentence.

A reader judges a summary by its last line, and a budget that runs out mid-sentence leaves
"…was funded by federal highway appropri". The sentence rule (`SentenceStop`) ends an answer
at the first sentence end once it is `after` tokens long, and an answer that reaches its
budget first loses its unfinished last sentence (never all of it). Both are functions of
the answer's own tokens, applied where every strategy and batch accepts tokens
(`DecodingRequest.accept`), so speculative, batched and plain decoding end alike:
`end_on_sentence` is the same rule over a finished stream, and equals it.

A sentence ends between two tokens where the text so far ends in `.`, `!` or `?` (a closing
quote or bracket may follow) and the next token starts with whitespace; "3.5", "U.S." and
"e.g." inside a sentence, an abbreviation ("Dr. Smith"), an initial ("J. Smith") and a list
marker at a line's start ("1. First") are not ends.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError

# How an answer ended (GenerationResult.finish_reason, the output's `finish_reason` column).
FINISH_EOS = "eos"  # the model's end-of-sequence token
FINISH_SENTENCE = "sentence"  # on a sentence end, by the sentence rule
FINISH_TRIMMED = "trimmed"  # the budget ran out; its unfinished last sentence was cut away
FINISH_LENGTH = "length"  # the budget ran out (mid-sentence under the rule: no sentence end to cut to)
FINISH_REASONS = (FINISH_EOS, FINISH_SENTENCE, FINISH_TRIMMED, FINISH_LENGTH)

SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*\Z")
# Words that a period follows without ending a sentence (lower case, without their last period).
_ABBREVIATED = (
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e cf al fig vol pp inc ltd co corp dept est approx "
    "jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k u.n a.m p.m"
)
ABBREVIATIONS = frozenset(_ABBREVIATED.split())
_LIST_MARKER = re.compile(r"\A\s*(?:\d+|[A-Za-z]|[ivxIVX]+)\.\Z")
_CONTEXT_TOKENS = 8  # tokens decoded to judge the word before a period


class SentenceEnds:
    """Where sentences end in a tokenizer's token stream. A token's text is decoded once, when
    first asked, after an anchor token, so that a leading space survives (SentencePiece drops
    it at the start of a text). Safe across threads."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self._anchor_text = tokenizer.decode(self._anchor)
        self._pieces: dict[int, str] = {}
        self._lock = threading.Lock()  # a fast tokenizer must not be used by two threads at once

    def piece(self, token: int) -> str:
        text = self._pieces.get(token)
        if text is None:
            with self._lock:
                decoded = self._tokenizer.decode(self._anchor + [int(token)], skip_special_tokens=False)
            text = self._pieces[token] = decoded[len(self._anchor_text) :]
        return text

    def ends_before(self, tokens: Sequence[int], next_token: int | None) -> bool:
        """Whether a sentence ends after `tokens`, followed by `next_token` (None: nothing follows)."""
        if not tokens or not self.piece(tokens[-1]).strip():
            return False  # whitespace alone: any end was before it
        text = "".join(self.piece(t) for t in tokens[-_CONTEXT_TOKENS:])
        # A token may carry the whitespace after its sentence (".\n\n" in some vocabularies).
        spaced = text[-1].isspace() or next_token is None or self.piece(next_token)[:1].isspace()
        text = text.rstrip()
        if not spaced or not SENTENCE_END.search(text):
            return False
        if text.rstrip("\"'\u201d\u2019)]")[-1] != ".":
            return True  # "!" and "?" always end one
        newline = text.rfind("\n")
        line = text[newline + 1 :]
        # A list marker ("1. First") is a whole line so far; seen only when the line starts in view.
        if (newline >= 0 or len(tokens) <= _CONTEXT_TOKENS) and _LIST_MARKER.match(line):
            return False
        words = line.split()
        bare = words[-1].lstrip("\"'\u201c\u2018([").rstrip("\"'\u201d\u2019)]")[:-1].lower() if words else ""
        return not (bare in ABBREVIATIONS or (len(bare) == 1 and bare.isalpha()))

    def last_end(self, tokens: Sequence[int]) -> int:
        """The longest prefix of `tokens` that ends on a sentence (its length; 0 if none does):
        the stream's own end counts when its text ends a sentence."""
        for end in range(len(tokens), 0, -1):
            if self.ends_before(tokens[:end], tokens[end] if end < len(tokens) else None):
                return end
        return 0


@dataclass(frozen=True)
class SentenceStop:
    """The sentence rule of one request: end at the first sentence end once `after` tokens are out."""

    sentences: SentenceEnds
    after: int

    def __post_init__(self) -> None:
        if self.after < 1:
            raise ConfigError(f"a sentence rule needs at least 1 token before it may end an answer, got {self.after}")

    def stops_before(self, output: Sequence[int], token: int) -> bool:
        """Whether `token`, about to be appended to `output`, is where the answer ends instead."""
        return len(output) >= self.after and self.sentences.ends_before(output, token)

    def at_budget(self, output: list[int]) -> tuple[list[int], str]:
        """An answer that used its whole budget: cut to its last sentence end, if it has one."""
        end = self.sentences.last_end(output)
        if end == len(output):
            return output, FINISH_SENTENCE
        if end == 0:
            return output, FINISH_LENGTH
        return output[:end], FINISH_TRIMMED


def end_on_sentence(
    tokens: Sequence[int], max_new_tokens: int, eos_token_ids: Collection[int], stop: SentenceStop | None
) -> tuple[list[int], str]:
    """The answer and its finish reason, from a stream decoded with no rule but EOS and the
    budget (transformers' generate(), a test's plain decode): what the loop's rule gives online."""
    tokens = list(tokens)[:max_new_tokens]
    for i, token in enumerate(tokens):
        if stop is not None and i > 0 and stop.stops_before(tokens[:i], token):
            return tokens[:i], FINISH_SENTENCE
        if token in eos_token_ids:
            return tokens[: i + 1], FINISH_EOS
    if len(tokens) < max_new_tokens or stop is None:
        return tokens, FINISH_LENGTH
    return stop.at_budget(tokens)


def eos_token_ids(path: Path, hf_config, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json first (chat models often list several
    there, e.g. Llama 3.1's <|eot_id|>), then config.json, then the tokenizer."""
    candidates = []
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(path).eos_token_id)
    candidates += [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    ids = next((c for c in candidates if c is not None), None)
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)
