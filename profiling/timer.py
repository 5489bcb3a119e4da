"""Timing a piece of device work: warm-up runs, repeats, the median.

On CPU a monotonic host clock is the truth. On CUDA, kernels run asynchronously, so
the host clock would time the launches: CUDA events recorded on the device's stream
around the work, read after a synchronize, time the kernels themselves.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


class Timer(Protocol):
    def elapsed(self, fn: Callable[[], object]) -> float:
        """Seconds one call of `fn` keeps the device busy."""
        ...


class WallClockTimer:
    """time.perf_counter around the call; `synchronize` first drains queued device work."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.synchronize = synchronize

    def elapsed(self, fn: Callable[[], object]) -> float:
        if self.synchronize is not None:
            self.synchronize()
        start = time.perf_counter()
        fn()
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter() - start


class CudaEventTimer:
    """CUDA events around the call on the device's current stream."""

    def __init__(self, device: torch.device) -> None:
        # Nothing here touches CUDA, so that building a timer never initializes a context.
        self.device = device

    def elapsed(self, fn: Callable[[], object]) -> float:
        # Work queued before the call must not be charged to it.
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def timer_for(device: torch.device | str) -> Timer:
    """The right clock for work on `device`."""
    device = torch.device(device)
    if device.type == "cpu":
        return WallClockTimer()
    if device.type == "cuda":
        return CudaEventTimer(device)
    backend = getattr(torch, device.type, None)
    synchronize = getattr(backend, "synchronize", None)
    if synchronize is None:
        raise ValueError(f"no way to time work on device type {device.type!r}")
    logger.info("timing %s with the host clock around a synchronize", device.type)
    return WallClockTimer(synchronize)


@dataclass(frozen=True)
class Measurement:
    """Seconds of each timed repeat (warm-ups excluded) and their median."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def benchmark(fn: Callable[[], object], timer: Timer, repeats: int = 5, warmup: int = 1) -> Measurement:
    """Run `fn` `warmup` times untimed (caches, lazy init, allocator), then time `repeats` runs."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for _ in range(warmup):
        fn()
    return Measurement(tuple(timer.elapsed(fn) for _ in range(repeats)))


def benchmark_interleaved(
    tasks: dict[str, Callable[[], object]], timer: Timer, repeats: int = 5, warmup: int = 1
) -> dict[str, Measurement]:
    """Time every task once per round, in rounds: machine noise (another process, clock
    changes) then hits all tasks alike instead of spoiling one of them, which matters
    when their ratios are what is kept."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    samples: dict[str, list[float]] = {name: [] for name in tasks}
    for round_ in range(warmup + repeats):
        for name, fn in tasks.items():
            if round_ < warmup:
                fn()
            else:
                samples[name].append(timer.elapsed(fn))
    return {name: Measurement(tuple(values)) for name, values in samples.items()}
