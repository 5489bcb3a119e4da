"""A batched forward that one request's rows can break without breaking the others'.

Where the forward fails, its halves run again (a forward only writes K/V at positions not yet
committed, so a rerun writes the same), recursively, until each failure is pinned on one
block. When both halves of a failing forward fail, the fault is taken to be the forward's,
not one request's, and every block gets the error: a sticky device error would otherwise
cost 2n forwards.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pipeline.model.packing import RequestRows

logger = logging.getLogger(__name__)


def forward_isolating(model, blocks: Sequence[RequestRows]) -> tuple[list, bool]:
    """Each block's logits or the exception that its rows caused, and whether the forward had
    to be isolated."""
    try:
        return list(model.forward_batch(blocks, logits="all")), False
    except Exception as e:  # noqa: BLE001 (whatever broke it, only its request may fail)
        logger.exception("A batched forward of %d blocks failed", len(blocks))
        return _isolate(model, list(blocks), e), True


def _isolate(model, blocks: list[RequestRows], error: BaseException) -> list:
    if len(blocks) == 1:
        return [error]
    halves = [blocks[: len(blocks) // 2], blocks[len(blocks) // 2 :]]
    outs: list = []
    for half in halves:
        try:
            outs.append(list(model.forward_batch(half, logits="all")))
        except Exception as e:  # noqa: BLE001
            outs.append(e)
    if all(isinstance(out, BaseException) for out in outs):
        return [error] * len(blocks)
    found = []
    for half, out in zip(halves, outs):
        found += _isolate(model, half, out) if isinstance(out, BaseException) else out
    return found
