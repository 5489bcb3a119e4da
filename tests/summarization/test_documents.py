"""The input side of the summarization job: every format read end to end on a local Ray cluster,
per-row problems as error rows, fatal input problems as one ConfigError line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from pipeline.errors import ConfigError
from pipeline.summarization.datasource import DocumentDatasource, read_documents
from pipeline.summarization.inputs import DEFAULT_REFERENCE_COLUMN, FORMATS, resolve_input
from pipeline.summarization.readers import DOCUMENT_SCHEMA
from pipeline.summarization.rows import count_ids, find_duplicate_ids, validate_row
from tests.builders import sample_documents

pytestmark = pytest.mark.ray

# Three real documents (long GAO reports with human summaries), kept to the fields a user's input has.
DOCS = [{k: d[k] for k in ("id", "text", "reference_summary", "title")} for d in sample_documents()[:3]]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    if ray.is_initialized():  # another module's cluster: use it, leave it running
        yield
        return
    # Keeps a local cluster on 127.0.0.1 instead of the machine's interface address.
    previous = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = previous


# --- writing inputs ---


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path: Path, records: list[dict] | pa.Table) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(records if isinstance(records, pa.Table) else pa.Table.from_pylist(records), path)
    return path


def write_hf(path: Path, records: list[dict], num_shards: int = 1) -> Path:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_list(records).save_to_disk(str(path), num_shards=num_shards)
    return path


def write_txt(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for r in records:
        (folder / f"{r['id']}.txt").write_text(r["text"], encoding="utf-8")
    return folder


def write_input(fmt: str, tmp_path: Path, records: list[dict]) -> Path:
    """`records` in format `fmt`, spread over two files where the format has files, nested for parquet."""
    if fmt == "parquet":
        write_parquet(tmp_path / "pq" / "part-0.parquet", records[:1])
        write_parquet(tmp_path / "pq" / "more" / "part-1.parquet", records[1:])
        return tmp_path / "pq"
    if fmt == "jsonl":
        write_jsonl(tmp_path / "js" / "a.jsonl", records[:2])
        write_jsonl(tmp_path / "js" / "b.json", records[2:])
        return tmp_path / "js"
    if fmt == "hf-datasets":
        return write_hf(tmp_path / "hf", records, num_shards=2)
    return write_txt(tmp_path / "txt", records)


def read_rows(spec, rows_per_block: int = 8) -> list[dict]:
    """All rows, in file order (Ray does not keep the order of read tasks by default)."""
    rows = read_documents(spec, rows_per_block).take_all()
    return sorted(rows, key=lambda r: r["source"])


# --- every format, end to end ---


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_ids_texts_and_references(fmt, tmp_path):
    spec = resolve_input(write_input(fmt, tmp_path, DOCS))
    assert spec.format == fmt
    assert spec.reference_column == (None if fmt == "txt" else DEFAULT_REFERENCE_COLUMN)
    assert len(spec.paths) == (3 if fmt == "txt" else 2)

    ds = read_documents(spec)
    assert ds.schema().names == DOCUMENT_SCHEMA.names
    assert list(ds.schema().types) == DOCUMENT_SCHEMA.types
    rows = {r["id"]: r for r in ds.take_all()}
    assert sorted(rows) == sorted(d["id"] for d in DOCS)
    for doc in DOCS:
        row = rows[doc["id"]]
        assert row["text"] == doc["text"]
        assert row["reference"] == (None if fmt == "txt" else doc["reference_summary"])
        assert row["input_error"] is None
        assert validate_row(row["id"], row["text"], row["input_error"], set()) is None

    sources = sorted(r["source"] for r in rows.values())
    expected = {
        "parquet": ["more/part-1.parquet row 0", "more/part-1.parquet row 1", "part-0.parquet row 0"],
        "jsonl": ["a.jsonl:1", "a.jsonl:2", "b.json:1"],
        "hf-datasets": [
            "data-00000-of-00002.arrow row 0",
            "data-00000-of-00002.arrow row 1",
            "data-00001-of-00002.arrow row 0",
        ],
        "txt": sorted(f"{d['id']}.txt" for d in DOCS),
    }[fmt]
    assert sources == expected


def test_single_files_and_explicit_columns(tmp_path):
    records = [{"key": "x", "body": "Some text.", "summary": "Short."}]
    for path in (write_jsonl(tmp_path / "d.jsonl", records), write_parquet(tmp_path / "d.parquet", records)):
        spec = resolve_input(path, id_column="key", text_column="body", reference_column="summary")
        assert spec.paths == (path,)
        [row] = read_rows(spec)
        assert (row["id"], row["text"], row["reference"]) == ("x", "Some text.", "Short.")
        assert row["source"] in ("d.jsonl:1", "d.parquet row 0")


def test_integer_ids_become_strings(tmp_path):
    records = [{"id": 7, "text": "seven"}, {"id": 8, "text": "eight"}]
    for path in (write_jsonl(tmp_path / "d.jsonl", records), write_parquet(tmp_path / "d.parquet", records)):
        spec = resolve_input(path)
        assert [r["id"] for r in read_rows(spec)] == ["7", "8"]


# --- per-row problems become rows ---


def test_jsonl_bad_lines_become_error_rows_and_the_rest_survive(tmp_path):
    lines = [
        b'{"id": "a", "text": "fine", "reference_summary": "ok"}',
        b"   ",  # blank: skipped, but still counted in line numbers
        b'{"id": "b", "text": "caf\xff au lait"}',
        b'{"id": "c", "text": ',
        b"[1, 2]",
        b'{"id": "d", "text": 5}',
        b'{"id": "e", "text": null}',
        b'{"id": "f", "text": ["x"]}',
        b'{"id": "g", "text": "fine", "reference_summary": 3}',
        b'{"id": ["h"], "text": "fine"}',
        b'{"id": "i"}',
        b'{"id": true, "text": "fine"}',
    ]
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = {r["source"]: r for r in read_rows(resolve_input(path))}
    assert len(rows) == len(lines) - 1

    def check(line: int, row_id, text, error, reference=None):
        row = rows[f"docs.jsonl:{line}"]
        assert (row["id"], row["text"], row["reference"], row["input_error"]) == (row_id, text, reference, error)

    check(1, "a", "fine", None, "ok")
    # The bad byte is in the text; the id is still recovered so the error row names its document.
    check(3, "b", None, "docs.jsonl:3: invalid UTF-8 in the line: byte 0xff at offset 24: invalid start byte")
    check(4, None, None, "docs.jsonl:4: invalid JSON: Expecting value at column 21")
    check(5, None, None, "docs.jsonl:5: a JSON list, not an object")
    check(6, "d", None, "text is int, not a string")
    check(7, "e", None, None)
    check(8, "f", None, "text is list, not a string")
    check(9, "g", "fine", None)  # a non-string reference is dropped, not an error
    check(10, None, "fine", "id is list, not a string or integer")
    check(11, "i", None, None)
    check(12, None, "fine", "id is bool, not a string or integer")

    messages = {s: validate_row(r["id"], r["text"], r["input_error"], set()) for s, r in rows.items()}
    assert messages["docs.jsonl:1"] is None
    assert messages["docs.jsonl:7"] == messages["docs.jsonl:11"] == "text is missing"


def test_lone_surrogates_in_jsonl_become_error_rows(tmp_path):
    """JSON's "\\ud83d" without its pair decodes to a string no UTF-8 can hold: in the text or
    the id it fails its row (the id kept, escaped, so the row can be found); in a reference it
    is dropped. Today's main failed the whole job on it."""
    path = tmp_path / "docs.jsonl"
    path.write_text(
        '{"id": "a", "text": "fine"}\n'
        '{"id": "b", "text": "half an emoji: \\ud83d here"}\n'
        '{"id": "c\\udc00", "text": "fine"}\n'
        '{"id": "d", "text": "fine", "reference_summary": "\\ud83d"}\n',
        encoding="utf-8",
    )
    rows = {r["source"]: r for r in read_rows(resolve_input(path))}
    got = [(r["id"], r["text"], r["reference"], r["input_error"]) for r in rows.values()]
    assert got == [
        ("a", "fine", None, None),
        ("b", None, None, "docs.jsonl:2: text holds a lone surrogate ('\\ud83d') at character 15"),
        ("c\\udc00", "fine", None, "docs.jsonl:3: id holds a lone surrogate ('\\udc00') at character 1"),
        ("d", "fine", None, None),
    ]


