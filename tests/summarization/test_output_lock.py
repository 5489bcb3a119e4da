"""One writer per output folder: the lock names its run, and a stale one is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from pipeline.errors import ConfigError
from pipeline.summarization.output_lock import OutputLock


def test_a_second_run_is_refused_while_the_first_holds_the_folder(tmp_path):
    folder = tmp_path / "summaries.parquet"
    with OutputLock(folder) as first:
        assert json.loads(first.path.read_text())["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=f"in use by another run \\(process {os.getpid()} on "):
            OutputLock(folder).acquire()
    assert not first.path.exists()  # given back
    assert not folder.exists()  # the lock lives beside the folder, and makes none


def test_a_stale_lock_is_reported_and_taken_over(tmp_path, caplog):
    folder = tmp_path / "summaries.parquet"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    lock = OutputLock(folder)
    lock.path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid, "started": "earlier"}))
    with caplog.at_level("WARNING"), lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert f"left by process {dead_pid}" in caplog.text and "which is gone" in caplog.text


def test_a_lock_held_on_another_host_is_refused(tmp_path):
    lock = OutputLock(tmp_path / "summaries.parquet")
    lock.path.write_text(json.dumps({"host": "another-node", "pid": 1, "started": "earlier"}))
    with pytest.raises(ConfigError, match="process 1 on another-node"):
        lock.acquire()
    lock.release()  # not ours: left alone
    assert lock.path.exists()
