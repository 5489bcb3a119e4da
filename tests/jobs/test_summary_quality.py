"""jobs/summary_quality.py: settings as a user writes them, and the table of a sweep."""

from __future__ import annotations

import pytest

from tests.builders import load_job

quality = load_job("summary_quality.py", "summary_quality")


def test_settings_parse_as_written():
    assert quality.parse_setting("off") == quality.Setting("off")
    off = quality.parse_setting("off,reduce=previous")
    assert (off.no_repeat_ngram_size, off.repetition_penalty, off.reduce) == (0, 1.0, "previous")
    s = quality.parse_setting("ngram=3,penalty=1.1,scope=all,final=192,sentence=0.9")
    assert (s.no_repeat_ngram_size, s.repetition_penalty, s.repetition_scope, s.final) == (3, 1.1, "all", 192)
    assert s.sentence == 0.9 and quality.parse_setting("ngram=3,sentence=off").sentence is None
    for bad, message in (("ngram", "KEY=VALUE"), ("size=3", "unknown size"), ("reduce=nope", "reduce must be")):
        with pytest.raises(ValueError, match=message):
            quality.parse_setting(bad)


def test_the_table_counts_loops_and_endings_and_averages_rouge_where_there_is_a_reference():
    rows = [
        {"setting": "a", "id": "x", "loops": True, "rouge1": 0.2, "rouge2": 0.1, "rougeL": 0.1,
         "ends_on_sentence": True, "finish_reason": "sentence", "words": 40},
        {"setting": "a", "id": "y", "loops": False, "rouge1": None, "rouge2": None, "rougeL": None,
         "ends_on_sentence": False, "finish_reason": "length", "words": 60},
    ]  # fmt: skip
    (row,) = quality.summary_table(rows, ["a"], {"a": {"prefill": 12.0, "decode": 3.0}})
    assert (row["looping"], row["looping_ids"], row["rouge1"], row["ends_on_sentence"]) == (1, ["x"], 0.2, 1)
    assert (row["finish_reasons"], row["mean_words"], row["decode_s"]) == ({"sentence": 1, "length": 1}, 50, 3.0)
    line = "| a | 0.200 | 0.100 | 0.100 | 1 / 2 | 1 / 2 | length 1, sentence 1 | 50 | 12 | 3 |"
    assert line in quality.format_table([row], 2)
