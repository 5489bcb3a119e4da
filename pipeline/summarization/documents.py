"""The input side of the summarization job: find the documents, check them, stream them into Ray Data.

`resolve_input` looks at the input before any work starts and fails with one `ConfigError` line
when it cannot be read at all (missing path, unknown format, missing column). `read_documents`
then streams it as a Ray dataset of DOCUMENT_SCHEMA rows. A problem with a single row never
raises: the row carries it in `input_error`, and `validate_row` turns that, a missing or
duplicated id, or a missing text into the message of the row's error output.

Formats (detected from the path):

- parquet: a `.parquet` file or a folder of them (recursive);
- jsonl: a `.jsonl` / `.json` file with one object per line, or a folder of them (recursive);
- hf-datasets: a folder written by `datasets.Dataset.save_to_disk`, read as Arrow IPC streams
  without importing `datasets`;
- txt: a folder of `.txt` files (or one `.txt` file), one document per file, id = file stem.

This module imports without Ray (as the rest of `pipeline` does); Ray is imported when a
dataset is built.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    import ray.data

logger = logging.getLogger(__name__)

DEFAULT_ID_COLUMN = "id"
DEFAULT_TEXT_COLUMN = "text"
DEFAULT_REFERENCE_COLUMN = "reference_summary"
FORMATS = ("parquet", "jsonl", "hf-datasets", "txt")

DOCUMENT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("text", pa.string()),
        pa.field("reference", pa.string()),  # the human summary, for evaluation; null when absent
        pa.field("input_error", pa.string()),  # why the reader could not produce this row's text
        pa.field("source", pa.string()),  # where the row came from, for messages: "docs.jsonl:7"
    ]
)

_JSONL_SUFFIXES = (".jsonl", ".json")
_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class InputSpec:
    """A checked input: what `read_documents` reads, decided before any work starts."""

    paths: tuple[Path, ...]  # the concrete files to read, sorted
    format: str  # one of FORMATS
    id_column: str
    text_column: str
    reference_column: str | None  # None: no references in this input


# ---------------------------------------------------------------------------------------------
# Resolving the input


def resolve_input(
    path: str | Path,
    id_column: str = DEFAULT_ID_COLUMN,
    text_column: str = DEFAULT_TEXT_COLUMN,
    reference_column: str | None = None,
) -> InputSpec:
    """Checks everything that can be checked before any work starts.

    Raises ConfigError with a one-line message when the path is missing, its format is unknown,
    a folder is empty, or the id/text column is missing. `reference_column=None` means "use
    DEFAULT_REFERENCE_COLUMN if the input has it, else no references"; an explicitly named
    reference column that is missing is a ConfigError. For txt input the column options do not
    apply and are ignored.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"input {path} does not exist")
    fmt, paths = _detect_format(path)
    if fmt == "txt":
        reference = None
    else:
        schemas = _SCHEMA_READERS[fmt](paths)
        reference = _check_columns(fmt, schemas, id_column, text_column, reference_column)
    spec = InputSpec(paths, fmt, id_column, text_column, reference)
    columns = "" if fmt == "txt" else f", id={id_column!r} text={text_column!r} reference={reference!r}"
    logger.info("Input %s: %s, %d file(s)%s", path, fmt, len(paths), columns)
    return spec


def _unknown_format(path: Path) -> ConfigError:
    return ConfigError(
        f"cannot read {path}: unknown format; use a .parquet/.jsonl file or folder, "
        "a datasets save_to_disk folder, or a folder of .txt files"
    )


def _is_visible(relative: Path) -> bool:
    """Hidden and underscore-prefixed entries (.ipynb_checkpoints, _SUCCESS, _temporary) are not data."""
    return not any(part.startswith((".", "_")) for part in relative.parts)


