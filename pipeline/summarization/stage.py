"""The Ray Data glue of the summarization job: the `map_batches` stage and its dispatcher to
the replicas (the datasink that writes the stage's rows is sink.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pyarrow as pa
import ray
from ray.util.metrics import Counter

from pipeline.errors import KnapSpecError
from pipeline.logs import configure_worker_logging
from pipeline.summarization.dispatch import ReplicaDispatcher
from pipeline.summarization.output import ERROR_INFRASTRUCTURE, ERROR_INPUT, error_row, rows_to_table
from pipeline.summarization.rows import validate_row
from pipeline.summarization.summarizer import (
    DEFAULT_REQUEST_TIMEOUT,
    DocumentSummarizer,
    RequestTimeout,
    SummarizeSettings,
)

logger = logging.getLogger(__name__)


class SummarizeBatch:
    """Ray Data `map_batches` class: documents in, output rows (OUTPUT_SCHEMA) out.

    One instance summarizes one document at a time, waiting on the replicas its chunks went
    to; the job runs several instances so that many documents are in flight. Any failure of
    a document becomes its error row; the job goes on. The job passes the replicas' names, not
    their handles: Ray Data restarts a failed instance from its constructor arguments, and the
    restarted one looks the replicas up by name.
    """

    def __init__(
        self,
        replicas: list,
        settings: SummarizeSettings,
        tokenizer_path: str,
        duplicate_ids: dict[str, int] | set[str] | None = None,
        columns: tuple[str, str, str | None] = ("id", "text", "reference"),
        progress: str | None = None,
        request_timeout: RequestTimeout = DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        """`columns`: the input's id, text and (optional) reference summary columns; a row's
        `input_error` column, where the job's reader set one, makes it an error row.
        `progress`: the name of the run's progress actor (actors/progress.py), or None.
        `request_timeout`: how long a request may take before its replica is judged hung."""
        from pipeline.model import checkpoint

        configure_worker_logging()
        self.settings = settings
        self.id_column, self.text_column, self.reference_column = columns
        self.progress = ray.get_actor(progress) if progress else None
        # A Ray metric beside the replicas' (actors/metrics.py): documents by status.
        self.documents = Counter(
            "knapspec_documents", "documents summarized, by status", tag_keys=("model", "strategy", "status")
        )
        self.dispatcher = ReplicaDispatcher(replicas, self.progress, request_timeout)
        tokenizer = checkpoint.load_tokenizer(Path(tokenizer_path))
        self.summarizer = DocumentSummarizer(tokenizer, self.dispatcher.generate_many, settings)
        self.duplicate_ids = duplicate_ids or {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        return rows_to_table([self.summarize_row(row) for row in batch_rows(batch, self.id_column)])

    def summarize_row(self, row: dict) -> dict:
        started = time.perf_counter()
        out = self._summarize_row(row)
        tags = {"model": self.settings.model, "strategy": self.settings.strategy, "status": out["status"]}
        self.documents.inc(1, tags=tags)
        if self.progress is not None:
            record = {k: out.get(k) for k in ("id", "status", "num_chunks", "output_tokens", "error")}
            self.progress.document.remote(record | {"seconds": time.perf_counter() - started})
        return out

    def _summarize_row(self, row: dict) -> dict:
        row_id, text = row.get(self.id_column), row.get(self.text_column)
        problem = validate_row(row_id, text, row.get("input_error"), self.duplicate_ids)
        if problem is not None:
            return error_row(row_id, problem, self.settings.model, self.settings.strategy)
        reference = row.get(self.reference_column) if self.reference_column else None
        started = time.perf_counter()
        try:
            out = self.summarizer.summarize(row_id, text, reference)
        except KnapSpecError as e:  # what the document asked cannot be done (too long, no progress, ...)
            message, kind = str(e), ERROR_INPUT
        except Exception as e:  # a replica that could not recover, or a bug: the row says so, the job goes on
            logger.exception("Document %r failed", row_id)
            message, kind = f"{type(e).__name__}: {e}", ERROR_INFRASTRUCTURE
        else:
            # The driver shows a line per document (actors/progress.py); this one is for the worker's log.
            logger.debug(
                "Summarized %s: %d chunks, %d prompt + %d output tokens in %.1f s",
                row_id,
                out["num_chunks"],
                out["prompt_tokens"],
                out["output_tokens"],
                time.perf_counter() - started,
            )
            return out
        logger.warning("Document %r: %s", row_id, message)
        return error_row(row_id, message, self.settings.model, self.settings.strategy, kind)


def batch_rows(batch: pa.Table, id_column: str) -> list[dict]:
    """The batch's rows. A row holding a string that is not UTF-8 (the job's readers catch
    their own, but a user's dataset reaches the stage as it is) comes as its id and an
    `input_error`, so that it becomes its own error row and the others are summarized."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        pass
    rows = []
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        try:
            rows.append(row.to_pylist()[0])
        except UnicodeDecodeError as e:
            try:
                row_id = row.column(id_column).to_pylist()[0] if id_column in row.column_names else None
            except UnicodeDecodeError:
                row_id = None
            rows.append({id_column: row_id, "input_error": f"a value is not valid UTF-8: {e.reason} at byte {e.start}"})
    return rows
