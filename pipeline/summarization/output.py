"""The summarization job's output: a fixed Parquet schema, atomic part files, resume.

The output is a folder of Parquet part files (one dataset, readable with
`pandas.read_parquet(folder)`), written as the job streams. Each part file appears
under its final name only once it is complete (written to a temporary name, then
renamed), so a killed job leaves whole part files and nothing half-written; resuming
skips the ids that already have an `ok` row and removes the rows it is about to
redo, so no id is ever written twice.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.decoding.stats import GenerationStats
from pipeline.errors import ConfigError

logger = logging.getLogger(__name__)

OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("summary", pa.string()),
        ("finish_reason", pa.string()),  # how the summary ended (pipeline/decoding/stopping.py)
        ("status", pa.string()),  # "ok" or "error"
        ("error", pa.string()),
        ("error_kind", pa.string()),  # "input" (the row's own problem) or "infrastructure" (worth a retry)
        ("model", pa.string()),
        ("strategy", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("num_chunks", pa.int64()),
        ("steps", pa.int64()),
        ("drafted_tokens", pa.int64()),
        ("accepted_tokens", pa.int64()),
        ("acceptance_rate", pa.float64()),
        ("mean_accepted_len", pa.float64()),
        ("mean_skipped_attn", pa.float64()),
        ("mean_skipped_mlp", pa.float64()),
        ("prefill_s", pa.float64()),
        ("decode_s", pa.float64()),
        ("tokens_per_s", pa.float64()),
        ("rouge1", pa.float64()),
        ("rouge2", pa.float64()),
        ("rougeL", pa.float64()),
        ("finished_at", pa.timestamp("us", tz="UTC")),
    ]
)
OUTPUT_COLUMNS = tuple(OUTPUT_SCHEMA.names)
STATUS_OK = "ok"
STATUS_ERROR = "error"
ERROR_INPUT = "input"  # the row cannot be summarized as it is: its bytes, its id, its text, its size
ERROR_INFRASTRUCTURE = "infrastructure"  # a replica failed it: a rerun with --resume may succeed
PART_SUFFIX = ".parquet"
_TMP_SUFFIX = ".tmp"
UNREADABLE_SUFFIX = ".unreadable"  # a part that --resume could not read, set aside
_REPLACES_KEY = b"knapspec.replaces"  # a merged part's schema metadata: the parts it holds the rows of


def error_row(row_id: str | None, message: str, model: str, strategy: str, kind: str = ERROR_INPUT) -> dict[str, Any]:
    """An output row for an input row that failed: every statistic null, the reason in `error`."""
    row = dict.fromkeys(OUTPUT_COLUMNS)
    row.update(
        id=row_id, status=STATUS_ERROR, error=message, error_kind=kind, model=model, strategy=strategy, finished_at=now()
    )
    return row


def now() -> datetime:
    return datetime.now(timezone.utc)


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows (dicts with exactly the output columns) as a table of OUTPUT_SCHEMA."""
    for row in rows:
        if set(row) != set(OUTPUT_COLUMNS):
            extra, missing = set(row) - set(OUTPUT_COLUMNS), set(OUTPUT_COLUMNS) - set(row)
            raise ValueError(f"output row has extra columns {sorted(extra)} / lacks {sorted(missing)}")
    return pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)


def write_part(folder: Path, table: pa.Table, replaces: Sequence[str] = ()) -> Path:
    """Write one part file atomically: readers never see a partial file under a final name.
    `replaces`: names of parts whose rows this one holds (a merge, compaction.py); until they
    are deleted, readers skip them."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"part-{uuid.uuid4().hex}{PART_SUFFIX}"
    tmp = final.with_name(final.name + _TMP_SUFFIX)
    table = table.cast(OUTPUT_SCHEMA)
    if replaces:
        table = table.replace_schema_metadata({_REPLACES_KEY: json.dumps(list(replaces)).encode()})
    pq.write_table(table, tmp)
    # On disk before the rename, and the rename on disk before the rows count as written: a
    # crash leaves the part whole or absent, never a 0-byte file under its final name.
    sync_path(tmp)
    os.replace(tmp, final)
    sync_path(folder)
    return final


def sync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def part_files(folder: Path) -> list[Path]:
    """The folder's parts, less those a merged part replaces (a merge a crash cut short)."""
    files = sorted(folder.glob(f"*{PART_SUFFIX}")) if folder.is_dir() else []
    replaced = replaced_parts(files)
    return [f for f in files if f.name not in replaced]


def replaced_parts(files: Iterable[Path]) -> set[str]:
    """Names of the parts that a merged part among `files` holds the rows of."""
    names: set[str] = set()
    for f in files:
        try:
            metadata = pq.read_schema(f).metadata or {}
        except (OSError, pa.ArrowException):
            continue  # an unreadable part: --resume sets it aside
        if _REPLACES_KEY in metadata:
            names.update(json.loads(metadata[_REPLACES_KEY]))
    return names


