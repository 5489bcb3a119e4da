"""Checking the summarization job's rows: which ones cannot be summarized, and why.

A reader's `input_error`, a missing or duplicated id, or a missing text becomes the message
of the row's error output; the job goes on with the other rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ray.data


def count_ids(ds: ray.data.Dataset) -> Counter[str]:
    """How often each non-empty id occurs (id_census without the row count)."""
    return id_census(ds)[0]


def id_census(ds: ray.data.Dataset) -> tuple[Counter[str], int]:
    """How often each non-empty id occurs, and how many rows there are, in one pass.

    The ids stream through the driver into one counter: a Ray Data groupby costs several
    seconds of shuffle setup even for a handful of rows, and a counter of ids stays small
    next to the documents (tens of MB for a million ids). Null and empty ids are left out:
    validate_row reports them.
    """
    counts: Counter[str] = Counter()
    rows = 0
    for batch in ds.select_columns(["id"]).iter_batches(batch_format="pyarrow", batch_size=65536):
        counts.update(row_id for row_id in batch.column("id").to_pylist() if row_id)
        rows += batch.num_rows
    return counts, rows


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
