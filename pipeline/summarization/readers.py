"""The per-format readers of the summarization job: each file streams as Arrow tables of DOCUMENT_SCHEMA.

A problem with a single row never raises: the row carries it in `input_error`, and
`pipeline/summarization/rows.py` turns it into the message of the row's error output.
`read_functions` cuts an InputSpec into the read tasks of the Ray Data source.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.summarization.inputs import InputSpec, common_folder, is_string_type, strip_bom

logger = logging.getLogger(__name__)

DOCUMENT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("text", pa.string()),
        pa.field("reference", pa.string()),  # the human summary, for evaluation; null when absent
        pa.field("input_error", pa.string()),  # why the reader could not produce this row's text
        pa.field("source", pa.string()),  # where the row came from, for messages: "docs.jsonl:7"
    ]
)


@dataclass(frozen=True)
class _Columns:
    """The input's column names, as a read task needs them (small: it travels with every task)."""

    id: str
    text: str
    reference: str | None


_ReadFunction = Callable[[], Iterator[pa.Table]]


def read_functions(spec: InputSpec, rows_per_block: int) -> list[tuple[_ReadFunction, int, tuple[str, ...]]]:
    """(read function, bytes on disk, files) per read task. The functions are partials of
    module-level readers over small arguments, so tasks pickle small."""
    labels = _labels(spec.paths)
    columns = _Columns(spec.id_column, spec.text_column, spec.reference_column)
    if spec.format == "txt":
        # A txt file is one row: a task per file would make a block per row.
        groups = [spec.paths[i : i + rows_per_block] for i in range(0, len(spec.paths), rows_per_block)]
        return [
            (
                functools.partial(_read_txt_files, group, tuple(labels[p] for p in group)),
                sum(p.stat().st_size for p in group),
                tuple(map(str, group)),
            )
            for group in groups
        ]
    reader = _FILE_READERS[spec.format]
    return [
        (
            functools.partial(_read_file, reader, path, labels[path], columns, rows_per_block),
            path.stat().st_size,
            (str(path),),
        )
        for path in spec.paths
    ]


def _labels(paths: tuple[Path, ...]) -> dict[Path, str]:
    """Short names for `source`: the path below the folder that holds all files ("docs.jsonl", "2024/a.parquet")."""
    root = common_folder(paths)
    return {p: p.relative_to(root).as_posix() for p in paths}


def _read_file(
    reader: Callable[[Path, str, _Columns, int], Iterator[pa.Table]],
    path: Path,
    label: str,
    columns: _Columns,
    rows_per_block: int,
) -> Iterator[pa.Table]:
    """Runs one file's reader; an empty file still yields a (typed) empty block."""
    empty = True
    for block in reader(path, label, columns, rows_per_block):
        empty = False
        yield block
    if empty:
        # Without it Ray would make an untyped empty block for this task.
        yield DOCUMENT_SCHEMA.empty_table()


# One row as (id, text, reference, input_error, source).
_Row = tuple[str | None, str | None, str | None, str | None, str]


def _rows_to_table(rows: list[_Row]) -> pa.Table:
    columns = zip(*rows) if rows else [()] * len(DOCUMENT_SCHEMA)
    return pa.Table.from_arrays([pa.array(list(values), pa.string()) for values in columns], schema=DOCUMENT_SCHEMA)


# --- txt ---


def _read_txt_files(paths: tuple[Path, ...], labels: tuple[str, ...]) -> Iterator[pa.Table]:
    yield _rows_to_table([_txt_row(path, label) for path, label in zip(paths, labels)])


def _txt_row(path: Path, label: str) -> _Row:
    data = path.read_bytes()
    try:
        return (path.stem, data.decode("utf-8"), None, None, label)
    except UnicodeDecodeError as e:
        logger.warning("%s is not valid UTF-8; it becomes an error row", path)
        return (path.stem, None, None, f"{label} is not valid UTF-8: {_utf8_problem(e, data)}", label)


