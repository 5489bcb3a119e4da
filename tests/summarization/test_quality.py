"""The loop checker: a sentence or a six-word sequence three times is a loop."""

from __future__ import annotations

from pipeline.summarization.quality import loops, repetitions


def test_a_sentence_three_times_is_a_loop_whatever_its_case_and_punctuation():
    text = "She is very strange. She is very strange! she is very strange. The end."
    (found, *_) = repetitions(text)
    assert (found.kind, found.text, found.count) == ("sentence", "she is very strange", 3)
    assert not loops("She is very strange. She is very strange. The end.")


def test_six_words_three_times_inside_longer_sentences():
    run = "the steps that are described in"
    text = f"First, {run} part one. Then {run} part two, and {run} part three."
    assert run in [r.text for r in repetitions(text) if r.kind == "ngram"]
    assert not loops(f"First, {run} part one. Then {run} part two.")
    # Five of the six words three times is not a loop.
    assert not loops("a b c d e x. a b c d e y. a b c d e z.")


def test_headings_on_their_own_lines_count_as_sentences():
    assert loops("USPS Management:\n\nUSPS Management:\n\nUSPS Management:\n\nUSPS")
    assert not loops("A summary that says each thing once, in a few sentences. It ends here.")
