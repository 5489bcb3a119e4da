"""A forward's rows: what every item of one forward needs of them, made once per forward.

The host's part — each row's position, the pool's layout (packing.plan_pooled), the token
ids where they come as host values, the rows that need logits — is packed and moved to the
device in one copy (staging.py); everything the forward then reads of its rows (rotary
tables, masks, the kernel's limits) is made from those device tensors, so that the forward
itself never waits on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.model.attention import BatchRows, Branches
from pipeline.model.kv_cache import KVCache
from pipeline.model.layers import FUSED_ATTENTION_MIN_TOKENS
from pipeline.model.linear import KERNEL_MAX_ROWS
from pipeline.model.packing import kernel_ranges, logit_rows, plan_pooled
from pipeline.model.rotary import RotaryTables
from pipeline.model.staging import HostStaging


@dataclass(frozen=True)
class Rows:
    """What every item of one forward needs of its rows, made once per forward from metadata
    moved to the device in one copy (staging.py): how attention serves them, the rotary tables
    at their positions [rows, 1, head_dim], the [B, T] they fold into (B > 1: the DP's
    branches), the linears' kernel ranges (packing.kernel_ranges; None: each linear by its row
    count), the token ids on the device where they came as host values, and which rows need
    logits (`logits`, each block's choice; `logit_index`, those rows on the device)."""

    attention: BatchRows | Branches
    cos: torch.Tensor
    sin: torch.Tensor
    shape: tuple[int, int]
    ranges: list[tuple[int, int, bool]] | None
    sizes: tuple[int, ...] = ()
    token_ids: torch.Tensor | None = None
    logits: tuple[str, ...] | None = None
    logit_index: torch.Tensor | None = None


def step_rows(
    spans: Sequence[tuple[KVCache, int, int]],
    token_ids: Sequence[torch.Tensor | Sequence[int]] | None,
    logits: Sequence[str] | None,
    staging: HostStaging,
    rotary: RotaryTables,
    kernel: bool,
    packed_weights: bool,
    long_masks: bool = True,
) -> Rows:
    """The rows of a forward over `spans` (cache, start, rows); with each block's `token_ids`
    (host lists or tensors, or tensors on the device) and `logits` choices, also what the
    embedding and the LM head need. `kernel`: short blocks attend through the fused CPU kernel;
    `packed_weights`: the linears have packed 16-bit weights (packing.kernel_ranges);
    `long_masks`: long blocks attend through a mask (not when split, Attention.split_dtype)."""
    for cache, start, n in spans:
        cache.check_room(start + n)
    cos, sin = rotary.up_to(max(start + n for _, start, n in spans))
    sizes = tuple(n for _, _, n in spans)
    plan, own = plan_pooled(spans, FUSED_ATTENTION_MIN_TOKENS) if len(spans) > 1 else (None, [0])
    parts: list = [[p for _, start, n in spans for p in range(start, start + n)]]
    if plan is not None:
        parts += plan.parts
    host_ids = token_ids is not None and not any(_on_device(ids) for ids in token_ids)
    if host_ids:
        parts.append(token_ids[0] if len(token_ids) == 1 else np.concatenate([np.asarray(t) for t in token_ids]))
    wanted = tuple(logits) if logits is not None else None
    needs_index = wanted is not None and any(choice != "all" for choice in wanted)
    if needs_index:
        parts.append([row for block in logit_rows(wanted, sizes) for row in block])
    moved = staging.send(parts)  # the step's one copy to the device
    pooled = plan.on_device(moved[1:7], kernel) if plan is not None else None
    ids = moved[-1 - needs_index] if host_ids else None
    if token_ids is not None and not host_ids:  # drafted on the device: they stay there
        ids = torch.cat([torch.as_tensor(t, device=rotary.device) for t in token_ids])
    # Each request's rows through the kernel they would take alone (packed weights: by its own rows).
    ranges = kernel_ranges(sizes, KERNEL_MAX_ROWS) if packed_weights else None
    positions = moved[0]
    attention = BatchRows.of(spans, own, pooled, positions, kernel, long_masks)
    index = moved[-1] if needs_index else None
    return Rows(attention, cos[positions], sin[positions], (1, sum(sizes)), ranges, sizes, ids, wanted, index)


def _on_device(token_ids: torch.Tensor | Sequence[int]) -> bool:
    return isinstance(token_ids, torch.Tensor) and token_ids.device.type != "cpu"
