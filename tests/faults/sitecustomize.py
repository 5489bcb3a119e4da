"""Faults on purpose in a replica's process, for the tests of the job under faults.

A process started with this folder on PYTHONPATH imports this module first (Python's
`sitecustomize`), and, when it imports `actors.replica`, wraps EngineReplica.generate with the
faults that `KNAPSPEC_FAULTS` (JSON) asks for:

- `{"kill_on_token": T}`: the process is SIGKILLed whenever a prompt holding token id T
  reaches it (a request that crashes its replica every time: a poison pill);
- `{"device_fault_once": PATH}`: the first request raises DeviceFault (a sticky device error)
  inside the replica's own error handling and creates PATH; later ones run normally;
- `{"stop_once": PATH, "stop_after": N}`: the first replica process to reach its request N+1
  writes its pid to PATH and stops itself (SIGSTOP) with that request in flight, once in the
  whole run: a replica that hangs mid-run, at a point that no race with the run's speed moves.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

FAULTS = json.loads(os.environ.get("KNAPSPEC_FAULTS") or "{}")
_served = 0  # requests that reached this process


def _stop_once(path: str) -> None:
    try:  # O_EXCL: of two replicas reaching the point together, one stops
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _faulty(generate):
    def wrapped(self, prompt_ids, max_new_tokens, params):
        global _served
        _served += 1
        if FAULTS.get("stop_once") and _served > FAULTS.get("stop_after", 0):
            _stop_once(FAULTS["stop_once"])
        if FAULTS.get("kill_on_token") in prompt_ids:
            os.kill(os.getpid(), signal.SIGKILL)
        once = FAULTS.get("device_fault_once")
        if once is not None and not Path(once).exists():
            Path(once).touch()
            from pipeline.errors import DeviceFault

            self.engine = _Broken(self.engine, DeviceFault("an injected sticky device fault"))
        return generate(self, prompt_ids, max_new_tokens, params)

    return wrapped


class _Broken:
    """An engine whose next request raises `error` where a device fault would."""

    def __init__(self, engine, error: BaseException) -> None:
        self._engine, self._error = engine, error

    def __getattr__(self, name):
        if name in ("request", "generate"):
            raise self._error
        return getattr(self._engine, name)


class _PatchReplica(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "actors.replica":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.EngineReplica.generate = _faulty(module.EngineReplica.generate)

        spec.loader.exec_module = exec_module
        return spec


if FAULTS:
    sys.meta_path.insert(0, _PatchReplica())
