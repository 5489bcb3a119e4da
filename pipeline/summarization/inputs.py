"""The summarization job's input, looked at before any work starts: what it is and whether it can be read.

`resolve_input` fails with one `ConfigError` line when the input cannot be read at all
(missing path, unknown format, missing column) and otherwise returns the `InputSpec` that
`pipeline/summarization/datasource.py` streams.

Formats (detected from the path):

- parquet: a `.parquet` file or a folder of them (recursive);
- jsonl: a `.jsonl` / `.json` file with one object per line, or a folder of them (recursive);
- hf-datasets: a folder written by `datasets.Dataset.save_to_disk`, read as Arrow IPC streams
  without importing `datasets`;
- txt: a folder of `.txt` files (or one `.txt` file), one document per file, id = file stem.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from pipeline.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_ID_COLUMN = "id"
DEFAULT_TEXT_COLUMN = "text"
DEFAULT_REFERENCE_COLUMN = "reference_summary"
FORMATS = ("parquet", "jsonl", "hf-datasets", "txt")

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
        where = paths[0] if len(paths) == 1 else f"the {len(paths)} .jsonl/.json files under {common_folder(paths)}"
        raise ConfigError(f"{where}: no line is a JSON object (one object per line expected)")
    return schemas


def _first_object(path: Path) -> tuple[int, dict] | None:
    """(line number, object) of the first line of `path` that is a JSON object, or None."""
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    obj = json.loads(strip_bom(raw, number).decode("utf-8"))
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


def is_string_type(dtype: pa.DataType) -> bool:
    """Types that cast losslessly to the schema's string (null: a column with no values at all)."""
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if pa.types.is_dictionary(dtype):
        return is_string_type(dtype.value_type)
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
        if dtype is not None and not (is_string_type(dtype) or pa.types.is_integer(dtype)):
            raise ConfigError(f"{where}: id column {id_column!r} is {dtype}; ids must be strings or integers")

    if reference_column is not None:
        for where, columns in schemas:
            if reference_column not in columns:
                raise ConfigError(f"{where} has no reference {noun} {reference_column!r}")
            dtype = columns[reference_column]
            if dtype is not None and not is_string_type(dtype):
                raise ConfigError(f"{where}: reference column {reference_column!r} is {dtype}, not a string")
        return reference_column

    default = DEFAULT_REFERENCE_COLUMN
    present = [(where, columns[default]) for where, columns in schemas if default in columns]
    if not present:
        return None
    for where, dtype in present:
        if dtype is not None and not is_string_type(dtype):
            # Not asked for by name: references only serve evaluation, so go on without them.
            logger.warning("%s: column %r is %s, not a string; reading no references", where, default, dtype)
            return None
    return default


def common_folder(paths: tuple[Path, ...]) -> Path:
    """The deepest folder that holds every one of `paths`."""
    return Path(os.path.commonpath([str(p.parent) for p in paths]))


def strip_bom(raw: bytes, line_number: int) -> bytes:
    # Some editors on Windows start a UTF-8 file with a byte-order mark; json.loads rejects it.
    return raw[len(_UTF8_BOM) :] if line_number == 1 and raw.startswith(_UTF8_BOM) else raw
