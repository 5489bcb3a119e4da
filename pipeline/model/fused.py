"""The element-wise work of an item, fused: RMSNorm, the rotary embedding and the MLP's SiLU
gate each as one Inductor kernel instead of four to eight eager ones.

Inside a captured step every kernel still costs its own start-up on the GPU (a microsecond
or two between kernels), and an 8B-shaped step runs ~1,200 of them eagerly; the products
and the attention are one or two kernels each already, the element-wise work between them
is most of the rest. Each function is compiled once for every layer (the weights are
arguments, not constants), its shapes dynamic from the first call. Inductor is told
to round where the eager code rounds (`emulate_precision_casts`), so bf16 results stay those
of the eager functions (tests/model/test_fused.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.model.layers import apply_rotary, rms_norm, silu_mul


@dataclass(frozen=True)
class ItemOps:
    """The element-wise functions an item runs: norm(x, weight, eps), rotary(x, cos, sin), gate(gate_up)."""

    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    gate: Callable[[torch.Tensor], torch.Tensor]


EAGER = ItemOps(rms_norm, apply_rotary, silu_mul)


# Each function still compiles once per dtype, rank and epsilon it meets (a process may load
# several models: the tests do); Dynamo's default budget of 8 per function would run out.
RECOMPILE_LIMIT = 64


@functools.cache
def fused_ops() -> ItemOps:
    def compiled(fn):
        inner = torch.compile(fn, fullgraph=True, dynamic=True, options={"emulate_precision_casts": True})

        @functools.wraps(fn)
        def run(*args):
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return inner(*args)

        return run

    return ItemOps(compiled(rms_norm), compiled(apply_rotary), compiled(silu_mul))
