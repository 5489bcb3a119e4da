"""Part files of a sensible size: the summarize job writes a part per finished document (a
killed run then loses only the documents in flight), and merges them while it runs.

A merge writes one part holding the rows of several, naming them in its metadata, then
deletes them. A crash between the two leaves both: readers (output.part_files) skip the
named parts, and the next `--resume` deletes them, so no row is ever read twice.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.summarization.output import OUTPUT_SCHEMA, part_files, sync_path, write_part

logger = logging.getLogger(__name__)

# Rows per merged part: ~1 KB each (a summary and its statistics), a few MB per file.
PART_ROWS = 10_000
# How often a running job merges what it wrote.
COMPACT_EVERY_S = 60.0


def compact_parts(folder: Path, target_rows: int = PART_ROWS) -> int:
    """Merge the folder's parts of fewer than `target_rows` rows into parts of up to that many,
    in name order. Returns how many parts were merged away."""
    small = []
    for f in part_files(folder):
        try:
            rows = pq.read_metadata(f).num_rows
        except (OSError, pa.ArrowException):
            continue  # an unreadable part: --resume sets it aside
        if rows < target_rows:
            small.append((f, rows))
    groups: list[list[Path]] = [[]]
    rows = 0
    for f, n in small:
        if groups[-1] and rows + n > target_rows:
            groups.append([])
            rows = 0
        groups[-1].append(f)
        rows += n
    merged = 0
    for group in (g for g in groups if len(g) > 1):
        table = pa.concat_tables([pq.read_table(f, schema=OUTPUT_SCHEMA) for f in group])
        write_part(folder, table, replaces=[f.name for f in group])
        for f in group:
            f.unlink()
        sync_path(folder)
        merged += len(group)
    return merged


class BackgroundCompaction:
    """Merges a running job's parts every `every_s` seconds, and once more when the job's
    write ends without an error."""

    def __init__(self, folder: Path, every_s: float = COMPACT_EVERY_S, target_rows: int = PART_ROWS) -> None:
        self.folder, self.every_s, self.target_rows = Path(folder), every_s, target_rows
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="compaction", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._compact()

    def _compact(self) -> None:
        try:
            merged = compact_parts(self.folder, self.target_rows)
        except Exception:
            logger.exception("Could not merge the part files of %s; they stay as they are", self.folder)
            return
        if merged:
            logger.debug("Merged %d part files of %s", merged, self.folder)

    def __enter__(self) -> BackgroundCompaction:
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._compact()
