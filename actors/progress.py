"""Live progress of a summarization run: the summarize stage reports to one small named
actor (a ProgressTally), and the driver shows it — a tqdm bar, and one line per finished
document — while Ray Data's own progress goes on beside it."""

from __future__ import annotations

import logging
import sys
import threading

import ray

from pipeline.summarization.progress import ProgressTally, document_line, status_line

logger = logging.getLogger(__name__)

POLL_S = 1.0


class ProgressActor:
    """A ProgressTally as a Ray actor (wrapped by `ray.remote` in `start_progress`)."""

    def __init__(self) -> None:
        self.tally = ProgressTally()

    def requests(self, delta: int) -> None:
        self.tally.requests(delta)

    def document(self, record: dict) -> None:
        self.tally.document(record)

    def snapshot(self, since: int = 0) -> dict:
        return self.tally.snapshot(since)


def start_progress(name: str):
    """The named progress actor of one run. It takes no CPU: a report is a counter's update."""
    return ray.remote(ProgressActor).options(name=name, num_cpus=0, max_restarts=0).remote()


class ProgressReporter:
    """While open, polls the progress actor from a thread and shows the run: a live tqdm bar
    (where the output is a terminal) and one line per finished document (everywhere)."""

    def __init__(self, actor, total: int | None, poll_s: float = POLL_S) -> None:
        self.actor, self.total, self.poll_s = actor, total, poll_s
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._bar = None

    def __enter__(self) -> ProgressReporter:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (a log file gets the lines only).
        self._bar = tqdm(total=self.total, desc="documents", unit="doc", disable=None, dynamic_ncols=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # what finished since the last poll
        self._bar.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def _poll(self) -> None:
        try:
            snapshot = ray.get(self.actor.snapshot.remote(self._seen), timeout=30)
        except Exception:  # progress must never take the run down with it
            logger.debug("progress poll failed", exc_info=True)
            return
        for record in snapshot["finished"]:
            self._seen += 1
            self._bar.write(document_line(record, snapshot, self._seen, self.total), file=sys.stdout)
            self._bar.update(1)
        # Piped (`ray job submit`, a log file), stdout is block-buffered: a line must show when it happens.
        sys.stdout.flush()
        self._bar.set_postfix_str(status_line(snapshot, self.total), refresh=True)
