"""Faults on purpose, for the tests of the job under faults (tests/jobs/test_replica_faults.py).

A replica reads `KNAPSPEC_FAULTS` from its environment once, a JSON object:

- `{"kill_on_token": T}`: its process is SIGKILLed whenever a prompt holding token id T
  reaches it (a request that crashes its replica every time: a poison pill).
- `{"device_fault_once": PATH}`: the first request anywhere raises DeviceFault (a sticky
  device error) and creates PATH; later requests, and the restarted process, run normally.

Unset (always, outside the tests) this costs one dictionary lookup per request.
"""

from __future__ import annotations

import json
import os
import signal
from functools import cache
from pathlib import Path

from pipeline.errors import DeviceFault

ENV = "KNAPSPEC_FAULTS"


@cache
def _faults() -> dict:
    return json.loads(os.environ.get(ENV) or "{}")


def on_request(prompt_ids: list[int]) -> None:
    faults = _faults()
    if not faults:
        return
    if faults.get("kill_on_token") in prompt_ids:
        os.kill(os.getpid(), signal.SIGKILL)
    once = faults.get("device_fault_once")
    if once is not None:
        try:
            Path(once).touch(exist_ok=False)
        except FileExistsError:
            return
        raise DeviceFault("an injected sticky device fault")
