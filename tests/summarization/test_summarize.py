"""One document through map-reduce summarization, with a fake replica: prompts fit, chunks
fan out together, statistics add up, ROUGE appears only with a reference."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.decoding.sampling import SamplingParams
from pipeline.errors import ConfigError, RowError
from pipeline.summarization.output import OUTPUT_COLUMNS, rows_to_table
from pipeline.summarization.prompts import INSTRUCTIONS
from pipeline.summarization.stage import SummarizeBatch
from pipeline.summarization.summarizer import DocumentSummarizer, SummarizeSettings, rouge
from tests.builders import sample_documents


@pytest.fixture(scope="module")
def tokenizer():
    from pipeline.model import checkpoint

    return checkpoint.load_tokenizer(checkpoint.resolve_checkpoint(None))


class FakeReplica:
    """Answers every request with a fixed sentence and plausible statistics; remembers the calls."""

    def __init__(self, tokenizer, answer: str = "The agency should improve oversight of its programs.") -> None:
        self.answer_ids = tokenizer.encode(answer, add_special_tokens=False)
        self.batches: list[list[tuple]] = []
        self.finish_reasons: dict[int, str] = {}  # by budget; default "eos"

    def generate_many(self, calls):
        self.batches.append(calls)
        return [
            {
                "token_ids": self.answer_ids,
                "finish_reason": self.finish_reasons.get(max_new, "eos"),
                "stats": {
                    "prompt_tokens": len(ids),
                    "output_tokens": len(self.answer_ids),
                    "steps": 4,
                    "drafted_tokens": 8,
                    "accepted_tokens": 6,
                    "prefill_s": 0.5,
                    "decode_s": 0.25,
                },
                "extra": {"mean_skipped_attn": 3.0, "mean_skipped_mlp": 1.0},
            }
            for ids, max_new, _ in calls
        ]


def document(doc_id: str) -> dict:
    return next(d for d in sample_documents() if d["id"] == doc_id)


def test_the_final_summary_has_its_own_budget_and_instructions_their_checks(tokenizer):
    doc = document("gao-26-107759")
    replica = FakeReplica(tokenizer)
    settings = SummarizeSettings(
        model="m", strategy="ar", max_new_tokens=48, max_summary_tokens=160, max_prompt_tokens=2048
    )
    DocumentSummarizer(tokenizer, replica.generate_many, settings).summarize(doc["id"], doc["text"])
    assert {max_new for _, max_new, _ in replica.batches[0]} == {48}  # chunks: summarized again
    assert [max_new for _, max_new, _ in replica.batches[-1]] == [160]  # the summary that is read
    short = FakeReplica(tokenizer)
    DocumentSummarizer(tokenizer, short.generate_many, settings).summarize("x", "A short note.")
    assert [max_new for _, max_new, _ in short.batches[0]] == [160]
    with pytest.raises(ConfigError, match="'summaries' instruction must contain"):
        SummarizeSettings(model="m", strategy="ar", instructions=dict(INSTRUCTIONS) | {"summaries": "no placeholder"})
    with pytest.raises(ConfigError, match="exactly"):
        SummarizeSettings(model="m", strategy="ar", instructions={"document": "{document}"})


def test_answers_end_on_a_sentence_past_a_share_of_their_budget(tokenizer):
    doc = document("gao-26-107759")
    replica = FakeReplica(tokenizer)
    replica.finish_reasons = {48: "length", 160: "trimmed"}
    settings = SummarizeSettings(
        model="m", strategy="ar", max_new_tokens=48, max_summary_tokens=160, max_prompt_tokens=2048, end_on_sentence=0.5
    )
    row = DocumentSummarizer(tokenizer, replica.generate_many, settings).summarize(doc["id"], doc["text"])
    assert {params.end_on_sentence_after for _, _, params in replica.batches[0]} == {24}  # map summaries too
    assert [params.end_on_sentence_after for _, _, params in replica.batches[-1]] == [80]
    assert row["finish_reason"] == "trimmed"  # the final summary's, not a map step's
    off = FakeReplica(tokenizer)
    settings = replace(settings, end_on_sentence=None)
    DocumentSummarizer(tokenizer, off.generate_many, settings).summarize(doc["id"], doc["text"])
    assert {params.end_on_sentence_after for batch in off.batches for _, _, params in batch} == {None}
    for share in (0.0, 1.5):
        with pytest.raises(ConfigError, match="share of the budget"):
            SummarizeSettings(model="m", strategy="ar", end_on_sentence=share)


def test_a_short_document_is_one_request(tokenizer):
    replica = FakeReplica(tokenizer)
    settings = SummarizeSettings(model="m", strategy="knapspec", max_new_tokens=32, max_prompt_tokens=4096)
    row = DocumentSummarizer(tokenizer, replica.generate_many, settings).summarize("x", "A short note.\n\nTwo lines.")
    assert len(replica.batches) == 1 and len(replica.batches[0]) == 1
    assert row["num_chunks"] == 1 and row["status"] == "ok" and row["summary"].startswith("The agency")
    assert row["rouge1"] is None and row["mean_skipped_attn"] == 3.0
    assert rows_to_table([row]).num_rows == 1  # the row matches the output schema


def test_a_long_document_is_chunked_and_reduced(tokenizer):
    doc = document("gao-26-107759")  # ~11k tokens
    replica = FakeReplica(tokenizer)
    settings = SummarizeSettings(
        model="m", strategy="ar", max_new_tokens=48, max_summary_tokens=None, max_prompt_tokens=2048
    )
    summarizer = DocumentSummarizer(tokenizer, replica.generate_many, settings)
    row = summarizer.summarize(doc["id"], doc["text"], doc["reference_summary"])

    parts, final = replica.batches[0], replica.batches[-1]
    assert len(parts) == row["num_chunks"] >= 6  # every chunk of the document in one batch
    assert len(replica.batches) == 2 and len(final) == 1
    for batch in replica.batches:
        for ids, max_new, params in batch:
            assert len(ids) <= settings.max_prompt_tokens and max_new == 48 and params.greedy
    requests = row["num_chunks"] + 1
    assert row["prompt_tokens"] == sum(len(ids) for batch in replica.batches for ids, _, _ in batch)
    assert row["output_tokens"] == requests * len(replica.answer_ids)
    assert row["steps"] == 4 * requests and row["acceptance_rate"] == pytest.approx(0.75)
    assert row["mean_accepted_len"] == pytest.approx((6 + 4) / 4)
    assert row["decode_s"] == pytest.approx(0.25 * requests)
    assert 0 < row["rouge1"] <= 1 and 0 <= row["rouge2"] <= row["rouge1"]
    assert set(row) == set(OUTPUT_COLUMNS)


def test_chunk_text_stays_in_order_and_whole(tokenizer):
    doc = document("crs-r48179")
    replica = FakeReplica(tokenizer)
    settings = SummarizeSettings(model="m", strategy="ar", max_new_tokens=32, max_prompt_tokens=1024)
    DocumentSummarizer(tokenizer, replica.generate_many, settings).summarize(doc["id"], doc["text"])
    prompts = [tokenizer.decode(ids) for ids, _, _ in replica.batches[0]]
    paragraphs = [p.strip() for p in doc["text"].split("\n\n") if p.strip()]
    # The first and last paragraphs of the document open the first and close the last chunk prompt.
    assert paragraphs[0][:80] in prompts[0] and paragraphs[-1][-80:] in prompts[-1]


def test_seeded_sampling_gives_each_request_its_own_seed(tokenizer):
    doc = document("crs-r48179")
    replica = FakeReplica(tokenizer)
    params = SamplingParams(temperature=0.7, seed=5)
    settings = SummarizeSettings(model="m", strategy="ar", max_new_tokens=32, max_prompt_tokens=1024, params=params)
    summarizer = DocumentSummarizer(tokenizer, replica.generate_many, settings)
    summarizer.summarize(doc["id"], doc["text"])
    first = [p.seed for _, _, p in replica.batches[0]]
    summarizer.summarize(doc["id"], doc["text"])
    assert len(set(first)) == len(first) and first == [p.seed for _, _, p in replica.batches[2]]


def test_no_progress_is_a_row_error(tokenizer):
    doc = document("crs-r48179")
    # A replica that ignores max_new_tokens and answers at length never shrinks the text.
    replica = FakeReplica(tokenizer, answer="word " * 1000)
    settings = SummarizeSettings(model="m", strategy="ar", max_new_tokens=200, max_prompt_tokens=900)
    with pytest.raises(RowError):
        DocumentSummarizer(tokenizer, replica.generate_many, settings).summarize(doc["id"], doc["text"])


def test_budget_too_small_for_the_answer(tokenizer):
    with pytest.raises(ConfigError, match="max_new_tokens|--max-chunk-tokens"):
        SummarizeSettings(model="m", strategy="ar", max_new_tokens=256, max_prompt_tokens=512)
    settings = SummarizeSettings(model="m", strategy="ar", max_new_tokens=32, max_prompt_tokens=140)
    with pytest.raises(ConfigError, match="--max-chunk-tokens"):
        DocumentSummarizer(tokenizer, FakeReplica(tokenizer).generate_many, settings)


def test_rouge_against_a_reference():
    assert rouge("the cat sat", None) == {"rouge1": None, "rouge2": None, "rougeL": None}
    scores = rouge("the cat sat on the mat", "the cat sat on the mat")
    assert scores == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}


def test_batch_rows_become_output_rows(tokenizer, tiny_chat_checkpoint, monkeypatch):
    """Bad rows become error rows with their reason; a failing replica fails only its document."""
    replica = FakeReplica(tokenizer)
    settings = SummarizeSettings(model="m", strategy="ar", max_new_tokens=16, max_prompt_tokens=512)
    stage = SummarizeBatch([object()], settings, str(tiny_chat_checkpoint), duplicate_ids={"dup": 2})
    stage.summarizer.generate_many = replica.generate_many

    def row(row_id, text, error=None):
        return {"id": row_id, "text": text, "reference": None, "input_error": error, "source": "t"}

    import pyarrow as pa

    batch = pa.Table.from_pylist(
        [
            row("a", "Some text to summarize."),
            row("b", "   "),
            row(None, "orphan text"),
            row("dup", "twice"),
            row("c", None, error="c.txt is not valid UTF-8"),
        ]
    )
    out = stage(batch).to_pylist()
    assert [r["status"] for r in out] == ["ok", "error", "error", "error", "error"]
    assert [r["id"] for r in out] == ["a", "b", None, "dup", "c"]
    assert out[4]["error"] == "c.txt is not valid UTF-8"
    assert all(r["error"] for r in out[1:])

    def broken(calls):
        raise RuntimeError("replica lost")

    stage.summarizer.generate_many = broken
    (failed,) = stage(pa.Table.from_pylist([row("a", "Some text.")])).to_pylist()
    assert failed["status"] == "error" and "replica lost" in failed["error"]


def test_a_row_that_is_not_utf8_fails_alone_in_the_stage():
    """A user's own dataset reaches the stage unchecked (the job's readers check theirs)."""
    import pyarrow as pa

    from pipeline.summarization.stage import batch_rows

    text = pa.Array.from_buffers(
        pa.string(), 2, [None, pa.array([0, 4, 8], pa.int32()).buffers()[1], pa.py_buffer(b"finebad\xff")]
    )
    rows = batch_rows(pa.table({"doc": ["a", "b"], "body": text}), "doc")
    assert rows[0] == {"doc": "a", "body": "fine"}
    assert rows[1] == {"doc": "b", "input_error": "a value is not valid UTF-8: invalid start byte at byte 3"}


def test_an_over_size_text_is_an_error_before_it_is_tokenized_and_a_long_document_goes_in_waves(tokenizer):
    doc = document("gao-26-107759")  # ~11k tokens: 6+ chunks of 2048
    replica = FakeReplica(tokenizer)
    settings = SummarizeSettings(
        model="m", strategy="ar", max_new_tokens=48, max_prompt_tokens=2048, max_requests_in_flight=4
    )
    row = DocumentSummarizer(tokenizer, replica.generate_many, settings).summarize(doc["id"], doc["text"])
    assert row["num_chunks"] >= 6 and max(len(batch) for batch in replica.batches) == 4
    small = replace(settings, max_document_bytes=len(doc["text"].encode()) - 1)
    with pytest.raises(RowError, match=f"more than the limit of {len(doc['text'].encode()) - 1:,}"):
        DocumentSummarizer(tokenizer, replica.generate_many, small).summarize(doc["id"], doc["text"])
    with pytest.raises(ConfigError, match="max_document_bytes"):
        replace(settings, max_document_bytes=0)
