"""The host memory a model process needs, from the model's shape before anything loads: what a
replica declares to Ray (its `memory` resource), so that Ray places replicas only on nodes
where they fit, and a node too small for one is refused up front with the figure it needs.

A replica's process holds, at its peak:
- the runtime: Python, PyTorch and its kernels, the tokenizer, Ray's worker (RUNTIME_BYTES);
- the weights in the compute mode's layout (weights.py): on a CPU the long blocks' copy and the
  short blocks' packed 16-bit copy; on a GPU none of them (they are the device's);
- then either the load (the checkpoint's tensors as read, beside the weights being built) or
  the work: the KV pool's slots and one step's activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.model.context import prefill_chunk_for
from pipeline.model.linear import ComputeMode
from pipeline.model.spec import ModelSpec

# A replica's process besides its model: Python, PyTorch with its CPU kernels, transformers'
# tokenizer, Ray's core worker and the actor's threads. Measured as the peak resident memory of
# a replica of a 2-layer model in the job (632 MiB, of which its model's parts ~60 MiB; 2 cores
# of an AMD EPYC; docs/job.md, "Memory").
RUNTIME_BYTES = 576 * 2**20
# What the allocator keeps beyond the tensors alive (a load's freed temporaries, per-thread
# arenas), as a share of the model's parts: over SmolLM2's default runs its replica peaked at
# 1.09-1.12 times them beside the runtime; a fifth leaves room for a run's variation.
ALLOCATOR_SLACK = 0.20
# On a GPU, PyTorch's CUDA context and its kernels' images in host memory (an estimate: not
# measured on the GPU machines yet).
CUDA_HOST_BYTES = 1024 * 2**20
# The CPU kernel packs a linear's output rows in panels of this many (csrc/half_linear.cpp's kPanel).
PACKED_PANEL_ROWS = 48
# The widest step's logits: a batch's verify rows, each over the vocabulary in fp32.
VERIFY_ROWS_PER_REQUEST = 11


@dataclass(frozen=True)
class Footprint:
    runtime: int
    weights: int
    loading: int  # beside the weights while they are built: the checkpoint's tensors as read
    kv_pool: int
    activations: int

    @property
    def model(self) -> int:
        """The model's parts at their peak: its weights beside its load or its work."""
        return self.weights + max(self.loading, self.kv_pool + self.activations)

    @property
    def slack(self) -> int:
        return int(ALLOCATOR_SLACK * self.model)

    @property
    def peak(self) -> int:
        return self.runtime + self.model + self.slack

    def describe(self) -> str:
        parts = [("weights", self.weights), ("KV pool", self.kv_pool), ("activations", self.activations),
                 ("runtime", self.runtime), ("allocator slack", self.slack)]  # fmt: skip
        if self.loading > self.kv_pool + self.activations:
            parts.insert(1, ("while loading", self.loading))
        return f"{gib(self.peak)} ({', '.join(f'{name} {gib(size)}' for name, size in parts if size)})"


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def checkpoint_bytes(path: Path) -> int:
    """Bytes of a checkpoint's tensors as read: its safetensors files' sizes."""
    return sum(file.stat().st_size for file in Path(path).glob("*.safetensors"))


