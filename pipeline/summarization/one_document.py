"""One document read from a file for a run in a single process (jobs/generate.py): a .txt file
whole, its id the file stem, or the row of a .jsonl / .parquet file with `id` and `text` columns
that an id picks. Every problem raises before any model is loaded: a `ConfigError` for the file
or the choice of row, a `RowError` for a row without text."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import ConfigError, RowError

ID_COLUMN = "id"
TEXT_COLUMN = "text"
INPUT_SUFFIXES = (".txt", ".jsonl", ".parquet")
# How many ids an "unknown id" message lists.
_IDS_SHOWN = 5


def load_document(path: Path | str, doc_id: str | None) -> tuple[str, str]:
    """(id, text) of the document to summarize; raises before any model is loaded."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text: {e}") from None
        # A text file holds one document; --id only names it.
        found_id = doc_id if doc_id is not None else path.stem
    elif suffix == ".jsonl":
        found_id, text = _load_jsonl(path, doc_id)
    elif suffix == ".parquet":
        found_id, text = _load_parquet(path, doc_id)
    else:
        choices = ", ".join(INPUT_SUFFIXES)
        raise ConfigError(f"cannot read {path}: unknown extension {path.suffix!r}; use one of {choices}")
    if not isinstance(text, str):
        raise RowError(f"document {found_id!r} in {path}: {TEXT_COLUMN!r} is {type(text).__name__}, not a string")
    if not text.strip():
        raise RowError(f"document {found_id!r} in {path} is empty")
    return found_id, text


def _load_jsonl(path: Path, doc_id: str | None) -> tuple[str, object]:
    ids: list[str] = []
    matches: list[dict] = []
    first: dict | None = None
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} line {number} is not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path} line {number} is not a JSON object")
            row_id = None if row.get(ID_COLUMN) is None else str(row[ID_COLUMN])
            ids.append(row_id if row_id is not None else f"<line {number} has no id>")
            # Only the chosen row is kept: documents can be large.
            if doc_id is None and first is None:
                first = row
            if doc_id is not None and row_id == doc_id:
                matches.append(row)
    if doc_id is None:
        _check_single_row(path, ids)
        row = first
        found_id = path.stem if row.get(ID_COLUMN) is None else str(row[ID_COLUMN])
    else:
        _check_matches(path, doc_id, ids, len(matches))
        row, found_id = matches[0], doc_id
    if TEXT_COLUMN not in row:
        raise ConfigError(f"{path}: row {found_id!r} has no {TEXT_COLUMN!r} field")
    return found_id, row[TEXT_COLUMN]


def _load_parquet(path: Path, doc_id: str | None) -> tuple[str, object]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    needed = [TEXT_COLUMN] if doc_id is None else [ID_COLUMN, TEXT_COLUMN]
    missing = [name for name in needed if name not in names]
    if missing:
        raise ConfigError(f"{path} has no column {missing[0]!r} (columns: {', '.join(names)})")
    # Ids are compared as strings, so an integer id column matches `--id 7`.
    if ID_COLUMN in names:
        ids = [None if v is None else str(v) for v in parquet.read(columns=[ID_COLUMN]).column(0).to_pylist()]
    else:
        ids = [None] * parquet.metadata.num_rows
    if doc_id is None:
        _check_single_row(path, ids)
        index, found_id = 0, path.stem if ids[0] is None else ids[0]
    else:
        positions = [i for i, v in enumerate(ids) if v == doc_id]
        _check_matches(path, doc_id, ids, len(positions))
        index, found_id = positions[0], doc_id
    # Read the text of the one row group that holds the row, not the whole column.
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if index < rows:
            return found_id, parquet.read_row_group(group, columns=[TEXT_COLUMN]).column(0)[index].as_py()
        index -= rows
    raise ConfigError(f"{path}: row {found_id!r} is past the file's row groups")  # a corrupt footer


def _check_single_row(path: Path, ids: list) -> None:
    if len(ids) == 1:
        return
    if not ids:
        raise RowError(f"{path} has no rows")
    raise ConfigError(f"{path} has {len(ids)} rows; choose one with --id ({_some_ids(ids)})")


def _check_matches(path: Path, doc_id: str, ids: list, count: int) -> None:
    if count == 0:
        raise ConfigError(f"no row with id {doc_id!r} in {path}; available: {_some_ids(ids)}")
    if count > 1:
        raise ConfigError(f"id {doc_id!r} occurs {count} times in {path}")


def _some_ids(ids: list) -> str:
    shown = ", ".join(str(i) for i in ids[:_IDS_SHOWN])
    return shown if len(ids) <= _IDS_SHOWN else f"{shown}, ... ({len(ids)} in all)"
