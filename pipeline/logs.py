"""Logging set-up, in one place, for the processes that run our code: the command-line
jobs (their `main`), Ray actors and Ray Data workers (their constructors).

Library code only calls `logging.getLogger(__name__)`. Ray forwards a worker's output to
the driver, where its lines appear beside the job's own, in the same format.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(quiet: bool = False) -> None:
    """A job's log lines on stderr (stdout stays for what it prints); warnings only when `quiet`."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, stream=sys.stderr, format=LOG_FORMAT)


def configure_worker_logging(level: int = logging.INFO) -> None:
    """INFO lines of this worker's loggers to its output; a no-op when already configured.
    Libraries' INFO chatter stays out (rouge-score's absl: "Using default tokenizer")."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    logging.getLogger("absl").setLevel(logging.WARNING)