def test_invalid_utf8_in_parquet_strings_becomes_error_rows(tmp_path):
    """Parquet does not check a string column's bytes when it is read; the job's first look at
    the value did, and failed the whole job."""

    def strings(*values: bytes) -> pa.Array:
        offsets = [0]
        for value in values:
            offsets.append(offsets[-1] + len(value))
        return pa.Array.from_buffers(
            pa.string(),
            len(values),
            [None, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]), pa.py_buffer(b"".join(values))],
        )

    table = pa.table(
        {
            "id": strings(b"a", b"b", b"c\xfe"),
            "text": strings(b"fine", b"caf\xe9 au lait", b"fine"),
            "reference_summary": strings(b"ok", b"ok", b"\xff"),
        }
    )
    rows = read_rows(resolve_input(write_parquet(tmp_path / "d.parquet", table)))
    assert [(r["id"], r["text"], r["reference"], r["input_error"]) for r in rows] == [
        ("a", "fine", "ok", None),
        ("b", None, "ok", "d.parquet row 1: text is not valid UTF-8: byte 0xe9 at offset 3: invalid continuation byte"),
        ("c\\xfe", "fine", None, "d.parquet row 2: id is not valid UTF-8: byte 0xfe at offset 1: invalid start byte"),
    ]


def test_invalid_utf8_txt_file_becomes_an_error_row(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "good.txt").write_text("Plain text.\n", encoding="utf-8")
    (folder / "bad.txt").write_bytes(b"abc\xffdef")
    rows = {r["id"]: r for r in read_rows(resolve_input(folder))}
    assert rows["good"]["text"] == "Plain text.\n" and rows["good"]["input_error"] is None
    assert rows["bad"]["text"] is None
    assert rows["bad"]["input_error"] == "bad.txt is not valid UTF-8: byte 0xff at offset 3: invalid start byte"


