"""A slower device on demand, for tests of heterogeneous pipelines.

A slowed model waits before every attention and MLP call: its stages run slower and its
profile measures it slower, as on a genuinely slower GPU. A wait rather than repeated
work, so the difference holds on a busy machine, where extra compute would drown in the
noise. Applied from outside, to the models of a test:

- `slow_down(model, delay_s)`: one model in this process (its MLPs alone, if asked);
- `slowed(delay_s)`: every SublayerModel while it lasts, and this process's CPU named apart
  (so that its calibrations are stored apart from the fast device's);
- `install`, a Ray `worker_process_setup_hook` (see `runtime_env`): `slowed` for the life of
  a worker whose node was started with SLOW_DEVICE_ENV set to a delay in seconds. Nodes of
  `ray.cluster_utils.Cluster` on one machine share one calibration store; the slowed CPU's
  other name keeps the slow node from reading the fast node's table.

Only CPU devices are named apart: the heterogeneity tests run on CPU nodes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.model.attention import Attention
from pipeline.model.sublayer_model import SublayerModel
from profiling import record

SLOW_DEVICE_ENV = "KNAPSPEC_TEST_SUBLAYER_DELAY_S"
REPO = Path(__file__).resolve().parent.parent


def _delayed(call, delay_s: float):
    def slow(*args):
        time.sleep(delay_s)
        return call(*args)

    return slow


def slow_down(model: SublayerModel, delay_s: float, sublayers: tuple[str, ...] = ("attention", "mlp")) -> None:
    """Make every call of `model`'s `sublayers` ("attention": its one attention entry point,
    "mlp") wait `delay_s` first: every forward, a batch's, a draft's or a search's, alike."""
    if delay_s <= 0:
        return
    if "attention" in sublayers:
        model.attention = _delayed(model.attention, delay_s)
    if "mlp" in sublayers:
        model._mlp = _delayed(model._mlp, delay_s)


def _slow_everything(delay_s: float) -> dict:
    """Slow every SublayerModel and rename the CPU; returns what was replaced, to restore it."""
    replaced = {
        (Attention, "__call__"): Attention.__call__,
        (SublayerModel, "_mlp"): SublayerModel._mlp,
        (record, "cpu_model_name"): record.cpu_model_name,
    }
    cpu_model_name = record.cpu_model_name
    Attention.__call__ = _delayed(Attention.__call__, delay_s)
    SublayerModel._mlp = _delayed(SublayerModel._mlp, delay_s)
    record.cpu_model_name = lambda *args: f"{cpu_model_name(*args)} (slowed {delay_s * 1e3:g} ms per sublayer)"
    return replaced


@contextlib.contextmanager
def slowed(delay_s: float) -> Iterator[None]:
    """Every SublayerModel in this process waits `delay_s` before each attention and MLP call
    (models built before too), and calibrations name this CPU apart; undone on exit."""
    replaced = _slow_everything(delay_s) if delay_s > 0 else {}
    try:
        yield
    finally:
        for (owner, name), value in replaced.items():
            setattr(owner, name, value)


def node_delay() -> float:
    """This process's delay per sublayer call from SLOW_DEVICE_ENV, in seconds (0 when unset)."""
    value = os.environ.get(SLOW_DEVICE_ENV, "").strip()
    if not value:
        return 0.0
    delay = float(value)
    if not 0.0 <= delay < 1.0:
        raise ValueError(f"{SLOW_DEVICE_ENV}={value!r} must be in [0, 1) seconds")
    return delay


_installed = False


def install() -> None:
    """The worker_process_setup_hook: slow this worker when its node asks for it."""
    global _installed
    delay = node_delay()
    if delay > 0 and not _installed:
        _slow_everything(delay)
        _installed = True


def runtime_env() -> dict:
    """A job's runtime_env that runs `install` in every worker: the workers find this module
    through PYTHONPATH (the repository root; the package install holds no tests)."""
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"worker_process_setup_hook": f"{__name__}.install", "env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}