def read_output(folder: Path | str, columns: Iterable[str] | None = None) -> pa.Table:
    """All rows written to an output folder so far (an empty table of the schema when none)."""
    files = part_files(Path(folder))
    columns = list(columns) if columns is not None else list(OUTPUT_COLUMNS)
    schema = pa.schema([OUTPUT_SCHEMA.field(name) for name in columns])
    if not files:
        return schema.empty_table()
    return pa.concat_tables([pq.read_table(f, columns=columns, schema=OUTPUT_SCHEMA).cast(schema) for f in files])


@dataclass(frozen=True)
class ResumeState:
    done_ids: frozenset[str]  # ids with an `ok` row, skipped by this run
    kept_rows: int
    dropped_rows: int  # error rows removed because this run retries them


def prepare_output(folder: Path, resume: bool, overwrite: bool) -> ResumeState:
    """Get the output folder ready for a run.

    - a new or empty folder: nothing to do;
    - `resume`: keep the `ok` rows, whose ids this run skips; remove every other row
      (errors are retried, so they would otherwise appear twice), and any leftover
      temporary file of a killed run;
    - `overwrite`: remove the earlier parts;
    - neither, with earlier parts present: ConfigError, so that no run silently mixes with
      or destroys another's output.
    """
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"output {folder} exists and is not a folder")
    for tmp in folder.glob(f"*{_TMP_SUFFIX}") if folder.is_dir() else ():
        tmp.unlink()
    for name in replaced_parts(folder.glob(f"*{PART_SUFFIX}")) if folder.is_dir() else ():
        (folder / name).unlink(missing_ok=True)  # a merge a crash cut short, finished
    files = part_files(folder)
    if not files:
        return ResumeState(frozenset(), 0, 0)
    if overwrite:
        for f in files:
            f.unlink()
        logger.info("Removed %d part files of an earlier run from %s", len(files), folder)
        return ResumeState(frozenset(), 0, 0)
    if not resume:
        raise ConfigError(
            f"output {folder} already holds {len(files)} part files of an earlier run; "
            "pass --resume to continue it or --overwrite to replace it"
        )
    done: set[str] = set()
    kept = dropped = 0
    for f in files:
        try:
            table = pq.read_table(f, schema=OUTPUT_SCHEMA)
        except (OSError, pa.ArrowException) as e:
            # A part a crash tore (written before parts were synced, or by another tool): its rows
            # are redone; the file is kept aside, not deleted, for whoever wants to look.
            aside = f.with_name(f"_{f.name}{UNREADABLE_SUFFIX}")  # "_": Arrow's dataset readers skip it
            os.replace(f, aside)
            logger.warning("Set aside the unreadable part %s as %s (%s); its rows are redone", f.name, aside.name, e)
            continue
        ok = [status == STATUS_OK and row_id is not None for row_id, status in zip(
            table.column("id").to_pylist(), table.column("status").to_pylist()
        )]
        # An `ok` row of an id already seen cannot come from our writes; keep the first
        # defensively rather than count it twice.
        keep = []
        for row_id, is_ok in zip(table.column("id").to_pylist(), ok):
            keep.append(is_ok and row_id not in done)
            if is_ok:
                done.add(row_id)
        kept += sum(keep)
        dropped += len(keep) - sum(keep)
        if all(keep):
            continue
        if any(keep):
            write_part(folder, table.filter(pa.array(keep)))
        f.unlink()
    logger.info("Resuming: %d ids already done, %d earlier rows to redo", len(done), dropped)
    return ResumeState(frozenset(done), kept, dropped)