def test_parquet_text_column_of_another_type_fails_every_row(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", pa.table({"id": ["a", "b"], "text": pa.array([1, 2], pa.int64())}))
    rows = read_rows(resolve_input(path))
    assert [(r["id"], r["text"], r["input_error"]) for r in rows] == [
        ("a", None, "column 'text' is int64, not a string"),
        ("b", None, "column 'text' is int64, not a string"),
    ]


def test_an_empty_file_next_to_others_reads_as_no_rows(tmp_path):
    write_jsonl(tmp_path / "js" / "a.jsonl", [{"id": "a", "text": "x"}])
    (tmp_path / "js" / "empty.jsonl").write_bytes(b"")
    assert [r["id"] for r in read_rows(resolve_input(tmp_path / "js"))] == ["a"]


# --- fatal problems, before any work ---


def test_resolve_input_rejects_missing_unknown_and_empty_inputs(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_input(tmp_path / "nope.jsonl")

    csv = tmp_path / "docs.csv"
    csv.write_text("id,text\na,b\n")
    with pytest.raises(ConfigError, match=r"cannot read .*docs\.csv: unknown format; use a \.parquet/\.jsonl"):
        resolve_input(csv)
    (tmp_path / "csvs").mkdir()
    (tmp_path / "csvs" / "docs.csv").write_text("id,text\n")
    with pytest.raises(ConfigError, match="unknown format"):
        resolve_input(tmp_path / "csvs")

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_input(tmp_path / "empty")

    write_jsonl(tmp_path / "mixed" / "a.jsonl", [{"id": "a", "text": "x"}])
    write_txt(tmp_path / "mixed", [{"id": "b", "text": "y"}])
    with pytest.raises(ConfigError, match="mixes jsonl and txt"):
        resolve_input(tmp_path / "mixed")

    (tmp_path / "garbage.jsonl").write_bytes(b"not json\n\xff\n")
    with pytest.raises(ConfigError, match="garbage.jsonl: no line is a JSON object"):
        resolve_input(tmp_path / "garbage.jsonl")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "hf-datasets"])
def test_resolve_input_rejects_missing_columns(fmt, tmp_path):
    records = [{"doc_id": "a", "text": "x"}]
    path = write_input(fmt, tmp_path, records * 2)
    with pytest.raises(ConfigError, match=r"has no (column|key) 'id' \(the id (column|key)\); it has: doc_id, text"):
        resolve_input(path)
    with pytest.raises(ConfigError, match="has no (column|key) 'body'"):
        resolve_input(path, id_column="doc_id", text_column="body")
    # The default reference column is optional; a named one is not.
    assert resolve_input(path, id_column="doc_id").reference_column is None
    with pytest.raises(ConfigError, match="has no reference (column|key) 'summary'"):
        resolve_input(path, id_column="doc_id", reference_column="summary")