def _utf8_problem(error: UnicodeDecodeError, data: bytes) -> str:
    """'byte 0xff at offset 17: invalid start byte' (the offset from the start of `data`)."""
    return f"byte 0x{data[error.start]:02x} at offset {error.start}: {error.reason}"


# --- jsonl ---


def _read_jsonl(path: Path, label: str, columns: _Columns, rows_per_block: int) -> Iterator[pa.Table]:
    """Line by line in binary mode: each line decodes on its own, so one bad line costs one row."""
    rows: list[_Row] = []
    bad_rows = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            raw = strip_bom(raw, number)
            if not raw.strip():
                continue
            row = _jsonl_row(raw.rstrip(b"\r\n"), f"{label}:{number}", columns)
            bad_rows += row[3] is not None
            rows.append(row)
            if len(rows) == rows_per_block:
                yield _rows_to_table(rows)
                rows = []
    if rows:
        yield _rows_to_table(rows)
    if bad_rows:
        logger.warning("%s: %d row(s) have an input_error", path, bad_rows)


def _jsonl_row(raw: bytes, source: str, columns: _Columns) -> _Row:
    """(id, text, reference, input_error, source) of one non-blank line, without its line break."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        # The id usually survives a bad byte in the text; recovering it lets the error row be
        # matched to its document.
        recovered = _parse_json(raw.decode("utf-8", errors="replace"))
        row_id = _jsonl_id(recovered.get(columns.id), columns.id)[0] if isinstance(recovered, dict) else None
        problem = f"{source}: invalid UTF-8 in the line: {_utf8_problem(e, raw)}"
        return (row_id, None, None, problem, source)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return (None, None, None, f"{source}: invalid JSON: {e.msg} at column {e.colno}", source)
    if not isinstance(obj, dict):
        return (None, None, None, f"{source}: a JSON {_json_type(obj)}, not an object", source)

    row_id, id_error = _jsonl_id(obj.get(columns.id), columns.id)
    if row_id is not None and (at := _lone_surrogate(row_id)) is not None:
        # Written escaped ("\\ud83d"), so that the error row can still be matched to its line.
        id_error = f"{source}: {columns.id} holds a lone surrogate ({row_id[at]!a}) at character {at}"
        row_id = row_id.encode("utf-8", "backslashreplace").decode("utf-8")
    text = obj.get(columns.text)
    text_error = None
    if text is not None and not isinstance(text, str):
        text, text_error = None, f"{columns.text} is {_json_type(text)}, not a string"
    elif text is not None and (at := _lone_surrogate(text)) is not None:
        text_error = f"{source}: {columns.text} holds a lone surrogate ({text[at]!a}) at character {at}"
        text = None
    reference = obj.get(columns.reference) if columns.reference is not None else None
    if not isinstance(reference, str) or _lone_surrogate(reference) is not None:
        reference = None  # references only serve evaluation; a bad one is no reason to skip the row
    return (row_id, text, reference, id_error or text_error, source)


def _lone_surrogate(value: str) -> int | None:
    """Where `value` holds a lone surrogate (JSON's "\\ud83d" escape without its pair decodes to
    one, and no UTF-8 can hold it), or None."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _parse_json(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _jsonl_id(value: Any, name: str) -> tuple[str | None, str | None]:
    """(id as a string, error): integers become strings; null stays None (validate_row reports it)."""
    if value is None or isinstance(value, str):
        return value, None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), None
    return None, f"{name} is {_json_type(value)}, not a string or integer"


def _json_type(value: Any) -> str:
    return type(value).__name__


# --- parquet and datasets' arrow files ---


