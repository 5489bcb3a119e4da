"""A slower device on demand, for tests of heterogeneous pipelines.

A node started with `KNAPSPEC_TEST_SUBLAYER_DELAY_S` in its environment (e.g. a second
node of `ray.cluster_utils.Cluster`) makes every attention and MLP call of the models
built there wait that long: its stages run slower and its profiler measures them slower,
as on a genuinely slower GPU. A wait rather than repeated work, so the difference holds
on a busy machine, where extra compute would drown in the noise.
"""

from __future__ import annotations

import os
import time

from pipeline.errors import ConfigError
from pipeline.model.sublayer_model import SublayerModel

SUBLAYER_DELAY_ENV = "KNAPSPEC_TEST_SUBLAYER_DELAY_S"


def node_sublayer_delay() -> float:
    """This process's test delay per sublayer call, in seconds (0 when unset)."""
    value = os.environ.get(SUBLAYER_DELAY_ENV, "").strip()
    if not value:
        return 0.0
    try:
        delay = float(value)
    except ValueError:
        raise ConfigError(f"{SUBLAYER_DELAY_ENV}={value!r} is not a number of seconds") from None
    if not 0.0 <= delay < 1.0:
        raise ConfigError(f"{SUBLAYER_DELAY_ENV}={value!r} must be in [0, 1) seconds")
    return delay


def throttle(model: SublayerModel, delay_s: float) -> None:
    """Make every attention and MLP call of `model` wait `delay_s` first."""
    if delay_s <= 0:
        return
    attention, mlp = model._attention, model._mlp

    def slow_attention(*args):
        time.sleep(delay_s)
        return attention(*args)

    def slow_mlp(*args):
        time.sleep(delay_s)
        return mlp(*args)

    model._attention, model._mlp = slow_attention, slow_mlp
