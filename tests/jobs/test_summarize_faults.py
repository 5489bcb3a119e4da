"""The job under inputs and outputs that broke it: each row accounted for once, the job going on.

Each test runs the real job (a local Ray cluster on 127.0.0.1, the tiny chat model) on a case
that failed the whole job before it was handled."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.summarization.output import read_output
from tests.jobs.test_summarize_job import OUTPUT_NAME, run_job

pytestmark = pytest.mark.ray

FAST = ["--max-new-tokens", "8", "--max-summary-tokens", "8", "--max-chunk-tokens", "256", "--strategy", "ar",
        "--threads-per-replica", "1"]  # fmt: skip


def rows_by_id(folder: Path) -> dict[str, dict]:
    rows = read_output(folder / OUTPUT_NAME).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), ids  # no id written twice
    return {r["id"]: r for r in rows}


def test_lone_surrogates_in_jsonl_fail_their_rows_only_and_a_torn_part_does_not_stop_resume(
    tiny_chat_checkpoint, tmp_path
):
    path = tmp_path / "docs.jsonl"
    path.write_text(
        '{"id": "good", "text": "The committee met on Tuesday. It approved the budget."}\n'
        '{"id": "bad-text", "text": "Half an emoji: \\ud83d. The rest is fine."}\n'
        '{"id": "bad-id-\\ud83d", "text": "A fine text."}\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    (out / OUTPUT_NAME).mkdir(parents=True)
    (out / OUTPUT_NAME / "part-torn.parquet").write_bytes(b"")  # what a crash before a sync leaves
    result = run_job("--input", path, "--output", out, "--model", tiny_chat_checkpoint, "--resume", *FAST)
    # Every row written; two of three failed by their input, more than the default tenth: status 1.
    assert result.returncode == 1, result.stderr[-3000:]
    verdict = (
        "1 rows ok, 2 failed by their input, 0 failed by the infrastructure: "
        "more than --max-error-fraction=0.1 of the rows failed"
    )
    assert verdict in result.stdout.splitlines(), result.stdout[-3000:]
    rows = rows_by_id(out)
    assert set(rows) == {"good", "bad-text", "bad-id-\\ud83d"}  # one row per input row
    assert rows["good"]["status"] == "ok"
    assert rows["bad-text"]["error_kind"] == rows["bad-id-\\ud83d"]["error_kind"] == "input"
    assert rows["bad-text"]["error"] == "docs.jsonl:2: text holds a lone surrogate ('\\ud83d') at character 15"
    assert "id holds a lone surrogate" in rows["bad-id-\\ud83d"]["error"]
    assert "unreadable part part-torn.parquet" in result.stderr
    assert (out / OUTPUT_NAME / "_part-torn.parquet.unreadable").exists()


def test_invalid_utf8_and_an_over_size_text_in_parquet_fail_their_rows_only(tiny_chat_checkpoint, tmp_path):
    texts = [b"The committee met on Tuesday.", b"caf\xe9 au lait, and more", b"It approved the budget."]
    offsets = pa.array([0, *[sum(map(len, texts[: i + 1])) for i in range(3)]], pa.int32()).buffers()[1]
    text = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"".join(texts))])
    path = tmp_path / "docs.parquet"
    table = pa.table({"id": ["a", "b", "c"], "text": text})
    table = pa.concat_tables([table, pa.table({"id": ["big"], "text": ["A sentence of a long text. " * 20]})])
    pq.write_table(table, path)
    out = tmp_path / "out"
    result = run_job("--input", path, "--output", out, "--model", tiny_chat_checkpoint, *FAST,
                     "--max-document-bytes", "500", "--max-error-fraction", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_by_id(out)
    assert [rows[i]["status"] for i in ("a", "b", "c", "big")] == ["ok", "error", "ok", "error"]
    assert rows["big"]["error"] == "the text is 540 bytes, more than the limit of 500 (--max-document-bytes)"
    assert (
        rows["b"]["error"]
        == "docs.parquet row 1: text is not valid UTF-8: byte 0xe9 at offset 3: invalid continuation byte"
    )


def test_a_second_run_on_one_output_is_refused(tiny_chat_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # A run in progress on this host: the lock names a live process (this one).
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": "2026-12-05T10:00:00+00:00"}
    (out / f".{OUTPUT_NAME}.lock").write_text(json.dumps(holder))
    result = run_job("--output", out, "--resume", "--model", tiny_chat_checkpoint, *FAST, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]  # one line, after the input's log line
    assert last.startswith("error: output") and f"is in use by another run (process {os.getpid()} on" in last
    assert not (out / OUTPUT_NAME).exists()


def test_an_output_uri_is_refused_in_one_line():
    """It silently became a local folder `s3:`."""
    result = run_job("--output", "s3://bucket/summaries", timeout=120)
    assert result.returncode == 2 and "'s3://bucket/summaries' is a URI" in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0
