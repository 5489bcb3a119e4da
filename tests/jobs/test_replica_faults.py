"""The real job with replicas that are killed, stopped, or killed by one request: every input
row is written once, and only the request at fault fails (a local Ray cluster on 127.0.0.1,
two replicas of the tiny chat model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

from tests.actors.test_replicas import fault_env
from tests.builders import REPO, sample_documents
from tests.jobs.test_summarize_faults import rows_by_id
from tests.jobs.test_summarize_job import SCRIPT, excerpt, job_env
from tests.processes import descendants

pytestmark = pytest.mark.ray

ARGS = ["--max-new-tokens", "24", "--max-summary-tokens", "24", "--max-chunk-tokens", "384", "--strategy", "ar",
        "--threads-per-replica", "1", "--replicas", "2", "--max-batch", "4"]  # fmt: skip


def write_docs(path, count: int, extra: list[dict] = ()) -> list[dict]:
    docs = sample_documents()
    rows = [{"id": f"doc-{i}", "text": excerpt(docs[i % len(docs)]["text"], 2 + i % 3)} for i in range(count)]
    rows += list(extra)
    pa.Table.from_pylist(rows).to_pandas().to_json(path, orient="records", lines=True)
    return rows


def replica_pids(job: subprocess.Popen) -> list[int]:
    # "ray::EngineReplica" at first, "ray::<actor name>:EngineReplica.__init__" while it restarts.
    return descendants(job.pid, "ray::", "EngineReplica")


def start_job(args: list, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args)], env=job_env() | (env or {}), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def finish(job: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    try:
        out, err = job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, out, err


def test_a_request_that_kills_its_replica_every_time_is_one_error_row(tiny_chat_checkpoint, tmp_path):
    from pipeline.model import checkpoint

    tokenizer = checkpoint.load_tokenizer(tiny_chat_checkpoint)
    poison_text = "Quixotic xylophonists zigzagged. The end."
    rows = write_docs(tmp_path / "docs.jsonl", 5, [{"id": "poison", "text": poison_text}])
    others = {t for r in rows[:-1] for t in tokenizer.encode(r["text"])}
    (token,) = [t for t in tokenizer.encode(" xylophonists")[:1] if t not in others]
    out = tmp_path / "out"
    job = start_job(["--input", tmp_path / "docs.jsonl", "--output", out, "--model", tiny_chat_checkpoint, *ARGS,
                     "--max-error-fraction", "1"], fault_env({"kill_on_token": token}))  # fmt: skip
    code, _, stderr = finish(job)
    assert code == 0, stderr[-3000:]
    by_id = rows_by_id(out)
    assert set(by_id) == {r["id"] for r in rows}  # one row per input row, none twice
    assert by_id["poison"]["status"] == "error" and by_id["poison"]["error_kind"] == "input"
    assert "killed its replica" in by_id["poison"]["error"]
    assert all(by_id[r["id"]]["status"] == "ok" for r in rows[:-1])


def test_a_replica_killed_again_and_again_loses_no_row(tiny_chat_checkpoint, tmp_path):
    rows = write_docs(tmp_path / "docs.jsonl", 48)
    out = tmp_path / "out"
    job = start_job(["--input", tmp_path / "docs.jsonl", "--output", out, "--model", tiny_chat_checkpoint, *ARGS,
                     "--max-new-tokens", "64", "--max-summary-tokens", "64"])  # fmt: skip
    kills = []

    def kill_one_replica_three_times() -> None:
        """The first replica, then each process that restarts in its place: the other survives."""
        first = replica_pids(job)
        seen, victim = set(first), first[0]
        while len(kills) < 3 and job.poll() is None:
            if victim is not None:
                time.sleep(0.2)  # let it take requests
                if job.poll() is not None:
                    return
                os.kill(victim, signal.SIGKILL)
                kills.append(victim)
                victim = None
            fresh = set(replica_pids(job)) - seen
            if fresh:
                seen |= fresh
                victim = max(fresh)
            time.sleep(0.1)

    for line in job.stdout:  # the first finished document: both replicas are up and at work
        if line.startswith("[1/48]"):
            break
    killer = threading.Thread(target=kill_one_replica_three_times)
    killer.start()
    code, _, stderr = finish(job)
    killer.join()
    assert len(kills) >= 2, f"the run ended after {len(kills)} kill(s)"
    assert code == 0, stderr[-3000:]
    by_id = rows_by_id(out)
    assert set(by_id) == {r["id"] for r in rows}
    assert all(row["status"] == "ok" for row in by_id.values()), [r["error"] for r in by_id.values()]


def test_a_replica_stopped_past_the_timeout_has_its_requests_finished_elsewhere(tiny_chat_checkpoint, tmp_path):
    rows = write_docs(tmp_path / "docs.jsonl", 16)
    out, marker = tmp_path / "out", tmp_path / "stopped.pid"
    # A replica stops itself at its third request, mid-run however fast the run goes; two documents at a
    # time, so most are sent after the stop, and the stopped replica is sent its share before it is judged hung.
    job = start_job(["--input", tmp_path / "docs.jsonl", "--output", out, "--model", tiny_chat_checkpoint, *ARGS,
                     "--documents-in-flight", "2", "--request-timeout", "8", "--request-timeout-per-token", "0"],
                    fault_env({"stop_once": str(marker), "stop_after": 2}))  # fmt: skip

    def stopped() -> int | None:
        return int(marker.read_text()) if marker.exists() and marker.read_text() else None

    seen = []

    def watch_stderr() -> None:
        """Once the replica is judged hung, let it go on: it must rejoin, and the job must end."""
        for line in job.stderr:
            seen.append(line)
            if "judged hung" in line and stopped() is not None:
                os.kill(stopped(), signal.SIGCONT)

    watcher = threading.Thread(target=watch_stderr)
    watcher.start()
    try:
        job.stdout.read()
        code = job.wait(timeout=600)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        if stopped() is not None:
            try:
                os.kill(stopped(), signal.SIGCONT)
            except ProcessLookupError:
                pass  # the job's shutdown killed it
    watcher.join()
    stderr = "".join(seen)
    assert stopped() is not None, "no replica reached its third request"
    assert code == 0, stderr[-3000:]
    assert "judged hung" in stderr, stderr[-3000:]
    by_id = rows_by_id(out)
    assert set(by_id) == {r["id"] for r in rows}
    assert all(row["status"] == "ok" for row in by_id.values()), [r["error"] for r in by_id.values()]