def _detect_format(path: Path) -> tuple[str, tuple[Path, ...]]:
    """The format of `path` and the files to read; raises ConfigError when there is nothing readable."""
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            return "parquet", (path,)
        if suffix in _JSONL_SUFFIXES:
            return "jsonl", (path,)
        if suffix == ".txt":
            return "txt", (path,)
        raise _unknown_format(path)
    if not path.is_dir():
        raise _unknown_format(path)
    if (path / "dataset_dict.json").is_file():
        raise ConfigError(f"{path} holds a datasets DatasetDict ({_splits(path)}); pass one split, e.g. {path}/train")
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return "hf-datasets", _arrow_files(path)

    files = sorted(p for p in path.rglob("*") if p.is_file() and _is_visible(p.relative_to(path)))
    if not files:
        raise ConfigError(f"input folder {path} is empty")
    # Its state.json and dataset_info.json would otherwise pass for a jsonl input.
    nested = [p.parent for p in files if p.name in ("dataset_info.json", "dataset_dict.json")]
    if nested:
        raise ConfigError(f"{path} holds a datasets save_to_disk folder, {nested[0]}; pass that folder")
    # txt is one level only: nested .txt files are usually notes, not documents.
    candidates = {
        "parquet": tuple(p for p in files if p.suffix.lower() == ".parquet"),
        "jsonl": tuple(p for p in files if p.suffix.lower() in _JSONL_SUFFIXES),
        "txt": tuple(p for p in files if p.suffix.lower() == ".txt" and p.parent == path),
    }
    found = {fmt: paths for fmt, paths in candidates.items() if paths}
    if not found:
        raise _unknown_format(path)
    if len(found) > 1:
        # Reading only some of them would silently drop documents.
        raise ConfigError(f"input folder {path} mixes {' and '.join(found)} files; point to one format's files")
    [(fmt, paths)] = found.items()
    return fmt, paths


def _splits(path: Path) -> str:
    """The split names of a DatasetDict folder, for the error message."""
    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        return "splits: " + ", ".join(str(s) for s in splits)
    except (OSError, ValueError, KeyError, TypeError):
        folders = sorted(p.name for p in path.iterdir() if p.is_dir())
        return "splits: " + ", ".join(folders) if folders else "no splits"


def _arrow_files(path: Path) -> tuple[Path, ...]:
    """The data files of a save_to_disk folder, in the dataset's order (state.json lists them)."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path / 'state.json'} is not a datasets state file: {e}") from e
    files = tuple(path / name for name in names)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"{path} lacks the data file(s) its state.json lists: {', '.join(missing)}")
    if not files:
        raise ConfigError(f"{path} is a datasets folder without data files")
    return files


# A file's columns, as (where, {name: arrow type, or None when the format has no types}).
_Schemas = list[tuple[str, dict[str, pa.DataType | None]]]


def _field_types(schema: pa.Schema) -> dict[str, pa.DataType | None]:
    return {field.name: field.type for field in schema}


def _parquet_schemas(paths: tuple[Path, ...]) -> _Schemas:
    import pyarrow.parquet as pq

    schemas = []
    for path in paths:
        try:
            schema = pq.read_schema(path)  # the footer only
        except (OSError, pa.ArrowException) as e:
            raise ConfigError(f"{path} is not a readable Parquet file: {e}") from e
        schemas.append((str(path), _field_types(schema)))
    return schemas


def _arrow_schemas(paths: tuple[Path, ...]) -> _Schemas:
    import pyarrow.ipc

    schemas = []
    for path in paths:
        try:
            with pa.OSFile(str(path), "rb") as source:
                schema = pyarrow.ipc.open_stream(source).schema  # the first message only
        except (OSError, pa.ArrowException) as e:
            raise ConfigError(f"{path} is not an Arrow stream file as datasets writes them: {e}") from e
        schemas.append((str(path), _field_types(schema)))
    return schemas


def _jsonl_schemas(paths: tuple[Path, ...]) -> _Schemas:
    """The keys of each file's first valid JSON object (later rows may lack keys; those are row errors)."""
    schemas = []
    for path in paths:
        found = _first_object(path)
        if found is not None:
            line, obj = found
            schemas.append((f"the first JSON object of {path} (line {line})", {key: None for key in obj}))
    if not schemas:
        where = paths[0] if len(paths) == 1 else f"the {len(paths)} .jsonl/.json files under {_common_folder(paths)}"
        raise ConfigError(f"{where}: no line is a JSON object (one object per line expected)")
    return schemas


def _first_object(path: Path) -> tuple[int, dict] | None:
    """(line number, object) of the first line of `path` that is a JSON object, or None."""
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    obj = json.loads(_strip_bom(raw, number).decode("utf-8"))
                except ValueError:  # invalid UTF-8 or JSON: a row error later, not a column problem
                    continue
                if isinstance(obj, dict):
                    return number, obj
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    return None


_SCHEMA_READERS: dict[str, Callable[[tuple[Path, ...]], _Schemas]] = {
    "parquet": _parquet_schemas,
    "jsonl": _jsonl_schemas,
    "hf-datasets": _arrow_schemas,
}


def _is_string_type(dtype: pa.DataType) -> bool:
    """Types that cast losslessly to the schema's string (null: a column with no values at all)."""
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if pa.types.is_dictionary(dtype):
        return _is_string_type(dtype.value_type)
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or is_view(dtype) or pa.types.is_null(dtype)