def _read_parquet(path: Path, label: str, columns: _Columns, rows_per_block: int) -> Iterator[pa.Table]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    available = set(parquet.schema_arrow.names)
    wanted = [c for c in dict.fromkeys((columns.id, columns.text, columns.reference)) if c in available]
    text_type = parquet.schema_arrow.field(columns.text).type
    if not is_string_type(text_type):
        logger.warning("%s: column %r is %s, not a string; every row becomes an error", path, columns.text, text_type)
    first_row = 0
    for batch in parquet.iter_batches(batch_size=rows_per_block, columns=wanted):
        yield _normalize_batch(batch, columns, label, first_row)
        first_row += batch.num_rows


def _read_arrow_stream(path: Path, label: str, columns: _Columns, rows_per_block: int) -> Iterator[pa.Table]:
    """datasets' .arrow files are IPC streams of record batches (1000 rows by default): read one
    batch at a time and cut it into blocks."""
    import pyarrow.ipc

    first_row = 0
    with pa.OSFile(str(path), "rb") as source:
        for batch in pyarrow.ipc.open_stream(source):
            for start in range(0, batch.num_rows, rows_per_block):
                yield _normalize_batch(batch.slice(start, rows_per_block), columns, label, first_row)
                first_row += min(rows_per_block, batch.num_rows - start)


def _normalize_batch(batch: pa.RecordBatch, columns: _Columns, label: str, first_row: int) -> pa.Table:
    """One batch of a typed file -> DOCUMENT_SCHEMA. `source` counts rows from 0 within the file."""
    n = batch.num_rows
    names = set(batch.schema.names)
    nulls = pa.nulls(n, pa.string())
    sources = [f"{label} row {first_row + i}" for i in range(n)]
    # A string column's bytes are not checked when it is read: a value that is not UTF-8 would
    # fail the job's first look at it, so it becomes its row's error here.
    ids, bad_ids = _valid_utf8(batch.column(columns.id), escape=True)
    ids = ids.cast(pa.string())  # resolve_input allowed only strings and integers
    text = batch.column(columns.text)
    problems: list[str | None] = [None] * n
    if is_string_type(text.type):
        text, bad_text = _valid_utf8(text)
        text = text.cast(pa.string())
        for name, bad in ((columns.text, bad_text), (columns.id, bad_ids)):
            for i, problem in bad.items():
                problems[i] = f"{sources[i]}: {name} is not valid UTF-8: {problem}"
    else:
        # A schema problem, but reported per row: the job still writes one error row per document.
        problems = [f"column {columns.text!r} is {text.type}, not a string"] * n
        text = nulls
    reference = nulls
    if columns.reference is not None and columns.reference in names:
        reference = _valid_utf8(batch.column(columns.reference))[0].cast(pa.string())
    errors = pa.array(problems, pa.string())
    return pa.Table.from_arrays([ids, text, reference, errors, pa.array(sources, pa.string())], schema=DOCUMENT_SCHEMA)


def _valid_utf8(column: pa.Array, escape: bool = False) -> tuple[pa.Array, dict[int, str]]:
    """`column` with each string value that is not UTF-8 made null (`escape`: its bad bytes
    written as \\xNN instead), and where each was, with its first bad byte. Non-string columns
    pass as they are; a valid column is checked once, by Arrow."""
    if not is_string_type(column.type):
        return column, {}
    try:
        column.validate(full=True)
        return column, {}
    except pa.ArrowInvalid:
        pass
    values, bad = [], {}
    for i, raw in enumerate(column.cast(pa.binary() if column.type == pa.string() else pa.large_binary()).to_pylist()):
        try:
            values.append(None if raw is None else raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad[i] = _utf8_problem(e, raw)
            values.append(raw.decode("utf-8", "backslashreplace") if escape else None)
    return pa.array(values, pa.string()), bad


_FILE_READERS: dict[str, Callable[[Path, str, _Columns, int], Iterator[pa.Table]]] = {
    "parquet": _read_parquet,
    "jsonl": _read_jsonl,
    "hf-datasets": _read_arrow_stream,
}
