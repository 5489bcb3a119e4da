"""A step as replayable pieces, so that a draft's sub-network runs without recapture.

KnapSpec's drafts skip items (sublayers), and the skip set changes with the plan. One graph
of the whole model cannot skip an item, and masking it inside the graph would still read its
weights, which is all that skipping saves. So a step is replayed as pieces: the embedding,
then each maximal run of consecutive items the plan executes, then the LM head. The full
model is one run (a step of `ar` replays three graphs); a draft that skips k items replays at
most k + 1 runs. Runs are captured the first time a plan needs them and kept while they are
used (a least-recently-used bound). `ITEMS` granularity captures one piece per item instead:
at most 2L + 2 pieces per bucket whatever the plans, at the price of 2L replays per step.
`PLANS` captures one piece per skip set: one replay per step, a capture per plan and bucket.

A capture runs its function once — that run is the step's own, on the step's own inputs —
and returns what replays it from then on: on a GPU a CUDA graph's replay, on a CPU the
function itself (a CPU has no launch cost to save; the pieces then run eagerly, which is how
the tests walk the same code).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable

import torch

Piece = Callable[[], None]
Capture = Callable[[Piece], Piece]


class Granularity(enum.Enum):
    RUNS = "runs"  # one piece per maximal run of executed items
    ITEMS = "items"  # one piece per item
    PLANS = "plans"  # one piece per skip set


def item_runs(num_items: int, skip: Collection[int]) -> list[tuple[int, int]]:
    """The maximal runs [first, end) of items not in `skip`, in order."""
    runs: list[tuple[int, int]] = []
    first = None
    for item in range(num_items):
        if item in skip:
            if first is not None:
                runs.append((first, item))
                first = None
        elif first is None:
            first = item
    if first is not None:
        runs.append((first, num_items))
    return runs


def pieces_of(num_items: int, skip: Collection[int], granularity: Granularity) -> list[tuple[tuple[int, int], ...]]:
    """The pieces a step with `skip` replays, in order, each the runs [first, end) of items it executes."""
    runs = item_runs(num_items, skip)
    if granularity is Granularity.PLANS:
        return [tuple(runs)] if runs else []
    if granularity is Granularity.RUNS:
        return [(run,) for run in runs]
    return [((item, item + 1),) for first, end in runs for item in range(first, end)]


def eager_capture(piece: Piece) -> Piece:
    piece()
    return piece


class CudaCapture:
    """Captures pieces as CUDA graphs into one memory pool. Every piece writes its result into
    buffers made outside any graph (graphs.static_step.StepBuffers), so a piece's temporaries
    are dead when its replay ends, and pieces sharing the pool may replay in any order (never
    concurrently: one stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, piece: Piece) -> Piece:
        # The step's own run, on a side stream as capture wants (lazy cuBLAS and allocator set-up
        # stays out of the graph); capture itself records without running.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            piece()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            piece()
        return graph.replay  # (which keeps its graph alive while the cache keeps it)


class PieceCache:
    """Captured pieces by key, at most `max_pieces` of them (the least recently used dropped)."""

    def __init__(self, capture: Capture, max_pieces: int) -> None:
        self.capture = capture
        self.max_pieces = max_pieces
        self._pieces: OrderedDict[Hashable, Piece] = OrderedDict()
        self.captures = 0  # how many captures it has made, evictions included
        self.capture_seconds = 0.0  # the host's time in them (each piece's first run included)

    def run(self, key: Hashable, make: Callable[[], Piece]) -> None:
        """Run the piece under `key`: replayed where it was captured, else made, captured (which
        runs it) and kept."""
        replay = self._pieces.get(key)
        if replay is not None:
            self._pieces.move_to_end(key)
            replay()
            return
        started = time.perf_counter()
        self._pieces[key] = self.capture(make())
        self.capture_seconds += time.perf_counter() - started
        self.captures += 1
        while len(self._pieces) > self.max_pieces:
            self._pieces.popitem(last=False)

    def __len__(self) -> int:
        return len(self._pieces)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pieces
