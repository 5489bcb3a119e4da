"""A step's metadata on its way to the device: packed on the host, moved in one copy.

A forward needs a few small integer tensors — token ids, each row's position, where each
row's keys and values go, which keys each query sees, which rows need logits. Built one
by one as `torch.tensor(list, device=...)`, each is a blocking copy; on a GPU a step would
wait on the host a dozen times before its first kernel. Here they are written into one
preallocated host buffer (pinned where the device is a GPU, so the copy is asynchronous),
moved with one copy, and split into views on the device; the forward itself then reads
only device tensors (see `tests/model/test_step_on_device.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HostStaging:
    """One buffer of int64 per model, grown to the largest step it has carried."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._buffer = torch.empty(0, dtype=torch.long)
        # The copy out of a pinned buffer runs after the host has moved on: the next step
        # waits for it before it writes the buffer again.
        self._copied: torch.cuda.Event | None = None

    def send(self, parts: Sequence[Sequence[int] | np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
        """`parts` (lists of ints, or host tensors) on the device as int64 views, in one copy."""
        sizes = [len(part) for part in parts]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()
        if total > self._buffer.numel():
            self._buffer = torch.empty(max(total, 2 * self._buffer.numel(), 256), dtype=torch.long)
            if self._pinned:
                self._buffer = self._buffer.pin_memory()
        host = self._buffer.numpy()
        at = 0
        for part, size in zip(parts, sizes):
            host[at : at + size] = part.numpy() if isinstance(part, torch.Tensor) else part
            at += size
        if self.device.type == "cpu":
            # A copy all the same: the next step rewrites the buffer while this one's views may live on.
            moved = self._buffer[:total].clone()
        else:
            moved = self._buffer[:total].to(self.device, non_blocking=self._pinned)
            if self._pinned:
                self._copied = torch.cuda.Event()
                self._copied.record()
        return list(moved.split(sizes))
