"""Part files of a sensible size: the job's one-document parts merged, and a merge a crash cut
short never showing a row twice."""

from __future__ import annotations

from pipeline.summarization.compaction import BackgroundCompaction, compact_parts
from pipeline.summarization.output import part_files, prepare_output, read_output, rows_to_table, write_part
from tests.summarization.test_output import ok_row


def write_parts(folder, count: int) -> list[str]:
    ids = [f"doc-{i}" for i in range(count)]
    for row_id in ids:
        write_part(folder, rows_to_table([ok_row(row_id)]))
    return ids


def test_small_parts_are_merged_into_parts_of_the_target_size(tmp_path):
    ids = write_parts(tmp_path, 7)
    assert compact_parts(tmp_path, target_rows=3) == 6  # into 3 + 3; the seventh stays alone
    assert sorted(len(read_output_of(f)) for f in part_files(tmp_path)) == [1, 3, 3]
    assert sorted(read_output(tmp_path).column("id").to_pylist()) == sorted(ids)
    assert compact_parts(tmp_path, target_rows=3) == 0  # nothing left to merge but one small part


def read_output_of(path) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(path).column("id").to_pylist()


def test_a_merge_cut_short_by_a_crash_shows_no_row_twice_and_resume_finishes_it(tmp_path):
    ids = write_parts(tmp_path, 3)
    sources = sorted(p.name for p in tmp_path.glob("*.parquet"))
    # The merged part written, its sources not yet deleted: what a crash between the two leaves.
    write_part(tmp_path, read_output(tmp_path), replaces=sources)
    assert len(list(tmp_path.glob("*.parquet"))) == 4
    assert sorted(read_output(tmp_path).column("id").to_pylist()) == sorted(ids)  # each once
    state = prepare_output(tmp_path, resume=True, overwrite=False)
    assert state.done_ids == frozenset(ids) and state.kept_rows == 3
    assert [p.name for p in tmp_path.glob("*.parquet")] == [p.name for p in part_files(tmp_path)]
    assert len(part_files(tmp_path)) == 1


def test_a_running_job_merges_once_more_at_its_end(tmp_path):
    with BackgroundCompaction(tmp_path, every_s=3600):
        ids = write_parts(tmp_path, 5)
    assert len(part_files(tmp_path)) == 1
    assert sorted(read_output(tmp_path).column("id").to_pylist()) == sorted(ids)
