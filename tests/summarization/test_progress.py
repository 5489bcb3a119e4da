"""The run's progress as a person reads it: counts, requests in flight, rate and time left."""

from __future__ import annotations

from pipeline.summarization.progress import ProgressTally, document_line, status_line


def test_a_tally_counts_documents_failures_and_requests_in_flight():
    tally = ProgressTally(started=0.0)
    tally.requests(+3)
    tally.document({"id": "a", "status": "ok", "num_chunks": 2, "output_tokens": 100, "seconds": 12.0})
    tally.requests(-2)
    tally.document({"id": "b", "status": "error", "error": "text is empty", "output_tokens": None})
    first = tally.snapshot()
    assert (first["done"], first["failed"], first["in_flight"], first["output_tokens"]) == (2, 1, 1, 100)
    assert [r["id"] for r in tally.snapshot(since=1)["finished"]] == ["b"]


def test_lines_say_what_finished_and_what_is_left():
    snapshot = {"done": 2, "failed": 1, "in_flight": 4, "output_tokens": 300, "elapsed_s": 60.0, "finished": []}
    ok = {"id": "a", "status": "ok", "num_chunks": 3, "output_tokens": 192, "seconds": 41.2}
    assert document_line(ok, snapshot, 2, 10) == (
        "[2/10] a ok, 3 chunk(s), 192 tokens in 41 s · 1 failed · 4 requests in flight · "
        "5.0 tokens/s generated · ~4 min left"
    )
    failed = {"id": "b", "status": "error", "error": "text is empty"}
    assert document_line(failed, snapshot, 2, None).startswith("[2] b error: text is empty · ")
    assert "left" not in status_line(snapshot, None)  # no total, no estimate
    assert status_line(snapshot | {"elapsed_s": 7200.0}, 10).endswith("~8.0 h left")