def _check_columns(
    fmt: str, schemas: _Schemas, id_column: str, text_column: str, reference_column: str | None
) -> str | None:
    """Raises ConfigError for a missing id/text column; returns the reference column to use."""
    noun = "key" if fmt == "jsonl" else "column"
    for where, columns in schemas:
        for role, name in (("id", id_column), ("text", text_column)):
            if name not in columns:
                raise ConfigError(
                    f"{where} has no {noun} {name!r} (the {role} {noun}); it has: {', '.join(map(str, columns))}"
                )
        dtype = columns[id_column]
        # Integer ids are common (row numbers) and print unambiguously; floats and structs do not.
        if dtype is not None and not (_is_string_type(dtype) or pa.types.is_integer(dtype)):
            raise ConfigError(f"{where}: id column {id_column!r} is {dtype}; ids must be strings or integers")

    if reference_column is not None:
        for where, columns in schemas:
            if reference_column not in columns:
                raise ConfigError(f"{where} has no reference {noun} {reference_column!r}")
            dtype = columns[reference_column]
            if dtype is not None and not _is_string_type(dtype):
                raise ConfigError(f"{where}: reference column {reference_column!r} is {dtype}, not a string")
        return reference_column

    default = DEFAULT_REFERENCE_COLUMN
    present = [(where, columns[default]) for where, columns in schemas if default in columns]
    if not present:
        return None
    for where, dtype in present:
        if dtype is not None and not _is_string_type(dtype):
            # Not asked for by name: references only serve evaluation, so go on without them.
            logger.warning("%s: column %r is %s, not a string; reading no references", where, default, dtype)
            return None
    return default


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class _Columns:
    """The input's column names, as a read task needs them (small: it travels with every task)."""

    id: str
    text: str
    reference: str | None


READ_TASK_CPUS = 0.1


def read_documents(spec: InputSpec, rows_per_block: int = 8) -> ray.data.Dataset:
    """A streaming Ray dataset with DOCUMENT_SCHEMA.

    One read task per file (txt: per `rows_per_block` files); each yields blocks of at most
    `rows_per_block` rows as it reads, so a file larger than memory streams. Ray's read
    operator may still join consecutive small blocks of one task up to
    DataContext.target_max_block_size before passing them on.
    """
    import ray.data

    # Reading is light next to the model replicas, which hold most of the CPUs; a read task
    # asking for a whole CPU could wait forever behind them.
    return ray.data.read_datasource(_datasource_class()(spec, rows_per_block), num_cpus=READ_TASK_CPUS)


def __getattr__(name: str) -> Any:
    # DocumentDatasource subclasses ray.data.Datasource; building it on first use keeps this
    # module importable, and resolve_input fast, without importing Ray.
    if name == "DocumentDatasource":
        return _datasource_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _datasource_class() -> type:
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class DocumentDatasource(Datasource):
        """Ray Data source of an InputSpec: one read task per file, blocks of DOCUMENT_SCHEMA."""

        def __init__(self, spec: InputSpec, rows_per_block: int = 8) -> None:
            super().__init__()
            if rows_per_block < 1:
                raise ConfigError(f"rows_per_block must be at least 1, not {rows_per_block}")
            self.spec = spec
            self.rows_per_block = rows_per_block

        def get_name(self) -> str:
            return "Documents"

        def estimate_inmemory_data_size(self) -> int | None:
            return sum(path.stat().st_size for path in self.spec.paths)

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None):
            # The file is the unit of parallelism whatever Ray asks for: splitting a file would
            # need an index of its rows, and joining files would hide which one a task reads.
            return [
                ReadTask(
                    read_fn,
                    BlockMetadata(num_rows=None, size_bytes=size, exec_stats=None, input_files=files),
                    schema=DOCUMENT_SCHEMA,
                    per_task_row_limit=per_task_row_limit,
                )
                for read_fn, size, files in _read_functions(self.spec, self.rows_per_block)
            ]

    # Pickled by reference as pipeline.summarization.documents.DocumentDatasource (resolved by __getattr__).
    DocumentDatasource.__module__ = __name__
    DocumentDatasource.__qualname__ = "DocumentDatasource"
    return DocumentDatasource


_ReadFunction = Callable[[], Iterator[pa.Table]]


def _read_functions(spec: InputSpec, rows_per_block: int) -> list[tuple[_ReadFunction, int, tuple[str, ...]]]:
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


def _common_folder(paths: tuple[Path, ...]) -> Path:
    return Path(os.path.commonpath([str(p.parent) for p in paths]))


