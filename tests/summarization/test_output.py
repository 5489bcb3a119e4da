"""The job's output folder: fixed schema, atomic parts, resume and overwrite rules."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.errors import ConfigError
from pipeline.summarization.output import (
    OUTPUT_COLUMNS,
    OUTPUT_SCHEMA,
    RunTotals,
    error_row,
    part_files,
    prepare_output,
    read_output,
    rows_to_table,
    write_part,
)


def ok_row(row_id: str, **values) -> dict:
    row = dict.fromkeys(OUTPUT_COLUMNS)
    row.update(id=row_id, summary=f"summary of {row_id}", status="ok", model="m", strategy="ar", num_chunks=2,
               prompt_tokens=100, output_tokens=10, steps=9, drafted_tokens=0, accepted_tokens=0,
               prefill_s=1.0, decode_s=0.5)
    row.update(values)
    return row


def test_error_rows_have_the_full_schema():
    table = rows_to_table([error_row(None, "the document is empty", "m", "ar"), ok_row("a")])
    assert table.schema == OUTPUT_SCHEMA
    first = table.to_pylist()[0]
    assert first["status"] == "error" and first["error"] == "the document is empty" and first["id"] is None
    assert first["summary"] is None and first["prompt_tokens"] is None and first["finished_at"] is not None


def test_rows_must_match_the_schema():
    with pytest.raises(ValueError, match="extra columns"):
        rows_to_table([ok_row("a", surprise=1)])


def test_parts_are_written_whole(tmp_path):
    folder = tmp_path / "out"
    path = write_part(folder, rows_to_table([ok_row("a"), ok_row("b")]))
    assert path.parent == folder and path.suffix == ".parquet"
    assert not list(folder.glob("*.tmp"))
    assert read_output(folder).column("id").to_pylist() == ["a", "b"]
    assert read_output(tmp_path / "missing").num_rows == 0


def test_an_existing_output_needs_resume_or_overwrite(tmp_path):
    folder = tmp_path / "out"
    assert prepare_output(folder, resume=False, overwrite=False).done_ids == frozenset()
    write_part(folder, rows_to_table([ok_row("a")]))
    with pytest.raises(ConfigError, match="--resume .* --overwrite"):
        prepare_output(folder, resume=False, overwrite=False)
    state = prepare_output(folder, resume=False, overwrite=True)
    assert state.done_ids == frozenset() and part_files(folder) == []


def test_resume_keeps_ok_rows_and_drops_what_it_redoes(tmp_path):
    folder = tmp_path / "out"
    write_part(folder, rows_to_table([ok_row("a"), error_row("b", "replica died", "m", "ar")]))
    write_part(folder, rows_to_table([ok_row("c")]))
    (folder / "part-killed.parquet.tmp").write_bytes(b"PAR1 half a file")

    state = prepare_output(folder, resume=True, overwrite=False)

    assert state.done_ids == {"a", "c"} and state.kept_rows == 2 and state.dropped_rows == 1
    assert not list(folder.glob("*.tmp"))
    table = read_output(folder)
    assert sorted(table.column("id").to_pylist()) == ["a", "c"]
    assert set(table.column("status").to_pylist()) == {"ok"}
    # Resuming again changes nothing.
    assert prepare_output(folder, resume=True, overwrite=False).dropped_rows == 0
    assert read_output(folder).num_rows == 2


def test_resume_keeps_one_ok_row_per_id(tmp_path):
    folder = tmp_path / "out"
    write_part(folder, rows_to_table([ok_row("a")]))
    write_part(folder, rows_to_table([ok_row("a"), ok_row("b")]))
    state = prepare_output(folder, resume=True, overwrite=False)
    assert state.done_ids == {"a", "b"}
    assert sorted(read_output(folder).column("id").to_pylist()) == ["a", "b"]


def test_output_path_must_be_a_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        prepare_output(tmp_path / "file", resume=False, overwrite=False)


def test_run_totals_table():
    totals = RunTotals()
    totals.add_table(rows_to_table([ok_row("a", rouge1=0.5, rouge2=0.25, rougeL=0.4, finish_reason="sentence"),
                                    ok_row("b", finish_reason="trimmed"), error_row("c", "empty", "m", "ar")]))
    other = RunTotals()
    other.add_table(rows_to_table([ok_row("d", drafted_tokens=10, accepted_tokens=7, rouge1=0.3, rouge2=0.05,
                                          rougeL=0.2, finish_reason="sentence")]))
    totals.merge(other)
    assert (totals.rows, totals.ok, totals.errors, totals.chunks) == (4, 3, 1, 6)
    assert totals.decoding.output_tokens == 30 and totals.acceptance_rate == pytest.approx(0.7)
    assert totals.rouge("rouge1") == pytest.approx(0.4) and totals.first_errors == ["c: empty"]
    lines = totals.table(wall_s=36.0).splitlines()
    assert len(lines) == 5 and lines[2].startswith("| 4 | 3 | 1 | 6 | 300 | 30 |") and lines[2].endswith("| 300.0 |")
    # The run's throughput over the wall clock, not the rows' summed (overlapping) times.
    assert "| 8.3 | 0.83 | 0.700 |" in lines[2] and "prompt tok/s | output tok/s" in lines[0]
    assert totals.table(wall_s=0.0).splitlines()[2].endswith("| – |")
    assert lines[4] == "How the summaries ended (finish_reason): sentence 2, trimmed 1"  # of the ok rows


def test_schema_is_fixed():
    assert OUTPUT_COLUMNS == (
        "id", "summary", "finish_reason", "status", "error", "error_kind", "model", "strategy", "prompt_tokens",
        "output_tokens", "num_chunks", "steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_len", "mean_skipped_attn",
        "mean_skipped_mlp", "prefill_s", "decode_s", "tokens_per_s", "rouge1", "rouge2", "rougeL", "finished_at",
    )
    assert OUTPUT_SCHEMA.field("finished_at").type == pa.timestamp("us", tz="UTC")


def test_resume_sets_an_unreadable_part_aside(tmp_path, caplog):
    """A 0-byte part (a crash before parts were synced) ended --resume in an ArrowInvalid traceback."""
    write_part(tmp_path, rows_to_table([ok_row("a")]))
    (tmp_path / "part-torn.parquet").write_bytes(b"")
    with caplog.at_level("WARNING"):
        state = prepare_output(tmp_path, resume=True, overwrite=False)
    assert state.done_ids == {"a"} and "part-torn.parquet" in caplog.text
    assert len(part_files(tmp_path)) == 1 and not (tmp_path / "part-torn.parquet").exists()
    assert (tmp_path / "_part-torn.parquet.unreadable").exists()  # kept for whoever wants to look
    assert read_output(tmp_path).column("id").to_pylist() == ["a"]


def test_the_exit_status_tells_whether_the_run_can_be_trusted():
    def totals(*rows) -> RunTotals:
        run = RunTotals()
        run.add_table(rows_to_table(list(rows)))
        return run

    fine = totals(*[ok_row(str(i)) for i in range(9)], error_row("x", "text is empty", "m", "ar"))
    assert fine.outcome(0.1) == (0, "9 rows ok, 1 failed by their input, 0 failed by the infrastructure")
    assert fine.outcome(0.05)[0] == 1 and "more than --max-error-fraction=0.05" in fine.outcome(0.05)[1]
    assert fine.outcome(0.05, earlier_ok=20)[0] == 0  # a resumed run's kept rows are rows of the output
    died = totals(ok_row("a"), error_row("b", "RayActorError: the actor died", "m", "ar", "infrastructure"))
    assert died.outcome(1.0) == (
        1, "1 rows ok, 0 failed by their input, 1 failed by the infrastructure: rerun with --resume to retry them"
    )
