"""A replica process that ends itself so that Ray restarts it."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def exit_for_restart(error: BaseException) -> None:
    """End this process at once so that Ray restarts its actor: after a fault that leaves the
    device or the model's state broken (pipeline.errors.is_device_fault), every later request
    would fail too. Its callers send the requests it held elsewhere (summarization/dispatch.py)."""
    logger.critical("Replica process %d exits to be restarted: %s: %s", os.getpid(), type(error).__name__, error)
    logging.shutdown()
    os._exit(70)
