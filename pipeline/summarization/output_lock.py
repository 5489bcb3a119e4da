"""One writer per output folder: a lock file that names its run.

Two runs on one `--output` (a second `--resume` while the first still runs: Ctrl-C on `ray
job submit` leaves the job running) would remove each other's temporary files and could write
an id twice. A run takes the folder's lock before it touches anything there and gives it back
when it ends. The lock file says who holds it (host, process, start); a lock whose process is
gone from this host is stale: it is reported and taken over. A lock held on another host
cannot be checked from here, so it is refused with what it says, and the user decides.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from pipeline.errors import ConfigError

logger = logging.getLogger(__name__)

_WRITING_S = 10.0  # a lock file younger than this may still be being written


class OutputLock:
    """`with OutputLock(folder):` holds the folder for this process; ConfigError if another run does."""

    def __init__(self, folder: Path) -> None:
        # Beside the folder, not in it: readers of the output never see it, and a run refused
        # before it writes leaves no output folder behind.
        folder = Path(folder)
        self.folder = folder
        self.path = folder.parent / f".{folder.name}.lock"
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now()}

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not self._stale(holder):
                    raise ConfigError(
                        f"output {self.folder} is in use by another run ({_describe(holder)}); wait for it "
                        f"to end or stop it; if it is gone, remove {self.path}"
                    ) from None
                logger.warning("Taking over the stale lock of a run that is gone (%s)", _describe(holder))
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
                f.flush()
                os.fsync(f.fileno())
            return
        raise ConfigError(f"could not lock output {self.folder}: another run took it at the same moment")

    def release(self) -> None:
        """Removes the lock file if it is still this run's."""
        if self._holder() == self.owner:
            self.path.unlink(missing_ok=True)

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: a run died while writing it, or something else wrote it
        return holder if isinstance(holder, dict) else {}

    def _stale(self, holder: dict | None) -> bool:
        if holder is None:
            return True  # removed since we looked
        if not holder:  # unreadable: half-written by a run that died creating it, unless it is being written now
            try:
                return time.time() - self.path.stat().st_mtime > _WRITING_S
            except FileNotFoundError:
                return True
        if holder.get("host") != self.owner["host"] or not isinstance(holder.get("pid"), int):
            return False
        return not _alive(holder["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, alive
    return True


def _describe(holder: dict | None) -> str:
    if not holder:
        return "an unreadable lock file"
    return f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
