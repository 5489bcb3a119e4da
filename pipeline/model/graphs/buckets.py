"""The shapes a captured step comes in: buckets of (requests, rows per request, keys read).

A CUDA graph replays the kernels it captured on the buffers it captured them over, so a step
runs at one of a few fixed shapes and is padded up to it: more requests than it has (idle
ones, whose rows write into the pool's scratch position), more rows per request (a decode step's one
row, a verification's 1 + γ), and more keys than its longest request attends to. Each
dimension is a short ladder; a step larger than the largest bucket runs eagerly.

A prompt chunk is a bucket of its own, by token budget: one request of 128, 256, ... rows up
to the prefill chunk, its slot gathered, over a ladder of keys (a chunk reads its prompt so
far). In a step beside decode and verify rows, the chunk and the rest run as two captured
steps (StepGraphs.parts).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.errors import ConfigError

# Requests per step: every count up to 4, then steps of 8 (vLLM pads decode batches alike), so
# that padding a step costs at most a few idle requests' reads of the weights' worth of rows.
SMALL_REQUESTS = (1, 2, 4)
REQUEST_STEP = 8
# Keys a step's attention reads: powers of two from this many up to a slot's capacity. A step
# reads at most twice its longest request's keys, and a request crosses ~log2(capacity / 512)
# buckets in its life.
SMALLEST_KEYS = 512
# Rows of the smallest prompt-chunk bucket: FlexAttention's block of queries (flex.BLOCK).
SMALLEST_CHUNK = 128


@dataclass(frozen=True, order=True)
class Bucket:
    """A captured step's shape: `requests` requests of `rows` rows each, attending over the
    first `keys` positions of their slots. Request i of the step is slot i of the pool, read
    in place, unless `gathered`: then each request's slot is read into a copy first (a step
    whose slots do not all lie below its request count). A `chunk` bucket is one request's
    prompt chunk: its logits are its last row's, or none."""

    requests: int
    rows: int
    keys: int
    gathered: bool = False
    chunk: bool = False

    @property
    def num_rows(self) -> int:
        return self.requests * self.rows


def request_ladder(max_requests: int) -> tuple[int, ...]:
    """1, 2, 4, then multiples of REQUEST_STEP, the last one `max_requests`."""
    if max_requests < 1:
        raise ConfigError(f"a step needs at least one request, got {max_requests}")
    ladder = [n for n in SMALL_REQUESTS if n < max_requests]
    ladder += range(REQUEST_STEP, max_requests, REQUEST_STEP)
    return (*ladder, max_requests)


def key_ladder(capacity: int, smallest: int = SMALLEST_KEYS) -> tuple[int, ...]:
    """Powers of two from `smallest` below `capacity`, then `capacity` itself."""
    ladder, keys = [], smallest
    while keys < capacity:
        ladder.append(keys)
        keys *= 2
    return (*ladder, capacity)


def chunk_ladder(prefill_chunk: int, smallest: int = SMALLEST_CHUNK) -> tuple[int, ...]:
    """Rows of the prompt-chunk buckets: powers of two from `smallest` up to the prefill chunk
    (itself a power of two, context.prefill_chunk_for); () where the chunk is smaller."""
    ladder, rows = [], smallest
    while rows <= prefill_chunk:
        ladder.append(rows)
        rows *= 2
    return tuple(ladder)


@dataclass(frozen=True)
class BucketGrid:
    """The buckets a model's steps are captured in: every combination of the three ladders
    (ascending). `rows` lists the rows per request a step may have: 1 (decode) and 1 + γ for
    the verification widths in use. A prompt chunk's buckets: `chunks` rows (one request) over
    `chunk_keys` keys (none where `chunks` is empty)."""

    requests: tuple[int, ...]
    rows: tuple[int, ...]
    keys: tuple[int, ...]
    chunks: tuple[int, ...] = ()
    chunk_keys: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("requests", "rows", "keys", "chunks", "chunk_keys"):
            ladder = getattr(self, name)
            if name.startswith("chunk") and not ladder and not self.chunks:
                continue
            if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
                raise ConfigError(f"a bucket grid's {name} must be ascending positive counts, got {ladder}")

    @classmethod
    def for_pool(
        cls,
        max_requests: int,
        rows: Sequence[int],
        slot_capacity: int,
        one_key_bucket: bool = False,
        prefill_chunk: int = 0,
    ) -> BucketGrid:
        """`one_key_bucket`: every step reads up to the capacity (an attention that skips the keys
        past each request's own, flex.py); `prefill_chunk`: the model's prompt chunk (0: no
        chunk buckets). A chunk's keys climb the ladder either way: its slot is gathered."""
        keys = (slot_capacity,) if one_key_bucket else key_ladder(slot_capacity)
        rows = tuple(sorted(set(rows)))
        chunks = tuple(n for n in chunk_ladder(prefill_chunk) if n > rows[-1] and n <= slot_capacity)
        chunk_keys = key_ladder(slot_capacity) if chunks else ()
        return cls(request_ladder(max_requests), rows, keys, chunks, chunk_keys)

    def bucket_for(self, num_requests: int, rows: int, keys: int) -> Bucket | None:
        """The smallest bucket that holds a step of `num_requests` requests of at most `rows`
        rows each, reading at most `keys` keys; None where none does (the step runs eagerly)."""
        picks = []
        for ladder, need in ((self.requests, num_requests), (self.rows, rows), (self.keys, keys)):
            at = bisect.bisect_left(ladder, need)
            if at == len(ladder):
                return None
            picks.append(ladder[at])
        return Bucket(*picks)

    def chunk_for(self, rows: int, keys: int) -> Bucket | None:
        """The smallest chunk bucket that holds one request's `rows` prompt rows reading at most
        `keys` keys; None where none does (the chunk runs eagerly)."""
        at, key_at = bisect.bisect_left(self.chunks, rows), bisect.bisect_left(self.chunk_keys, keys)
        if at == len(self.chunks) or key_at == len(self.chunk_keys):
            return None
        return Bucket(1, self.chunks[at], self.chunk_keys[key_at], gathered=True, chunk=True)

    @property
    def largest(self) -> Bucket:
        return Bucket(self.requests[-1], self.rows[-1], self.keys[-1])

    @property
    def largest_chunk(self) -> Bucket | None:
        return Bucket(1, self.chunks[-1], self.chunk_keys[-1], True, True) if self.chunks else None

    def __len__(self) -> int:
        return len(self.requests) * len(self.rows) * len(self.keys) + len(self.chunks) * len(self.chunk_keys)
