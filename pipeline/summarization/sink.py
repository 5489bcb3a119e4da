"""The Ray Data sink of the summarize job: the output rows into Parquet part files.

Apart from the stage (stage.py) because the sink's write tasks run in worker processes of
their own: this module imports what writing needs (Ray Data, pyarrow), not the model's
stack (torch), which costs a fresh worker seconds at the end of every job.
"""

from __future__ import annotations

from pathlib import Path

from ray.data import Datasink
from ray.data.block import BlockAccessor

from pipeline.summarization.output import OUTPUT_COLUMNS, RunTotals, write_part


class SummarySink(Datasink[RunTotals]):
    """Writes each block as it arrives (one atomic Parquet part file per block), so a killed
    job loses only the rows in flight, and tallies what it wrote for the job's closing table."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.totals = RunTotals()

    def get_name(self) -> str:
        return "WriteSummaries"

    def write(self, blocks, ctx) -> RunTotals:
        totals = RunTotals()
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            if table.num_rows:
                write_part(self.folder, table.select(list(OUTPUT_COLUMNS)))
                totals.add_table(table)
        return totals

    def on_write_complete(self, write_result) -> None:
        for totals in write_result.write_returns:
            self.totals.merge(totals)
