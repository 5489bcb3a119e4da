"""A summarization run's progress as a person reads it: documents done of the total, rows
failed, requests in flight, decode tokens per second, and the time left.

`ProgressTally` is what the summarize stage reports to (through a small actor,
`actors/progress.py`) and what the driver reads back; the lines are formatted here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ProgressTally:
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    failed: int = 0
    in_flight: int = 0  # requests sent to replicas and not answered yet
    output_tokens: int = 0
    finished: list[dict] = field(default_factory=list)  # one record per document, in finishing order

    def requests(self, delta: int) -> None:
        self.in_flight += delta

    def document(self, record: dict) -> None:
        """A finished document: {"id", "status", "num_chunks", "output_tokens", "seconds", "error"}."""
        self.done += 1
        self.failed += record.get("status") != "ok"
        self.output_tokens += record.get("output_tokens") or 0
        self.finished.append(record)

    def snapshot(self, since: int = 0) -> dict:
        """The counters, and the documents finished after the first `since`."""
        return {
            "done": self.done,
            "failed": self.failed,
            "in_flight": self.in_flight,
            "output_tokens": self.output_tokens,
            "elapsed_s": time.monotonic() - self.started,
            "finished": self.finished[since:],
        }


def document_line(record: dict, snapshot: dict, position: int, total: int | None) -> str:
    """One line per finished document: `[3/10] crs-r47194 ok, 4 chunks, 256 tokens in 41 s · ...`."""
    of = f"/{total}" if total else ""
    if record.get("status") == "ok":
        what = (
            f"ok, {record.get('num_chunks')} chunk(s), {record.get('output_tokens')} tokens "
            f"in {record.get('seconds', 0.0):.0f} s"
        )
    else:
        what = f"error: {record.get('error')}"
    return f"[{position}{of}] {record.get('id')} {what} · {status_line(snapshot, total)}"


def status_line(snapshot: dict, total: int | None) -> str:
    """`2 failed · 5 requests in flight · 27.3 tokens/s generated · ~4 min left`."""
    elapsed, done = snapshot["elapsed_s"], snapshot["done"]
    rate = snapshot["output_tokens"] / elapsed if elapsed > 0 else 0.0
    parts = [
        f"{snapshot['failed']} failed",
        f"{snapshot['in_flight']} requests in flight",
        f"{rate:.1f} tokens/s generated",
    ]
    if total and done:
        parts.append(f"~{_duration(elapsed / done * max(total - done, 0))} left")
    return " · ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
