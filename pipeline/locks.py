"""Lock files that name their holder, so that a lock left by a killed process is seen as such.

A plain "the file exists" lock (what PyTorch's extension builder uses) waits forever after
its holder was killed. Here the file holds the host, process id and start time of its
holder: a lock whose process is gone from this host is stale, reported, and taken over. A
lock held on another host cannot be checked from here, and counts as held.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

logger = logging.getLogger(__name__)

_WRITING_S = 10.0  # an unreadable lock file younger than this may still be being written


class LockHeld(Exception):
    """The lock is held by a live run; `holder` says whose."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


class LockFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now()}

    def acquire(self, wait_s: float = 0.0, poll_s: float = 0.5) -> None:
        """Take the lock, waiting up to `wait_s` for a live holder; LockHeld if it still holds it."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if self._stale(holder):
                    logger.warning("Taking over %s, left by %s, which is gone", self.path, describe(holder))
                    self.path.unlink(missing_ok=True)
                    continue
                if time.monotonic() >= deadline:
                    raise LockHeld(self.path, describe(holder)) from None
                time.sleep(poll_s)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
                f.flush()
                os.fsync(f.fileno())
            return

    def release(self) -> None:
        """Removes the lock file if it is still this process's."""
        if self._holder() == self.owner:
            self.path.unlink(missing_ok=True)

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: its writer died writing it, or is writing it now
        return holder if isinstance(holder, dict) else {}

    def _stale(self, holder: dict | None) -> bool:
        if holder is None:
            return True  # gone since we looked
        if not holder:
            try:
                return time.time() - self.path.stat().st_mtime > _WRITING_S
            except FileNotFoundError:
                return True
        if holder.get("host") != self.owner["host"] or not isinstance(holder.get("pid"), int):
            return False
        return not _alive(holder["pid"])


def describe(holder: dict | None) -> str:
    if not holder:
        return "an unreadable lock file"
    return f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process, alive
    return True


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
