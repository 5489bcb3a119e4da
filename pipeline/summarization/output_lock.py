"""One writer per output folder.

Two runs on one `--output` (a second `--resume` while the first still runs: Ctrl-C on `ray
job submit` leaves the job running) would remove each other's temporary files and could write
an id twice. A run takes the folder's lock (`pipeline/locks.py`: it names its run, and one
whose process is gone is taken over) before it touches anything there, and gives it back when
it ends. A lock held on another host cannot be checked from here: it is refused with what it
says, and the user decides.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.locks import LockFile, LockHeld


class OutputLock:
    """`with OutputLock(folder):` holds the folder for this process; ConfigError if another run does."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        # Beside the folder, not in it: readers of the output never see it, and a run refused
        # before it writes leaves no output folder behind.
        self.lock = LockFile(self.folder.parent / f".{self.folder.name}.lock")

    @property
    def path(self) -> Path:
        return self.lock.path

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.acquire()
        except LockHeld as held:
            raise ConfigError(
                f"output {self.folder} is in use by another run ({held.holder}); wait for it to end or stop it; "
                f"if it is gone, remove {self.path}"
            ) from None

    def release(self) -> None:
        self.lock.release()
