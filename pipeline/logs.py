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


# Ray's and Ray Data's lines in a job's driver that say less than the job's own, and the level
# they are kept from: Ray Data's progress block (every 10 s where the output is not a terminal,
# each dataset's first at once), each dataset's start, plan and end, the sink's rows written,
# the local cluster's start, and the notice, a warning though nothing is wrong, that the cluster
# uses token authentication. The job's `[k/n]` lines and closing table say what a reader needs;
# `--verbose` keeps these.
RAY_CHATTER = {
    "ray.data._internal.progress": logging.WARNING,
    "ray.data._internal.execution.streaming_executor": logging.WARNING,
    "ray.data.dataset": logging.WARNING,  # ("Data sink ... finished": the job's closing lines say more)
    "ray._private.worker": logging.WARNING,
    "ray._private.authentication.authentication_token_setup": logging.ERROR,
}


def quiet_ray_chatter(verbose: bool) -> None:
    """Ray's and Ray Data's chatter (RAY_CHATTER) kept out of the job's log, unless `verbose`.
    Call after importing ray.data, whose import sets up its loggers."""
    if verbose:
        return
    for name, level in RAY_CHATTER.items():
        logging.getLogger(name).setLevel(level)
