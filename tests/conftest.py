"""Shared fixtures: tiny random checkpoints saved as safetensors, and the real embedded model."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# Ray reads this once, when it is imported: every cluster a test starts stays on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Under pytest-xdist (`make test` runs two workers), the cores are shared out between workers:
# two workers of two OpenMP threads each on 2 cores spin waiting for each other's threads (a
# real-model test ran 2.6 times slower). What a test or job runs in its own processes (Ray
# actors, CLIs) inherits the share unless it sets its threads itself.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

# A job runs as a script, its folder first on the path, and imports the module the jobs share
# (job_cli) by its bare name: jobs/ is a folder of scripts, not a package. The tests load the
# scripts as modules and use that module too, so they need the folder on the path as well;
# appended, so that no script's name can hide an installed module.
sys.path.append(str(Path(__file__).resolve().parent.parent / "jobs"))

from job_cli import CALIBRATION_DIR_ENV  # noqa: E402
from tests.builders import TINY_FAMILIES, make_tiny_chat_checkpoint, make_tiny_checkpoint  # noqa: E402

# Latency tables the tests measure (cut-short sweeps on a loaded machine) go to a store of the
# run's own, never to the user's: a benchmark run after the tests planned from a table of theirs.
# The jobs the tests start read it from the environment; a test building an engine or a replica
# itself passes `calibration_store`. One store for the run: measured once, shared.
_CALIBRATION_STORE = tempfile.TemporaryDirectory(prefix="knapspec-test-calibration-")
os.environ[CALIBRATION_DIR_ENV] = _CALIBRATION_STORE.name


@pytest.fixture(scope="session")
def calibration_store() -> Path:
    return Path(_CALIBRATION_STORE.name)


@pytest.fixture(scope="session", params=sorted(TINY_FAMILIES))
def tiny_checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_deep_llama(tmp_path_factory) -> Path:
    """Eight layers, four of them nearly redundant: draft subsets can agree with the full model."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-deep-llama"), "llama", num_hidden_layers=8, quiet_layers=(2, 3, 4, 5)
    )


@pytest.fixture(scope="session")
def embedded_engine_fp32():
    from pipeline.engine import Engine, EngineConfig

    return Engine(EngineConfig(dtype="fp32"))


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))
