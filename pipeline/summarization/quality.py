"""What makes a summary unreadable, measured: a sentence, or a run of words, that recurs.

Greedy decoding of a small model loops ("She is very strange. She is very strange. ..."):
a summary in which one sentence, or one sequence of `ngram` words, occurs `times` times
or more is a loop, whatever its ROUGE.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from pipeline.decoding.stopping import SENTENCE_END

LOOP_TIMES = 3
LOOP_NGRAM = 6

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[\w'-]+")


@dataclass(frozen=True)
class Repetition:
    kind: str  # "sentence" or "ngram"
    text: str
    count: int


def repetitions(summary: str, times: int = LOOP_TIMES, ngram: int = LOOP_NGRAM) -> list[Repetition]:
    """Sentences and `ngram`-word sequences occurring at least `times` times in `summary`
    (compared lower-cased, by words, so punctuation and case do not hide a loop), most frequent first."""
    found = []
    sentences = Counter(
        key for s in _SENTENCE_END.split(summary) if (key := " ".join(_WORD.findall(s.lower())))
    )
    found += [Repetition("sentence", s, n) for s, n in sentences.items() if n >= times]
    words = _WORD.findall(summary.lower())
    grams = Counter(tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1))
    found += [Repetition("ngram", " ".join(g), n) for g, n in grams.items() if n >= times]
    return sorted(found, key=lambda r: (-r.count, r.kind, r.text))


def loops(summary: str) -> bool:
    """Whether a sentence or a LOOP_NGRAM-word sequence occurs LOOP_TIMES times or more."""
    return bool(repetitions(summary))


def ends_on_sentence(summary: str) -> bool:
    """Whether the summary's last line ends a sentence (".", "!" or "?", a closing quote or bracket after)."""
    return bool(SENTENCE_END.search(summary.rstrip()))