def _labels(paths: tuple[Path, ...]) -> dict[Path, str]:
    """Short names for `source`: the path below the folder that holds all files ("docs.jsonl", "2024/a.parquet")."""
    root = _common_folder(paths)
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


def _strip_bom(raw: bytes, line_number: int) -> bytes:
    # Some editors on Windows start a UTF-8 file with a byte-order mark; json.loads rejects it.
    return raw[len(_UTF8_BOM) :] if line_number == 1 and raw.startswith(_UTF8_BOM) else raw


def _read_jsonl(path: Path, label: str, columns: _Columns, rows_per_block: int) -> Iterator[pa.Table]:
    """Line by line in binary mode: each line decodes on its own, so one bad line costs one row."""
    rows: list[_Row] = []
    bad_rows = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            raw = _strip_bom(raw, number)
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
    text = obj.get(columns.text)
    text_error = None
    if text is not None and not isinstance(text, str):
        text, text_error = None, f"{columns.text} is {_json_type(text)}, not a string"
    reference = obj.get(columns.reference) if columns.reference is not None else None
    if not isinstance(reference, str):
        reference = None  # references only serve evaluation; a bad one is no reason to skip the row
    return (row_id, text, reference, id_error or text_error, source)


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
    if not _is_string_type(text_type):
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
    ids = batch.column(columns.id).cast(pa.string())  # resolve_input allowed only strings and integers
    text = batch.column(columns.text)
    if _is_string_type(text.type):
        text, errors = text.cast(pa.string()), nulls
    else:
        # A schema problem, but reported per row: the job still writes one error row per document.
        errors = pa.array([f"column {columns.text!r} is {text.type}, not a string"] * n, pa.string())
        text = nulls
    reference = nulls
    if columns.reference is not None and columns.reference in names:
        reference = batch.column(columns.reference).cast(pa.string())
    sources = pa.array([f"{label} row {first_row + i}" for i in range(n)], pa.string())
    return pa.Table.from_arrays([ids, text, reference, errors, sources], schema=DOCUMENT_SCHEMA)


_FILE_READERS: dict[str, Callable[[Path, str, _Columns, int], Iterator[pa.Table]]] = {
    "parquet": _read_parquet,
    "jsonl": _read_jsonl,
    "hf-datasets": _read_arrow_stream,
}


# ---------------------------------------------------------------------------------------------
# Checking rows


def count_ids(ds: ray.data.Dataset) -> Counter[str]:
    """How often each non-empty id occurs.

    The ids stream through the driver into one counter: a Ray Data groupby costs several
    seconds of shuffle setup even for a handful of rows, and a counter of ids stays small
    next to the documents (tens of MB for a million ids). Null and empty ids are left out:
    validate_row reports them.
    """
    counts: Counter[str] = Counter()
    for batch in ds.select_columns(["id"]).iter_batches(batch_format="pyarrow", batch_size=65536):
        counts.update(row_id for row_id in batch.column("id").to_pylist() if row_id)
    return counts


def find_duplicate_ids(ds: ray.data.Dataset | Counter[str]) -> dict[str, int]:
    """Ids that occur more than once, with their counts (a dict rather than a set so that
    messages can say how often). Takes the documents, or count_ids' result."""
    counts = ds if isinstance(ds, Counter) else count_ids(ds)
    return {row_id: count for row_id, count in counts.items() if count > 1}


def validate_row(
    row_id: Any, text: Any, input_error: str | None, duplicate_ids: Mapping[str, int] | AbstractSet[str]
) -> str | None:
    """The error message for a row that cannot be summarized, or None.

    Checked in order: the reader's input_error, a missing or empty id, a duplicated id (all of
    its rows fail: which one is "the" document is unknowable), a missing or non-string text, an
    empty or whitespace-only text. `duplicate_ids` is find_duplicate_ids' result (or a plain set).
    """
    if input_error:
        return input_error
    if row_id is None:
        return "id is missing"
    if not isinstance(row_id, str):
        return f"id is {type(row_id).__name__}, not a string"
    if not row_id.strip():
        return "id is empty"
    if row_id in duplicate_ids:
        count = duplicate_ids.get(row_id) if isinstance(duplicate_ids, Mapping) else None
        times = f"{count} times" if count else "more than once"
        return f"id {row_id!r} occurs {times} in the input; ids must be unique"
    if text is None:
        return "text is missing"
    if not isinstance(text, str):
        return f"text is {type(text).__name__}, not a string"
    if not text:
        return "text is empty"
    if not text.strip():
        return "text is only whitespace"
    return None
