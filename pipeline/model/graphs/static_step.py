"""A step over fixed buffers: what a captured graph of it reads and writes.

A bucket's step (graphs.buckets) runs over views of buffers made once for the largest
bucket and shared by all (steps never overlap): the step's metadata — token ids, each row's
slot and position, the keys each row sees, each request's slot — in one int64 buffer filled
by one copy from the host; the residual stream; the rotary rows; the attention mask; the
logits. Its pieces (graphs.pieces) read and write only those, so a graph captured over them
replays any later step of the bucket once `load` has rewritten the metadata.

A prompt chunk's bucket (one request, its slot gathered) reads the same buffers; its LM head
runs on the chunk's last row only, found on the device from the metadata's last entry.

Padding: a bucket's idle requests, and the rows a request lacks to the bucket's rows per
request, write their keys and values into the pool's scratch position (one past every slot's
capacity, never read: kv_pool.py) and see their slot's first key only (a softmax over nothing
would be NaN); their logits are never handed out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.model.attention import SlotRows
from pipeline.model.flex import SlotBlocks
from pipeline.model.graphs.buckets import Bucket
from pipeline.model.kv_pool import KVPool, PooledCache
from pipeline.model.linear import KERNEL_MAX_ROWS
from pipeline.model.packing import kernel_ranges
from pipeline.model.step_rows import Rows

# The metadata buffer's parts, each one int64 per row: token id, slot, position, keys seen;
# then one slot per request, then a prompt chunk's last row.
ROW_PARTS = 4


class StepBuffers:
    """The buffers every bucket's step of one model over one pool views, sized for the largest
    step and the largest prompt chunk (whose logits are one row's). `flex`: no step reads the
    boolean mask (flex.py's block masks instead), so none is made."""

    def __init__(self, model, largest: Bucket, largest_chunk: Bucket | None = None, flex: bool = False) -> None:
        device, spec = model.device, model.spec
        buckets = [largest] if largest_chunk is None else [largest, largest_chunk]
        rows = max(b.num_rows for b in buckets)
        self.metadata = torch.zeros(ROW_PARTS * rows + largest.requests + 1, dtype=torch.long, device=device)
        host = torch.zeros_like(self.metadata, device="cpu")
        self.host = host.pin_memory() if torch.device(device).type == "cuda" else host
        self.hidden_states = torch.zeros(rows, spec.hidden_size, dtype=model.dtype, device=device)
        self.cos = torch.zeros(rows, 1, spec.head_dim, dtype=model.dtype, device=device)
        self.sin = torch.zeros_like(self.cos)
        mask_size = 0 if flex else max(b.num_rows * b.keys for b in buckets)
        self.mask = torch.zeros(mask_size, dtype=torch.bool, device=device)
        self.seen_rows = torch.zeros(rows, dtype=torch.int32, device=device)
        self.key_index = torch.arange(max(b.keys for b in buckets), device=device)
        self.logits = torch.zeros(largest.num_rows, spec.vocab_size, dtype=torch.float32, device=device)
        self._copied: torch.cuda.Event | None = None

    def send(self, values: torch.Tensor) -> None:
        """The host's int64 `values` into the start of the metadata buffer, in one copy (on a GPU
        from pinned memory, asynchronously: the next send waits for it before it rewrites)."""
        if self._copied is not None:
            self._copied.synchronize()
        n = values.numel()
        self.host[:n].copy_(values)
        self.metadata[:n].copy_(self.host[:n], non_blocking=self.host.is_pinned())
        if self.host.is_pinned():
            self._copied = torch.cuda.Event()
            self._copied.record()


class StaticStep:
    """One bucket's step: the pieces a graph captures (`embed`, `items`, `head`) over its views
    of the shared buffers, and `load` / `logits_of` around them."""

    def __init__(self, model, pool: KVPool, bucket: Bucket, buffers: StepBuffers, flex: bool = False) -> None:
        """`flex`: attention through flex.py (the bucket's keys are then the slots' capacity, but
        for a prompt chunk's, which reads its gathered slot up to the bucket's keys)."""
        if pool.scratch_position is None:
            raise ValueError("a captured step pads into its pool's scratch position: make the pool with scratch=True")
        # The pool's tensors and scratch position, never the pool: it owns its steps (KVPool.graphs).
        self.model, self.bucket, self.buffers = model, bucket, buffers
        self.scratch_position = pool.scratch_position
        m, r, width = bucket.num_rows, bucket.requests, bucket.keys
        meta = buffers.metadata
        self.token_ids, self.row_slots, self.positions, self.seen = meta[: ROW_PARTS * m].view(ROW_PARTS, m)
        self.request_slots = meta[ROW_PARTS * m : ROW_PARTS * m + r]
        self.last_row = meta[ROW_PARTS * m + r : ROW_PARTS * m + r + 1]
        self.hidden_states = buffers.hidden_states[:m]
        self.cos, self.sin = buffers.cos[:m], buffers.sin[:m]
        self.mask = None if flex else buffers.mask[: m * width].view(r, 1, 1, bucket.rows, width)
        self.seen_rows = buffers.seen_rows[:m].view(r, bucket.rows)
        self.logits = buffers.logits[: 1 if bucket.chunk else m]
        # The tables grown past the bucket's keys (and the scratch position) now: a graph holds
        # the tensors it captured.
        self.cos_table, self.sin_table = model.rotary.up_to(max(width, pool.scratch_position + 1))
        request_slots = self.request_slots if bucket.gathered else None
        capacity = width if bucket.gathered else pool.keys.shape[3]
        self.blocks = SlotBlocks(self.seen_rows, capacity) if flex else None
        attention = SlotRows(
            pool.keys, pool.values, r, bucket.rows, width, self.row_slots, self.positions, request_slots, self.mask,
            self.seen_rows, self.blocks,
        )  # fmt: skip
        packed = model.lm_head.packed  # the packed kernels of each request's rows alone (packing.kernel_ranges)
        ranges = kernel_ranges((bucket.rows,) * r, KERNEL_MAX_ROWS) if packed else None
        self.rows = Rows(attention, self.cos, self.sin, (1, m), ranges, (bucket.rows,) * r)

    def places(self, spans: Sequence[tuple[PooledCache, int, int]]) -> list[int]:
        """Each request's place among the bucket's: its slot where slots are read in place, else its order."""
        return list(range(len(spans))) if self.bucket.gathered else [cache.slot for cache, _, _ in spans]

    def load(self, spans: Sequence[tuple[PooledCache, int, int]], token_ids: Sequence) -> None:
        """This step's metadata, padded to the bucket, into the buffers: (slot cache, start, rows)
        per request with its token ids (host ints or a tensor). Padding rows write into slot 0's
        scratch position; an idle place's rows read its slot's first key (whatever it holds:
        finite, never NaN, KVPool.release), and nothing else reads what they make."""
        bucket, scratch = self.bucket, self.scratch_position
        m, t = bucket.num_rows, bucket.rows
        values = torch.zeros(ROW_PARTS * m + bucket.requests + 1, dtype=torch.long)
        ids, row_slots, positions, seen = values[: ROW_PARTS * m].view(ROW_PARTS, m)
        requests = values[ROW_PARTS * m : ROW_PARTS * m + bucket.requests]
        positions.fill_(scratch)
        seen.fill_(1)
        requests.copy_(torch.arange(bucket.requests))  # (an idle place gathered: its place's slot)
        on_device = []
        for i, (cache, start, n), tokens in zip(self.places(spans), spans, token_ids):
            at = slice(i * t, i * t + n)
            if isinstance(tokens, torch.Tensor) and tokens.device.type != "cpu":
                on_device.append((at, tokens))  # drafted on the device: copied there, not read back
            else:
                ids[at] = torch.as_tensor(tokens, dtype=torch.long)
            row_slots[at] = cache.slot
            positions[at] = torch.arange(start, start + n)
            seen[at] = positions[at] + 1
            requests[i] = cache.slot
            values[-1] = i * t + n - 1  # (a prompt chunk's last row: its bucket's one request)
        self.buffers.send(values)
        for at, tokens in on_device:
            self.token_ids[at].copy_(tokens)

    # The pieces: each reads and writes the buffers only.

    def embed(self) -> None:
        """Token embeddings, rotary rows and the attention masks of the loaded rows."""
        self.hidden_states.copy_(self.model.embed[self.token_ids])
        self.cos.copy_(self.cos_table[self.positions])
        self.sin.copy_(self.sin_table[self.positions])
        bucket = self.bucket
        self.seen_rows.copy_(self.seen.view(bucket.requests, bucket.rows))
        if self.blocks is not None:  # FlexAttention's block mask, from the same lengths
            self.blocks.update()
        else:
            seen = self.seen.view(bucket.requests, 1, 1, bucket.rows, 1)
            torch.ge(self.buffers.key_index[: bucket.keys], seen, out=self.mask)

    def items(self, runs: tuple[tuple[int, int], ...]) -> None:
        """The items of `runs` ([first, end) each, in order) over the residual stream, in place."""
        h = self.hidden_states
        for first, end in runs:
            for item in range(first, end):
                h = self.model.run_item(item, h, self.rows)
        self.hidden_states.copy_(h)

    def head(self) -> None:
        if self.bucket.chunk:  # the last row's logits, the one row a chunk hands out
            self.logits.copy_(self.model.logits(self.hidden_states.index_select(0, self.last_row), True))
        else:
            self.logits.copy_(self.model.logits(self.hidden_states, self.bucket.rows <= KERNEL_MAX_ROWS))

    def logits_of(
        self, spans: Sequence[tuple[PooledCache, int, int]], wanted: Sequence[str]
    ) -> list[torch.Tensor | None]:
        """Each request's logits ("all": its rows', "last": its last row's, "none": None) out of
        the buffer, in one copy (the next step rewrites it). A chunk's: "last" or "none"."""
        if self.bucket.chunk:
            if wanted[0] == "all":
                raise ValueError("a prompt chunk's captured step makes its last row's logits only")
            return [self.logits.clone() if wanted[0] == "last" else None]
        logits, t = self.logits.clone(), self.bucket.rows
        out: list[torch.Tensor | None] = []
        for i, (_, _, n), choice in zip(self.places(spans), spans, wanted):
            first = i * t if choice == "all" else i * t + n - 1
            out.append(None if choice == "none" else logits[first : i * t + n])
        return out