@dataclass
class RunTotals:
    """What a run wrote, summed over part files: the job's closing table."""

    rows: int = 0
    ok: int = 0
    errors: int = 0
    chunks: int = 0
    decoding: GenerationStats = field(default_factory=lambda: GenerationStats(num_requests=0))  # of the ok rows
    rouge_sums: dict[str, float] = field(default_factory=dict)
    rouge_counts: int = 0
    first_errors: list[str] = field(default_factory=list)
    endings: Counter = field(default_factory=Counter)  # the ok rows' finish_reason
    error_kinds: Counter = field(default_factory=Counter)  # the error rows' error_kind

    def add_table(self, table: pa.Table) -> None:
        for row in table.to_pylist():
            self.rows += 1
            if row["status"] != STATUS_OK:
                self.errors += 1
                self.error_kinds[row["error_kind"] or ERROR_INPUT] += 1
                if len(self.first_errors) < _ERRORS_SHOWN:
                    self.first_errors.append(f"{row['id']}: {row['error']}")
                continue
            self.ok += 1
            self.endings[row["finish_reason"] or "unknown"] += 1
            self.chunks += row["num_chunks"] or 0
            self.decoding += _row_stats(row)
            if row["rouge1"] is not None:
                self.rouge_counts += 1
                for name in _ROUGE:
                    self.rouge_sums[name] = self.rouge_sums.get(name, 0.0) + row[name]

    def merge(self, other: RunTotals) -> None:
        for name in ("rows", "ok", "errors", "chunks", "rouge_counts"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.decoding += other.decoding
        self.endings += other.endings
        self.error_kinds += other.error_kinds
        for name, value in other.rouge_sums.items():
            self.rouge_sums[name] = self.rouge_sums.get(name, 0.0) + value
        self.first_errors = (self.first_errors + other.first_errors)[:_ERRORS_SHOWN]

    @property
    def acceptance_rate(self) -> float | None:
        return self.decoding.acceptance_rate if self.decoding.drafted_tokens else None

    def outcome(self, max_error_fraction: float, earlier_ok: int = 0) -> tuple[int, str]:
        """The job's exit status and last line. Every row is written either way; the status says
        whether the output can be trusted as it is: 1 when a row failed for the infrastructure
        (a rerun with --resume retries it), or more than `max_error_fraction` of the output's
        rows failed (more likely a wrong column or encoding than a few bad rows). `earlier_ok`:
        the ok rows a resumed run kept, which count among the output's rows."""
        infrastructure = self.error_kinds[ERROR_INFRASTRUCTURE]
        line = (
            f"{self.ok} rows ok, {self.errors - infrastructure} failed by their input, "
            f"{infrastructure} failed by the infrastructure"
        )
        if infrastructure:
            return 1, f"{line}: rerun with --resume to retry them"
        if self.errors > max_error_fraction * (self.rows + earlier_ok):
            return 1, f"{line}: more than --max-error-fraction={max_error_fraction:g} of the rows failed"
        return 0, line

    def rouge(self, name: str) -> float | None:
        return self.rouge_sums[name] / self.rouge_counts if self.rouge_counts else None

    def table(self, wall_s: float) -> str:
        """A short markdown table of the run: its rows, and its throughput over the wall clock.
        A request's own prefill and decode times overlap with the others' (a batch shares every
        step, replicas run side by side), so their sums are no rate; they stay in the rows."""

        def fmt(value: float | None, digits: int = 3) -> str:
            return "–" if value is None else f"{value:.{digits}f}"

        def per_s(count: float) -> float | None:
            return count / wall_s if wall_s > 0 else None

        stats = self.decoding
        header = (
            "| rows | ok | error | chunks | prompt tokens | output tokens | prompt tok/s | output tok/s "
            "| acceptance | ROUGE-1 | ROUGE-2 | ROUGE-L | docs/hour |"
        )
        values = (
            f"| {self.rows} | {self.ok} | {self.errors} | {self.chunks} | {stats.prompt_tokens} | {stats.output_tokens} "
            f"| {fmt(per_s(stats.prompt_tokens), 1)} | {fmt(per_s(stats.output_tokens), 2)} | {fmt(self.acceptance_rate)} "
            f"| {fmt(self.rouge('rouge1'))} | {fmt(self.rouge('rouge2'))} | {fmt(self.rouge('rougeL'))} "
            f"| {fmt(per_s(self.ok * 3600), 1)} |"
        )
        lines = [header, "|" + "---|" * 13, values]
        if self.endings:
            ended = ", ".join(f"{reason} {n}" for reason, n in sorted(self.endings.items()))
            lines.append(f"\nHow the summaries ended (finish_reason): {ended}")
        return "\n".join(lines)


def _row_stats(row: dict[str, Any]) -> GenerationStats:
    """An ok row's decoding statistics. A row keeps no count of its requests, but its decoded
    tokens are tokens_per_s × decode_s (rounded back to the integer they were): every other
    output token is the first token of a request, from its prefill."""
    output_tokens = row["output_tokens"] or 0
    decoded = 0
    if row["tokens_per_s"] is not None and row["decode_s"] is not None:
        decoded = round(row["tokens_per_s"] * row["decode_s"])
    return GenerationStats(
        prompt_tokens=row["prompt_tokens"] or 0,
        output_tokens=output_tokens,
        steps=row["steps"] or 0,
        drafted_tokens=row["drafted_tokens"] or 0,
        accepted_tokens=row["accepted_tokens"] or 0,
        prefill_s=row["prefill_s"] or 0.0,
        decode_s=row["decode_s"] or 0.0,
        num_requests=output_tokens - decoded,
    )


_ERRORS_SHOWN = 5
_ROUGE = ("rouge1", "rouge2", "rougeL")
