"""jobs/summarize.py as a user runs it: a local Ray cluster, Ray Data, replicas, Parquet out.

Most runs use a tiny random model with the embedded model's real tokenizer, so that the whole
path (read, validate, chunk, prompt, generate, decode, write) runs in seconds; one run uses
the real embedded model on a bundled document.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.decoding.stopping import FINISH_REASONS
from pipeline.summarization.output import OUTPUT_SCHEMA, part_files, read_output
from pipeline.summarization.quality import ends_on_sentence, repetitions
from tests.builders import REPO, sample_documents
from tests.processes import descendants

pytestmark = pytest.mark.ray

SCRIPT = REPO / "jobs" / "summarize.py"
OUTPUT_NAME = "summaries.parquet"


def job_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def run_job(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=job_env(), cwd=REPO,
    )


def excerpt(text: str, paragraphs: int) -> str:
    return "\n\n".join(p for p in text.split("\n\n") if p.strip())[: 600 * paragraphs]


@pytest.fixture(scope="module")
def bad_rows_parquet(tmp_path_factory) -> tuple[Path, list[dict]]:
    docs = sample_documents()
    rows = [
        {"id": "short", "text": "The committee met on Tuesday.\n\nIt approved the budget.", "reference_summary": None},
        {"id": docs[1]["id"], "text": excerpt(docs[1]["text"], 8), "reference_summary": docs[1]["reference_summary"]},
        {"id": docs[3]["id"], "text": excerpt(docs[3]["text"], 2), "reference_summary": docs[3]["reference_summary"]},
        {"id": "empty", "text": "", "reference_summary": None},
        {"id": "blank", "text": "  \n\t ", "reference_summary": None},
        {"id": None, "text": "A document without an id.", "reference_summary": None},
        {"id": "twice", "text": "First copy.", "reference_summary": None},
        {"id": "twice", "text": "Second copy.", "reference_summary": None},
    ]
    path = tmp_path_factory.mktemp("input") / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path, rows


# What both runs over the bad rows share; fp32, so that batches and pipeline stages give the same tokens.
BAD_ROWS_ARGS = ["--max-new-tokens", "16", "--max-summary-tokens", "16", "--max-chunk-tokens", "512",
                 "--strategy", "ar", "--dtype", "fp32", "--threads-per-replica", "1",
                 "--max-error-fraction", "1"]  # fmt: skip  # five of the eight rows fail on purpose


@pytest.fixture(scope="module")
def two_replicas_run(bad_rows_parquet, tiny_chat_checkpoint, tmp_path_factory):
    """The bad rows through two single-process replicas, each decoding its requests in batches of four."""
    out = tmp_path_factory.mktemp("two-replicas")
    result = run_job("--input", bad_rows_parquet[0], "--output", out, "--model", tiny_chat_checkpoint,
                     *BAD_ROWS_ARGS, "--replicas", "2", "--max-batch", "4")  # fmt: skip
    return result, out


def test_one_output_row_per_input_row(bad_rows_parquet, two_replicas_run):
    (_, rows), (result, folder) = bad_rows_parquet, two_replicas_run
    assert result.returncode == 0, result.stderr[-3000:]

    table = read_output(folder / OUTPUT_NAME)
    assert table.schema == OUTPUT_SCHEMA and table.num_rows == len(rows)
    assert len(part_files(folder / OUTPUT_NAME)) == 1  # the documents' parts merged at the end
    out = sorted(table.to_pylist(), key=lambda r: (str(r["id"]), r["error"] or ""))
    by_id = {}
    for row in out:
        by_id.setdefault(row["id"], []).append(row)
    for good in ("short", rows[1]["id"], rows[2]["id"]):
        (row,) = by_id[good]
        assert row["status"] == "ok" and row["summary"] and row["error"] is None, row
        assert row["output_tokens"] > 0 and row["prompt_tokens"] > 0 and row["finished_at"] is not None
        assert row["finish_reason"] in FINISH_REASONS
    assert by_id["short"][0]["num_chunks"] == 1 and by_id["short"][0]["rouge1"] is None
    long_row = by_id[rows[1]["id"]][0]
    assert long_row["num_chunks"] >= 3 and long_row["rouge1"] is not None
    assert by_id["empty"][0]["error"] == "text is empty" and "whitespace" in by_id["blank"][0]["error"]
    assert "id" in by_id[None][0]["error"]
    assert [r["status"] for r in by_id["twice"]] == ["error", "error"]
    assert all("2 times" in r["error"] or "more than once" in r["error"] for r in by_id["twice"])
    # The closing table: 8 rows, 3 ok, 5 errors.
    assert "| 8 | 3 | 5 |" in result.stdout, result.stdout
    # Progress: one line per finished document, counted against the 8 rows.
    lines = [line for line in result.stdout.splitlines() if line.startswith("[") and "/8] " in line]
    assert sorted(int(line[1 : line.index("/")]) for line in lines) == list(range(1, 9)), result.stdout
    assert any(" short ok, 1 chunk(s)" in line for line in lines)
    assert any(" empty error: text is empty" in line for line in lines)
    assert all("requests in flight" in line and "tokens/s generated" in line for line in lines)
    # The replicas' own account: their busy time, and every chunk and reduce request they served.
    usage = re.search(r"2 replicas busy \d+ s each: [\d.]+ tokens/s generated, [\d.]+ documents per hour "
                      r"\(per replica, prefill included; (\d+) requests\)", result.stdout)
    assert usage, result.stdout
    assert int(usage.group(1)) >= sum(r["num_chunks"] for r in out if r["status"] == "ok")


def test_resume_after_a_killed_run_writes_each_id_once(tiny_chat_checkpoint, tmp_path):
    docs = sample_documents()
    rows = [{"id": f"doc-{i}", "text": excerpt(docs[i % len(docs)]["text"], 3 + i % 4)} for i in range(12)]
    rows.append({"id": "empty", "text": ""})
    input_path = tmp_path / "docs.jsonl"
    pa_rows = pa.Table.from_pylist(rows).to_pandas()
    pa_rows.to_json(input_path, orient="records", lines=True)
    out = tmp_path / "out"
    args = ["--input", input_path, "--output", out, "--model", tiny_chat_checkpoint, "--max-new-tokens", "24",
            "--max-summary-tokens", "24", "--max-chunk-tokens", "384", "--strategy", "ar",
            "--documents-in-flight", "1"]

    job = subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args)], env=job_env(), cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list((out / OUTPUT_NAME).glob("*.parquet")) and time.monotonic() < deadline:
            assert job.poll() is None, "the job ended before it wrote anything"
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    written = read_output(out / OUTPUT_NAME).num_rows
    assert 0 < written < len(rows), f"the kill came too late to interrupt the run ({written} rows)"

    result = run_job(*args, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    table = read_output(out / OUTPUT_NAME)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(r["id"] for r in rows)  # every id exactly once
    statuses = dict(zip(ids, table.column("status").to_pylist()))
    assert statuses.pop("empty") == "error" and set(statuses.values()) == {"ok"}

    # A second resume has nothing left but the error row, which it retries in place.
    result = run_job(*args, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(read_output(out / OUTPUT_NAME).column("id").to_pylist()) == sorted(r["id"] for r in rows)


def _summarize_actor_pids(job: subprocess.Popen) -> list[int]:
    return descendants(job.pid, "MapWorker(MapBatches(SummarizeBatch))")


def test_a_killed_summarize_actor_is_restarted_and_every_row_written_once(tiny_chat_checkpoint, tmp_path):
    """Ray Data restarts the stage's actor from its constructor arguments (which Ray logs an
    ERROR line about: ray-project/ray#57733): the restarted actor finds the replicas by name,
    its documents are redone, and the run writes each row once."""
    docs = sample_documents()
    rows = [{"id": f"doc-{i}", "text": excerpt(docs[i % len(docs)]["text"], 3 + i % 3)} for i in range(8)]
    input_path = tmp_path / "docs.jsonl"
    pa.Table.from_pylist(rows).to_pandas().to_json(input_path, orient="records", lines=True)
    out = tmp_path / "out"
    args = ["--input", input_path, "--output", out, "--model", tiny_chat_checkpoint, "--max-new-tokens", "24",
            "--max-summary-tokens", "24", "--max-chunk-tokens", "384", "--strategy", "ar",
            "--documents-in-flight", "2"]  # fmt: skip
    job = subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args)], env=job_env(), cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)  # fmt: skip
    try:
        killed = None
        for line in job.stdout:  # the first finished document: the stage's actor is at work
            if line.startswith("[1/8]"):
                (killed,) = _summarize_actor_pids(job)
                os.kill(killed, signal.SIGKILL)
                break
        rest = job.stdout.read()
        assert job.wait(timeout=600) == 0, rest[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert killed is not None, "no document finished"
    ids = read_output(out / OUTPUT_NAME).column("id").to_pylist()
    assert sorted(ids) == sorted(r["id"] for r in rows)  # every row exactly once
    assert "| 8 | 8 | 0 |" in rest


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input", "no/such/file.parquet"], "does not exist"),
        (["--input", "README.md"], "unknown format"),
        (["--text-column", "body"], "body"),
        (["--tensor-parallel", "2"], "does not divide the model's 9 attention heads"),  # SmolLM2
        (["--resume", "--overwrite"], "exclude each other"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_bad_arguments_stop_before_any_work(args, message, tmp_path):
    result = run_job("--output", tmp_path / "out", *args, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr  # one line
    assert not (tmp_path / "out" / OUTPUT_NAME).exists()


def test_a_replica_no_node_can_hold_is_refused_before_any_starts_with_the_figure(tmp_path):
    # SmolLM2 with a KV pool of 20,000 slots of the longest request: terabytes, on no node.
    result = run_job("--output", tmp_path / "out", "--max-batch", "20000", timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: a replica needs \d+\.\d\d GiB \(weights 0\.\d\d GiB, KV pool \d+\.\d\d GiB, .*\) of memory, "
        r"but the largest node offers Ray \d+\.\d\d GiB; lower --max-batch or --max-chunk-tokens, .*",
        last,
    ), last
    assert "Replica ready" not in result.stderr and not (tmp_path / "out" / OUTPUT_NAME).exists()


def test_ids_missing_from_the_input_are_named(tmp_path):
    result = run_job("--output", tmp_path / "out", "--ids", "rfc3986,no-such-doc", timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].endswith("sample.jsonl: no-such-doc"), result.stderr[-3000:]
    assert not (tmp_path / "out" / OUTPUT_NAME).exists()


def test_an_earlier_output_is_not_overwritten_silently(tmp_path):
    from pipeline.summarization.output import rows_to_table, write_part
    from tests.summarization.test_output import ok_row

    write_part(tmp_path / OUTPUT_NAME, rows_to_table([ok_row("a")]))
    result = run_job("--output", tmp_path, timeout=120)
    assert result.returncode == 2 and "--resume" in result.stderr and "--overwrite" in result.stderr


def test_pipeline_parallel_replicas_write_the_same_summaries(
    bad_rows_parquet, tiny_chat_checkpoint, two_replicas_run, tmp_path
):
    """Two replicas of two pipeline stages each (stage actors holding half the layers), one
    request at a time per stage, give the summaries of single-process replicas decoding their
    requests in batches of four, token for token."""
    single, single_out = two_replicas_run
    piped = run_job("--input", bad_rows_parquet[0], "--output", tmp_path / "piped", "--model", tiny_chat_checkpoint,
                    *BAD_ROWS_ARGS, "--pipeline-parallel", "2", "--replicas", "2")  # fmt: skip
    assert single.returncode == 0 and piped.returncode == 0, piped.stderr[-3000:]

    def summaries(folder):
        table = read_output(folder / OUTPUT_NAME)
        return sorted(zip(map(str, table.column("id").to_pylist()), map(str, table.column("summary").to_pylist())))

    assert summaries(tmp_path / "piped") == summaries(single_out)
    assert sum(1 for _, s in summaries(single_out) if s != "None") == 3
    # The coordinators give their account too (each declares the runtime alone).
    assert "2 replicas busy" in piped.stdout and "gave no usage" not in piped.stderr, piped.stderr[-3000:]


@pytest.mark.slow
def test_default_run_on_a_bundled_document(tmp_path):
    """The no-argument job (embedded model, bundled documents, default strategy), reduced to one
    document and short map answers; the final summary's budget and sentence rule are the defaults."""
    result = run_job("--output", tmp_path, "--ids", "gao-26-109008", "--max-new-tokens", "24",
                     "--max-chunk-tokens", "2048")
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = read_output(tmp_path / OUTPUT_NAME).to_pylist()
    assert row["status"] == "ok" and row["strategy"] == "knapspec-lookup", row
    assert row["num_chunks"] >= 3 and row["rouge1"] > 0 and len(row["summary"].split()) > 5
    assert not repetitions(row["summary"]), row["summary"]  # the default repetition control holds
    # It ends on a sentence, or its column says why not.
    assert ends_on_sentence(row["summary"]) or row["finish_reason"] in ("eos", "length"), row
    assert "| 1 | 1 | 0 |" in result.stdout
    # A log a person reads (output not a terminal): none of Ray's and Ray Data's chatter
    # (job_cli.RAY_CHATTER), which `--verbose` brings back.
    for chatter in ("Running Dataset", "Execution plan of Dataset", "Started a local Ray instance",
                    "Token authentication is enabled", "Using default tokenizer"):  # fmt: skip
        assert chatter not in result.stderr, chatter
    # The replica's peak stayed within what it declared to Ray, and not far below it.
    memory = re.search(r"peak memory ([\d.]+) GiB of ([\d.]+) GiB declared", result.stdout)
    assert memory, result.stdout
    peak, declared = map(float, memory.groups())
    assert 0.75 * declared <= peak <= declared and "passed what it declared" not in result.stderr, memory.group(0)