def test_resolve_input_rejects_ids_that_are_neither_strings_nor_integers(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"id": 1.5, "text": "x"}])
    with pytest.raises(ConfigError, match="id column 'id' is double; ids must be strings or integers"):
        resolve_input(path)


def test_resolve_input_names_the_splits_of_a_dataset_dict(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    part = datasets.Dataset.from_list([{"id": "a", "text": "x"}])
    datasets.DatasetDict(train=part, test=part).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"DatasetDict \(splits: train, test\); pass one split, e\.g\. .*dd/train"):
        resolve_input(tmp_path / "dd")
    assert resolve_input(tmp_path / "dd" / "train").format == "hf-datasets"
    # Its metadata files are not jsonl documents.
    with pytest.raises(ConfigError, match=r"holds a datasets save_to_disk folder, .*dd; pass that folder"):
        resolve_input(tmp_path)


# --- duplicates and row validation ---


def test_find_duplicate_ids_counts_repeated_non_empty_ids(tmp_path):
    ids = ["a", "b", "a", "a", None, None, "", "", "c", "b"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "text": "x"} for i in ids])
    documents = read_documents(resolve_input(path), rows_per_block=3)
    counts = count_ids(documents)
    assert counts == {"a": 3, "b": 2, "c": 1}
    duplicates = find_duplicate_ids(documents)
    assert duplicates == find_duplicate_ids(counts) == {"a": 3, "b": 2}
    assert validate_row("a", "x", None, duplicates) == "id 'a' occurs 3 times in the input; ids must be unique"
    assert validate_row("c", "x", None, duplicates) is None


@pytest.mark.parametrize(
    "row_id, text, input_error, expected",
    [
        ("a", "Some text.", None, None),
        ("a", None, "docs.jsonl:3: invalid JSON", "docs.jsonl:3: invalid JSON"),  # the reader's verdict first
        (None, "Some text.", None, "id is missing"),
        ("", "Some text.", None, "id is empty"),
        ("  ", "Some text.", None, "id is empty"),
        (7, "Some text.", None, "id is int, not a string"),
        ("dup", "Some text.", None, "id 'dup' occurs 2 times in the input; ids must be unique"),
        ("dup", None, None, "id 'dup' occurs 2 times in the input; ids must be unique"),
        ("a", None, None, "text is missing"),
        ("a", 5, None, "text is int, not a string"),
        ("a", "", None, "text is empty"),
        ("a", " \n\t", None, "text is only whitespace"),
        (None, None, None, "id is missing"),
    ],
)
def test_validate_row(row_id, text, input_error, expected):
    assert validate_row(row_id, text, input_error, {"dup": 2}) == expected


def test_validate_row_accepts_a_plain_set_of_duplicates():
    assert validate_row("dup", "x", None, {"dup"}) == "id 'dup' occurs more than once in the input; ids must be unique"


# --- streaming in blocks ---


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "hf-datasets"])
def test_a_file_streams_in_blocks_of_rows_per_block(fmt, tmp_path):
    records = [{"id": f"d{i}", "text": f"document {i}"} for i in range(7)]
    path = {
        "parquet": lambda: write_parquet(tmp_path / "d.parquet", records),
        "jsonl": lambda: write_jsonl(tmp_path / "d.jsonl", records),
        "hf-datasets": lambda: write_hf(tmp_path / "hf", records),
    }[fmt]()
    spec = resolve_input(path)
    # The read task itself (what runs on a worker) yields the blocks one at a time: Ray may
    # still join small blocks downstream, so the count of Ray blocks is not what streaming means.
    [task] = DocumentDatasource(spec, rows_per_block=3).get_read_tasks(parallelism=4)
    blocks = iter(task())
    assert next(blocks).num_rows == 3  # a generator: the first block comes before the rest is read
    assert [b.num_rows for b in blocks] == [3, 1]

    rows = read_documents(spec, rows_per_block=3).take_all()
    assert sorted(r["id"] for r in rows) == [f"d{i}" for i in range(7)]


def test_txt_files_are_read_rows_per_block_files_per_task(tmp_path):
    folder = write_txt(tmp_path / "txt", [{"id": f"d{i}", "text": f"document {i}"} for i in range(7)])
    tasks = DocumentDatasource(resolve_input(folder), rows_per_block=3).get_read_tasks(parallelism=1)
    assert [[b.num_rows for b in task()] for task in tasks] == [[3], [3], [1]]