def linear_bytes(out_features: int, in_features: int, mode: ComputeMode, on_cpu: bool) -> int:
    """What a Linear (linear.py) of this shape holds: the long blocks' weights in the prefill
    dtype and, on a CPU in a 16-bit mode, the packed 16-bit copy short blocks read, its rows
    padded to whole panels (an upper bound where the CPU kernel is missing: FBGEMM's packing
    does not pad, and bf16 keeps one copy)."""
    size = _itemsize(mode.prefill_dtype) * out_features * in_features
    if on_cpu and mode is not ComputeMode.FP32:
        size += 2 * in_features * -(-out_features // PACKED_PANEL_ROWS) * PACKED_PANEL_ROWS
    return size


def weight_bytes(spec: ModelSpec, mode: ComputeMode, on_cpu: bool, layers: Sequence[int] | None = None,
                 embed: bool = True, head: bool = True, ranks: int = 1) -> int:  # fmt: skip
    """Bytes of the weights a process builds: `layers` (None: all) split over `ranks` tensor-
    parallel ranks, the embedding on the first stage, the final norm and LM head on the last."""
    s = spec
    d, hd = s.hidden_size, s.head_dim
    qkv = (s.num_heads + 2 * s.num_kv_heads) * hd
    per_layer = (
        linear_bytes(qkv, d, mode, on_cpu)
        + linear_bytes(d, s.num_heads * hd, mode, on_cpu)
        + linear_bytes(2 * s.intermediate_size, d, mode, on_cpu)
        + linear_bytes(d, s.intermediate_size, mode, on_cpu)
    ) // ranks
    act = _itemsize(mode.activation_dtype)
    per_layer += act * (2 * d + (2 * hd if s.qk_norm else 0))
    if s.attention_bias:  # the long blocks' bias, and the packed path's fp32 one
        packed_bias = 4 if on_cpu and mode is not ComputeMode.FP32 else 0
        per_layer += (_itemsize(mode.prefill_dtype) + packed_bias) * qkv // ranks
    count = s.num_layers if layers is None else len(layers)
    total = count * per_layer
    if embed:
        total += act * s.vocab_size * d
    if head:
        total += linear_bytes(s.vocab_size, d, mode, on_cpu) + act * d
    return total


def kv_pool_bytes(spec: ModelSpec, mode: ComputeMode, slots: int, slot_positions: int,
                  layers: int | None = None, ranks: int = 1) -> int:  # fmt: skip
    """A KV pool's keys and values: `slots` × `slot_positions` positions of `layers` (None: all)."""
    num_layers = spec.num_layers if layers is None else layers
    per_position = 2 * num_layers * spec.num_kv_heads * spec.head_dim * _itemsize(mode.activation_dtype) // ranks
    return slots * slot_positions * per_position


def activation_bytes(spec: ModelSpec, max_batch: int, slot_positions: int, ranks: int = 1) -> int:
    """One step's widest tensors, in fp32: a prefill chunk's rows through a layer (residual,
    norm, q/k/v, attention, gate and up, their product), or a batch's verify logits."""
    s = spec
    rows = min(prefill_chunk_for(s), slot_positions)
    per_row = 4 * s.hidden_size + ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim) // ranks
    per_row += 3 * s.intermediate_size // ranks
    logits = max_batch * VERIFY_ROWS_PER_REQUEST * s.vocab_size
    return 4 * max(rows * per_row, logits)


def replica_footprint(
    spec: ModelSpec,
    mode: ComputeMode,
    device: str,
    checkpoint_size: int,
    max_batch: int,
    slot_positions: int,
    kv_budget_bytes: int | None = None,
) -> Footprint:
    """A single-process replica's host memory (kv_room.KVRoom sizes the pool alike)."""
    on_cpu = torch.device(device).type == "cpu"
    slot_positions = min(slot_positions, spec.max_position_embeddings)
    if not on_cpu:
        # Weights, caches and activations live on the device; the host stages the checkpoint.
        return Footprint(RUNTIME_BYTES + CUDA_HOST_BYTES, 0, checkpoint_size, 0, 0)
    pool = kv_pool_bytes(spec, mode, max_batch, slot_positions)
    if kv_budget_bytes is not None:
        pool = min(pool, kv_budget_bytes)
    return Footprint(
        runtime=RUNTIME_BYTES,
        weights=weight_bytes(spec, mode, on_cpu),
        loading=checkpoint_size,
        kv_pool=pool,
        activations=activation_bytes(spec, max_batch, slot_positions),
    )


def stage_footprint(
    spec: ModelSpec,
    mode: ComputeMode,
    device: str,
    checkpoint_size: int,
    layers: range,
    first: bool,
    last: bool,
    ranks: int,
    kv_requests: int,
    slot_positions: int,
) -> Footprint:
    """One rank of one pipeline stage (`layers`, the embedding if `first`, the head if `last`),
    holding the caches of `kv_requests` requests for its layers: what its actor declares."""
    on_cpu = torch.device(device).type == "cpu"
    slot_positions = min(slot_positions, spec.max_position_embeddings)
    # A stage reads only its own tensors: its share of the checkpoint, as its share of the weights.
    own = weight_bytes(spec, ComputeMode.FP32, False, layers, first, last, ranks)
    loading = checkpoint_size * own // weight_bytes(spec, ComputeMode.FP32, False)
    if not on_cpu:
        return Footprint(RUNTIME_BYTES + CUDA_HOST_BYTES, 0, loading, 0, 0)
    return Footprint(
        runtime=RUNTIME_BYTES,
        weights=weight_bytes(spec, mode, on_cpu, layers, first, last, ranks),
        loading=loading,
        kv_pool=kv_pool_bytes(spec, mode, kv_requests, slot_positions, len(layers), ranks),
        activations=activation_bytes(spec, kv_requests, slot_positions, ranks),
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
