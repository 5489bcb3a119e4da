"""End to end as on a cluster: `ray start --head` on 127.0.0.1, `ray job submit --working-dir .`
of jobs/summarize.py on a Parquet input with bad rows, one output row per input row."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.summarization.output import read_output
from tests.builders import REPO, sample_documents

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Keep Ray on the loopback interface; token authentication would block `ray job submit` there.
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    # The head is stopped once its job has finished: nothing to drain (Ray waits up to 30 s).
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    # `python` in the job's entrypoint must be this interpreter, with this project installed.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def ray_cli() -> list[str]:
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def wait_for_dashboard(port: int, head: subprocess.Popen, timeout: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start --head exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError("the Ray dashboard (job server) did not come up")


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head on 127.0.0.1 in the foreground (`--block`), so that stopping it stops exactly
    the processes it started, not every Ray on the machine. Its files, the address `ray start`
    records for later `ray.init()` calls among them, stay in a folder of its own: a job another
    test starts meanwhile must not join this cluster (nor one stopped without `ray stop`)."""
    gcs_port, dashboard_port = free_port(), free_port()
    log = (tmp_path / "head.log").open("w")
    # Short: Ray's sockets live under it, and a socket's path has at most 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ray-head-", dir="/tmp")
    head = subprocess.Popen(
        [*ray_cli(), "start", "--head", "--block", f"--port={gcs_port}", "--node-ip-address=127.0.0.1",
         f"--temp-dir={temp_dir}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", "--num-cpus=2",
         "--disable-usage-stats", "--include-dashboard=true"],
        env=cluster_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_dashboard(dashboard_port, head)
        yield f"http://127.0.0.1:{dashboard_port}"
    finally:
        # The head alone first: it drains its node through its GCS and stops what it started (a
        # SIGTERM to the whole group killed the GCS under it, and the drain waited 30 s for it).
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of its session is left
        except ProcessLookupError:
            pass
        head.wait()
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_summarizes_every_row(ray_head, tiny_chat_checkpoint, tmp_path):
    docs = sample_documents()
    rows = [
        {"id": docs[2]["id"], "text": docs[2]["text"][:6000], "reference_summary": docs[2]["reference_summary"]},
        {"id": docs[4]["id"], "text": docs[4]["text"][:1500], "reference_summary": docs[4]["reference_summary"]},
        {"id": "empty", "text": "", "reference_summary": None},
        {"id": None, "text": "No id here.", "reference_summary": None},
    ]
    input_path = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), input_path)
    out = tmp_path / "out"

    # (two of four rows fail on purpose)
    command = [*ray_cli(), "job", "submit", "--address", ray_head, "--working-dir", str(REPO), "--",
               "python", "jobs/summarize.py", "--input", str(input_path), "--output", str(out),
               "--model", str(tiny_chat_checkpoint), "--max-new-tokens", "16", "--max-summary-tokens", "16",
               "--max-chunk-tokens", "512", "--max-error-fraction", "1"]  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        submit = subprocess.run(command, env=cluster_env(), capture_output=True, text=True, timeout=900)
        # The dashboard answers before the head's agent, which takes the job, has registered
        # (slower on a busy machine): the submission is refused, and taken once it has.
        if "No available agent to submit job" not in submit.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-2000:]
    assert "succeeded" in submit.stdout, submit.stdout[-4000:]

    table = read_output(out / "summaries.parquet")
    assert table.num_rows == len(rows)
    statuses = sorted(zip(map(str, table.column("id").to_pylist()), table.column("status").to_pylist()))
    assert statuses == sorted([(docs[2]["id"], "ok"), (docs[4]["id"], "ok"), ("empty", "error"), ("None", "error")])
    assert "| 4 | 2 | 2 |" in submit.stdout
