"""A captured step's decode and verify attention through PyTorch's FlexAttention.

Every request's rows attend over their slot of the pool in place ([R, kv_heads, capacity,
head_dim], slot i for request i), the query groups of each KV head read its keys once (GQA),
and a block mask made from the device's tensors skips every 128-key block past a request's
last visible key: a step reads each request's own keys, not the slot's capacity, with shapes
that do not change as requests grow (one bucket of keys serves every length). Its mask
function hides, within the last block, the keys a row must not see. On a GPU the compiled
kernel is Triton's, captured into the step's graph like any other; on a CPU Inductor's C++
template runs it (the tests compare it there with the matmul route).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

BLOCK = 128  # keys per block of the mask (FlexAttention's default)
# Compiled versions flex_attention's code object may hold in a process (Dynamo's default is 8,
# and with fullgraph=True the ninth raises). On a GPU a version serves one batch size (static,
# below) and one side of Dynamo's specializations (one row or more, one block of queries or
# more); a CPU's tests and rehearsals make more (a compile per bucket there). The GPU check's
# whole sequence of calls stays well inside: tests/jobs/test_gpu_check.py counts them.
RECOMPILE_LIMIT = 64


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def compile_options(device_type: str) -> dict:
    """FlexAttention's compile settings on `device_type`, in one place for every device. On a
    GPU rows and keys are dynamic from the first compile, so one version serves every context
    and verification width (automatic dynamic shapes would compile each first shape static,
    then again at its first change: a compile more per batch size, 5-20 s each on a GPU); what
    must stay static is marked so (`static_dims`). Inductor's CPU template fails to compile
    dynamic shapes: a compile per bucket there."""
    return {"fullgraph": True, "dynamic": device_type == "cuda"}


@functools.cache
def compiled_flex(device_type: str, backend: str | Callable = "inductor"):
    """flex_attention compiled with `device_type`'s settings; `backend` other than Inductor only
    where a test replays a device's calls without its compiler (tests/jobs/test_gpu_check.py)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, backend=backend, **compile_options(device_type))


def static_dims(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: SlotBlocks) -> None:
    """Keep static the batch of every tensor FlexAttention reads, and the heads and head size.
    Inductor takes its decode kernel (a decode row's keys split across thread blocks, each KV
    head read once for its query group) only for a static batch and static heads; with either
    symbolic, one-row steps run through the prefill kernel, 128-row query tiles for 1-9 rows. A
    compile per batch size of the pool's ladder is the price: a handful."""
    for tensor in (queries, keys, values):  # [R, heads, rows or keys, head_dim]
        torch._dynamo.mark_static(tensor, (0, 1, 3))
    mask = [t for t in blocks.mask.as_tuple() if isinstance(t, torch.Tensor)]
    for tensor in (blocks.seen, *mask):  # (`seen`: the mask function's)
        torch._dynamo.mark_static(tensor, 0)


class SlotBlocks:
    """The block mask of `requests` requests of `rows` rows over slots of `capacity` keys, over
    the step's buffer of the keys each row sees (`seen`, int32 [R, T]); `update` rewrites it
    in place from that buffer, so a graph captured over it serves every later step. Rows past
    one block of queries (a prompt chunk, a multiple of BLOCK rows) have a row of key blocks
    per block of queries: its causal staircase, not the chunk's last row's keys for every row."""

    def __init__(self, seen: torch.Tensor, capacity: int) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        requests, rows = seen.shape
        if rows > BLOCK and rows % BLOCK:
            raise ValueError(f"a step of more than {BLOCK} rows per request needs a multiple of {BLOCK}, got {rows}")
        q_blocks = -(-rows // BLOCK)
        num_blocks = -(-capacity // BLOCK)
        self.seen = seen
        self.num_blocks = torch.ones(requests, 1, q_blocks, dtype=torch.int32, device=seen.device)
        indices = torch.arange(num_blocks, dtype=torch.int32, device=seen.device)
        self.indices = indices.expand(requests, 1, q_blocks, num_blocks).contiguous()

        def visible(b, h, q_idx, kv_idx):
            return kv_idx < seen[b, q_idx]

        self.mask = BlockMask.from_kv_blocks(
            self.num_blocks, self.indices, BLOCK_SIZE=BLOCK, mask_mod=visible, seq_lengths=(rows, capacity),
            compute_q_blocks=False,
        )  # fmt: skip

    def update(self) -> None:
        """Each block of queries' key blocks, up to its rows' furthest visible key."""
        requests, q_blocks = self.num_blocks.shape[0], self.num_blocks.shape[2]
        most = self.seen.view(requests, q_blocks, -1).amax(dim=2)
        torch.div(most + (BLOCK - 1), BLOCK, rounding_mode="floor", out=self.num_blocks.view(requests, q_blocks))


def flex_slot_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: SlotBlocks, scale: float
) -> torch.Tensor:
    """q [R * T, H, head_dim] over keys/values [R, kv_heads, capacity, head_dim] (slot i for
    request i, or request i's slot gathered; the step's own written first) -> [R * T, H * head_dim]."""
    num_requests = keys.shape[0]
    rows, num_heads, head_dim = q.shape
    queries = q.view(num_requests, rows // num_requests, num_heads, head_dim).transpose(1, 2)
    static_dims(queries, keys, values, blocks)
    flex = compiled_flex(q.device.type)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), torch.fx.experimental._config.patch(
        use_duck_shape=False
    ):
        out = flex(queries, keys, values, block_mask=blocks.mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows, num_heads * head_dim)
