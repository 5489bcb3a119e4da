"""A model's captured steps over one KV pool: which steps they serve, and how one runs.

A forward whose requests all sit in slots of the pool, with at most the grid's rows each
(decode, verification, a draft position), runs as its bucket's static step: the metadata
loaded in one copy, then the embedding, the item pieces of its skip set and the LM head
replayed (graphs.pieces). A prompt chunk that wants its last row's logits or none runs as its
chunk bucket's step; beside decode and verify rows, the forward runs as two captured steps,
the chunk's and the rest's (a request's rows touch only its own slot, so the order is
free). Anything else — a chunk longer than the largest chunk bucket or asking for every
row's logits, a request with a cache of its own, the DP's branches, a forward that asks for
hidden states — runs eagerly as before.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pipeline.model import items
from pipeline.model.flex import flex_available
from pipeline.model.graphs.buckets import Bucket, BucketGrid
from pipeline.model.graphs.pieces import CudaCapture, Granularity, PieceCache, eager_capture, pieces_of
from pipeline.model.graphs.static_step import StaticStep, StepBuffers
from pipeline.model.kv_pool import KVPool, PooledCache
from pipeline.model.packing import RequestRows

logger = logging.getLogger(__name__)

# Rows per request a captured step takes: a decode step's one, a draft position's one, and a
# verification of up to 8 drafted tokens; wider verifications run eagerly.
DEFAULT_ROWS = tuple(range(1, 10))


@dataclass(frozen=True)
class GraphSettings:
    """How a model captures its steps: `capture` "cuda" (CUDA graphs) or "eager" (the same
    static steps and pieces, run eagerly: a CPU's, and the tests'); `rows`, the rows per request
    of the buckets; `granularity`, a piece per run of items or per item (graphs.pieces);
    `max_pieces`, how many captured pieces are kept; `chunks`, prompt chunks captured too
    (buckets of 128 rows up to the model's prefill chunk); `attention`, "flex" (flex.py: each
    request's own keys, one bucket of keys), "matmul" (the slots' keys up to a bucket of keys,
    masked), or "auto" (flex on a GPU where PyTorch has it, else matmul); `fuse`, an item's
    element-wise work as Inductor kernels (fused.py; None: on a GPU)."""

    capture: str = "cuda"
    rows: tuple[int, ...] = DEFAULT_ROWS
    granularity: Granularity = Granularity.RUNS
    max_pieces: int = 4096
    chunks: bool = True
    attention: str = "auto"
    fuse: bool | None = None

    def __post_init__(self) -> None:
        if self.capture not in ("cuda", "eager"):
            raise ValueError(f"capture must be 'cuda' or 'eager', got {self.capture!r}")
        if self.attention not in ("auto", "flex", "matmul"):
            raise ValueError(f"attention must be 'auto', 'flex' or 'matmul', got {self.attention!r}")

    def fuse_on(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda" if self.fuse is None else self.fuse

    def flex_on(self, device: torch.device) -> bool:
        if self.attention == "auto":
            return torch.device(device).type == "cuda" and flex_available()
        return self.attention == "flex"


class StepGraphs:
    """A model's captured steps over one pool: the pool's bucket grid, the buffers every bucket's
    step views, each bucket's static step, and the captured pieces (kept on the pool, made at
    its first captured step: SublayerModel.forward_batch). The pool owns them and they refer
    to it weakly: a pool dropped frees its memory, graphs included, with its last reference,
    not at a later garbage collection (which capturing a CUDA graph no longer runs)."""

    def __init__(self, model, pool: KVPool, settings: GraphSettings) -> None:
        self.model, self.settings = model, settings
        self._pool = weakref.ref(pool)
        self.flex = settings.flex_on(model.device)
        chunk = model.prefill_chunk if settings.chunks else 0
        self.grid = BucketGrid.for_pool(pool.num_slots, settings.rows, pool.slot_capacity, self.flex, chunk)
        self.buffers = StepBuffers(model, self.grid.largest, self.grid.largest_chunk, self.flex)
        capture = CudaCapture(torch.device(model.device)) if settings.capture == "cuda" else eager_capture
        self.pieces = PieceCache(capture, settings.max_pieces)
        self.num_items = items.num_items(model.spec.num_layers)
        self._steps: dict[Bucket, StaticStep] = {}
        self.steps_run: Counter[Bucket] = Counter()
        logger.info(
            "captured steps over a pool of %d slots: %d buckets (requests %s, rows %s, keys %s; prompt chunks of %s "
            "rows), %s pieces, %s attention",
            pool.num_slots, len(self.grid), self.grid.requests, self.grid.rows, self.grid.keys,
            self.grid.chunks or "no", settings.granularity.value, "flex" if self.flex else "matmul",
        )  # fmt: skip

    @property
    def pool(self) -> KVPool | None:
        return self._pool()

    def parts(self, blocks: Sequence[RequestRows], wanted: Sequence[str]) -> list[tuple[Bucket, list[int]]] | None:
        """The captured steps that serve `blocks` with the logits `wanted`: (bucket, the blocks'
        indices) each, a prompt chunk's apart from the rest; None where one part has no bucket
        (the forward runs eagerly, whole)."""
        if not blocks or not all(isinstance(b.cache, PooledCache) and b.cache.pool is self.pool for b in blocks):
            return None
        widest = self.grid.rows[-1]
        chunks = [i for i, block in enumerate(blocks) if len(block.token_ids) > widest]
        parts = []
        for i in chunks:
            block = blocks[i]
            bucket = self.grid.chunk_for(len(block.token_ids), block.start + len(block.token_ids))
            if bucket is None or wanted[i] == "all":
                return None
            parts.append((bucket, [i]))
        rest = [i for i in range(len(blocks)) if i not in chunks]
        if rest:
            bucket = self.bucket_of([blocks[i] for i in rest])
            if bucket is None:
                return None
            parts.append((bucket, rest))
        return parts

    def bucket_of(self, blocks: Sequence[RequestRows]) -> Bucket | None:
        """The bucket whose captured step serves `blocks` (none of them a prompt chunk), or None
        (they run eagerly)."""
        for block in blocks:
            if not isinstance(block.cache, PooledCache) or block.cache.pool is not self.pool:
                return None
        rows = max(len(block.token_ids) for block in blocks)
        keys = max(block.start + len(block.token_ids) for block in blocks)
        highest = max(block.cache.slot for block in blocks)
        if self.flex:  # an idle place reads one block of its slot: the slots in place, always
            return self.grid.bucket_for(max(len(blocks), highest + 1), rows, keys)
        bucket = self.grid.bucket_for(len(blocks), rows, keys)
        if bucket is None or highest < bucket.requests:
            return bucket  # (the pool hands out low slots first: the usual case)
        return dataclasses.replace(bucket, gathered=True)

    def load(self, bucket: Bucket, blocks: Sequence[RequestRows]) -> StaticStep:
        """`bucket`'s step with the metadata of `blocks` loaded (one copy to the device)."""
        step = self._steps.get(bucket)
        if step is None:
            step = self._steps[bucket] = StaticStep(self.model, self._pool(), bucket, self.buffers, self.flex)
        spans = [(block.cache, block.start, len(block.token_ids)) for block in blocks]
        for cache, start, n in spans:
            cache.check_room(start + n)
        step.load(spans, [block.token_ids for block in blocks])
        return step

    def replay(self, step: StaticStep, piece: str | tuple[tuple[int, int], ...]) -> None:
        """One piece of a loaded step: "embed", "head", or runs of items ([first, end) each)."""
        if piece in ("embed", "head"):
            make = (lambda: step.embed) if piece == "embed" else (lambda: step.head)
        else:
            make = lambda: functools.partial(step.items, piece)
        self.pieces.run((step.bucket, piece), make)

    def run(
        self, bucket: Bucket, blocks: Sequence[RequestRows], skip: Collection[int], wanted: Sequence[str]
    ) -> list[torch.Tensor | None]:
        """`blocks` through the items not in `skip` as `bucket`'s step: each one's logits as `wanted`."""
        step = self.load(bucket, blocks)
        self.replay(step, "embed")
        for runs in pieces_of(self.num_items, skip, self.settings.granularity):
            self.replay(step, runs)
        self.replay(step, "head")
        self.steps_run[bucket] += 1
        return step.logits_of([(block.cache, block.start, len(block.token_ids)) for block in blocks], wanted)

    def run_parts(
        self, parts: Sequence[tuple[Bucket, list[int]]], blocks: Sequence[RequestRows], skip: Collection[int],
        wanted: Sequence[str],
    ) -> list[torch.Tensor | None]:  # fmt: skip
        """`blocks` through `parts` (StepGraphs.parts), one captured step each: the logits in order."""
        out: list[torch.Tensor | None] = [None] * len(blocks)
        for bucket, indices in parts:
            results = self.run(bucket, [blocks[i] for i in indices], skip, [wanted[i] for i in indices])
            for i, logits in zip(indices, results):
                out[i] = logits
        return out
