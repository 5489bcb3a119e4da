"""The Ray Data source of the summarization job: an InputSpec streamed as a dataset of DOCUMENT_SCHEMA rows."""

from __future__ import annotations

import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from pipeline.errors import ConfigError
from pipeline.summarization.inputs import InputSpec
from pipeline.summarization.readers import DOCUMENT_SCHEMA, read_functions

READ_TASK_CPUS = 0.1
# Memory a read task, and the job's filter and write tasks, declare: the worker running one
# peaked at 121 MiB of its own (USS; 214 MiB resident with what it shares) in the default run.
DATA_TASK_MEMORY = 256 * 2**20


def read_documents(spec: InputSpec, rows_per_block: int = 8) -> ray.data.Dataset:
    """A streaming Ray dataset with DOCUMENT_SCHEMA.

    One read task per file (txt: per `rows_per_block` files); each yields blocks of at most
    `rows_per_block` rows as it reads, so a file larger than memory streams. Ray's read
    operator may still join consecutive small blocks of one task up to
    DataContext.target_max_block_size before passing them on.
    """
    # Reading is light next to the model replicas, which hold most of the CPUs; a read task
    # asking for a whole CPU could wait forever behind them.
    return ray.data.read_datasource(
        DocumentDatasource(spec, rows_per_block), num_cpus=READ_TASK_CPUS, memory=DATA_TASK_MEMORY
    )


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
            for read_fn, size, files in read_functions(self.spec, self.rows_per_block)
        ]
