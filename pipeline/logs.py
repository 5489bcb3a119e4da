"""Logging set-up for processes that no job's `main` starts: Ray actors and Ray Data workers.

Library code only calls `logging.getLogger(__name__)`; the jobs configure their own
process, and a worker process configures itself once through this helper (Ray forwards a
worker's output to the driver, where these lines appear beside the job's own).
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_worker_logging(level: int = logging.INFO) -> None:
    """INFO lines of this worker's loggers to its output; a no-op when already configured."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
