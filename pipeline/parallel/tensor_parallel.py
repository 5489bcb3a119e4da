"""Tensor parallelism inside a pipeline stage: which slice of each tensor a rank holds.

Megatron's split of a decoder layer over T ranks: rank r holds query heads
[r·H/T, (r+1)·H/T) and KV heads [r·K/T, (r+1)·K/T) (query head h reads KV head
h // (H/K), so a rank's queries read only its own KV heads), and MLP columns
[r·I/T, (r+1)·I/T) of gate and up. The projections that come back to the residual
stream (o_proj, down_proj) are split along their inputs, so each rank computes a partial
sum; an all-reduce over the group adds them before the residual add (SublayerModel's
`reduce`). Norms, embeddings and the LM head are replicated. Each rank reads only its
slices from the checkpoint, and keeps a KV cache of only its KV heads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from pipeline.errors import ConfigError
from pipeline.model.spec import ModelSpec

# Split along the output rows: each rank's heads (q, k, v) or MLP columns (gate, up).
_ROW_SPLIT = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
# Split along the inputs: each rank's partial sum of the residual update.
_COLUMN_SPLIT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
# Added once after the all-reduce: each rank adds its 1/T share.
_SHARED_BIAS = ("self_attn.o_proj.bias",)


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """Raise ConfigError unless the model's heads and MLP split evenly over `size` ranks."""
    if size < 1:
        raise ConfigError(f"tensor parallel size must be >= 1, got {size}")
    for what, count in (
        ("attention heads", spec.num_heads),
        ("KV heads", spec.num_kv_heads),
        ("MLP columns", spec.intermediate_size),
    ):
        if count % size:
            raise ConfigError(f"--tensor-parallel {size} does not divide the model's {count} {what}")


def shard_config(config, size: int):
    """The config of one rank's model: its share of the heads and MLP columns."""
    if size == 1:
        return config
    spec = ModelSpec.from_hf_config(config)
    check_tensor_parallel(spec, size)
    local = copy.deepcopy(config)
    local.num_attention_heads = spec.num_heads // size
    local.num_key_value_heads = spec.num_kv_heads // size
    local.intermediate_size = spec.intermediate_size // size
    local.head_dim = spec.head_dim  # no longer hidden_size // heads
    return local


def shard_rule(name: str) -> str | None:
    """'rows', 'columns', 'shared_bias', or None (replicated) for a checkpoint tensor name."""
    if name.endswith(_COLUMN_SPLIT):
        return "columns"
    if name.endswith(_SHARED_BIAS):
        return "shared_bias"
    if any(part in name for part in _ROW_SPLIT):
        return "rows"
    return None


def shard_reader(rank: int, size: int) -> Callable[[str, Any], torch.Tensor]:
    """Reads rank `rank`'s slice of a tensor from a safetensors slice handle (only those bytes)."""
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is outside a tensor parallel group of {size}")

    def read(name: str, handle) -> torch.Tensor:
        rule = shard_rule(name) if size > 1 else None
        if rule is None:
            return handle[:]
        if rule == "shared_bias":
            return handle[:] / size
        shape = handle.get_shape()
        axis = 0 if rule == "rows" else 1
        part = shape[axis] // size
        if part * size != shape[axis]:
            raise ConfigError(f"{name} of shape {shape} does not split into {size} parts")
        lo, hi = rank * part, (rank + 1) * part
        return handle[lo:hi] if axis == 0 else handle[:, lo:hi]

    return read


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slice of an in-memory tensor (as shard_reader reads it from a file)."""

    class _Handle:
        def __getitem__(self, index):
            return tensor[index]

        def get_shape(self):
            return list(tensor.shape)

    return shard_reader(rank, size)(name, _Handle())


def collective_backend(device: str) -> str:
    """torch.distributed's backend for a group on `device`: NCCL between GPUs, Gloo on CPU."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def all_reduce_sum(partial: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's partial residual update (the process group must be joined)."""
    import torch.distributed as dist

    partial = partial.contiguous()
    dist.all_reduce(partial, op=dist.ReduceOp.SUM)
    return partial
