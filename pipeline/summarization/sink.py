"""The Ray Data datasink of the summarization job: one atomic Parquet part file per block."""

from __future__ import annotations

from pathlib import Path

from ray.data import Datasink
from ray.data.block import BlockAccessor

from pipeline.summarization.output import OUTPUT_COLUMNS, RunTotals, write_part


class SummarySink(Datasink[RunTotals]):
    """Writes each block as it arrives, so a killed job loses only the rows in flight,
    and tallies what it wrote for the job's closing table."""

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
