"""Captured steps: a decode, verify or draft step run at a fixed shape over fixed buffers, so
that a GPU replays it as CUDA graphs instead of launching its kernels one by one from the host.

- `buckets`: the shapes a step is padded to.
- `static_step`: a bucket's step over fixed buffers, and its pieces.
- `pieces`: the pieces a step replays for a skip set, captured once each.
- `step_graphs`: which forwards a model's captured steps serve, and how one runs.
"""

from pipeline.model.graphs.pieces import Granularity
from pipeline.model.graphs.step_graphs import GraphSettings, StepGraphs

__all__ = ["Granularity", "GraphSettings", "StepGraphs"]
