"""The memory a replica declares: its weights' bytes as the modes lay them out, computed before
any load, equal to what a loaded model holds; and the refusal of replicas no node can hold."""

from __future__ import annotations

import pytest
import torch

from actors.resources import check_memory
from pipeline.errors import ConfigError
from pipeline.model import checkpoint, linear
from pipeline.model.footprint import (
    ALLOCATOR_SLACK,
    RUNTIME_BYTES,
    activation_bytes,
    checkpoint_bytes,
    kv_pool_bytes,
    replica_footprint,
    weight_bytes,
)
from pipeline.model.linear import ComputeMode
from pipeline.model.loading import model_from_tensors
from pipeline.model.spec import ModelSpec

MODES = [m for m in ComputeMode if not m.fp16_weights or linear.fp16w_available()]


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def held_bytes(model) -> int:
    """Every byte of weights a built model holds, read off its tensors."""

    def linear_held(lin) -> int:
        plain, packed = lin.held_bytes
        return plain + packed + tensor_bytes(lin.bias) + tensor_bytes(lin._kernel_bias)

    total = tensor_bytes(model.embed) + tensor_bytes(model.final_norm) + linear_held(model.lm_head)
    for layer in model.layers:
        total += sum(linear_held(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        total += sum(tensor_bytes(t) for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm))
    return total


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_the_weights_bytes_computed_from_the_config_are_what_a_loaded_model_holds(tiny_checkpoint, mode):
    config = checkpoint.load_config(tiny_checkpoint)
    spec = ModelSpec.from_hf_config(config)
    model = model_from_tensors(config, checkpoint.read_tensors(tiny_checkpoint), mode)
    if mode is ComputeMode.BF16 and linear.short_attention.linear_kernel() is None:
        pytest.skip("bf16 keeps one copy without the CPU kernel: the figure is an upper bound there")
    assert weight_bytes(spec, mode, on_cpu=True) == held_bytes(model)


def test_a_replica_is_its_runtime_weights_and_the_larger_of_its_load_and_its_work(tiny_llama):
    config = checkpoint.load_config(tiny_llama)
    spec = ModelSpec.from_hf_config(config)
    mode = ComputeMode.FP32
    size = checkpoint_bytes(tiny_llama)
    assert size == sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors")) > 0
    small = replica_footprint(spec, mode, "cpu", size, max_batch=1, slot_positions=64)
    large = replica_footprint(spec, mode, "cpu", size, max_batch=8, slot_positions=256)
    assert small.weights == large.weights == weight_bytes(spec, mode, on_cpu=True)
    assert large.kv_pool == kv_pool_bytes(spec, mode, 8, 256) == 8 * 256 * 2 * spec.num_layers * (
        spec.num_kv_heads * spec.head_dim * 4
    )
    assert large.activations == activation_bytes(spec, 8, 256) >= small.activations
    model = large.weights + max(size, large.kv_pool + large.activations)
    assert large.peak == RUNTIME_BYTES + model + int(ALLOCATOR_SLACK * model)
    # A KV budget caps the pool, as kv_room.KVRoom caps its slots.
    assert replica_footprint(spec, mode, "cpu", size, 8, 256, kv_budget_bytes=1000).kv_pool == 1000
    # A slot is never longer than the model's context.
    assert replica_footprint(spec, mode, "cpu", size, 8, 10**6).kv_pool == kv_pool_bytes(spec, mode, 8, 512)
    # On a GPU the weights, caches and activations are the device's: the host stages the checkpoint.
    gpu = replica_footprint(spec, ComputeMode.BF16, "cuda", size, 8, 256)
    assert gpu.weights == gpu.kv_pool == gpu.activations == 0 and gpu.loading == size


def test_replicas_no_node_can_hold_are_refused_with_the_figure(tiny_llama):
    spec = ModelSpec.from_hf_config(checkpoint.load_config(tiny_llama))
    footprint = replica_footprint(spec, ComputeMode.FP32, "cpu", checkpoint_bytes(tiny_llama), 4, 512)
    gib = 2**30
    check_memory(2, footprint, [footprint.peak * 2.5])  # two fit one node
    check_memory(2, footprint, [footprint.peak * 1.2, footprint.peak * 1.2])  # one on each
    with pytest.raises(ConfigError, match=r"a replica needs 0\.\d\d GiB \(weights .*KV pool .*runtime .*the largest "
                       r"node offers Ray 0\.10 GiB; lower --max-batch"):  # fmt: skip
        check_memory(1, footprint, [0.1 * gib, 0.05 * gib])
    with pytest.raises(ConfigError, match="3 replicas of .* do not fit .*: 2 fit\\); lower --replicas"):
        check_memory(3, footprint, [footprint.peak * 1.5, footprint.peak * 1.5])


def test_a_loaded_model_keeps_no_view_of_the_checkpoints_file(tiny_llama):
    """The checkpoint's tensors are views of its file, mapped whole: a weight kept as one (an fp32
    checkpoint's embedding and norms, in fp32) kept every page of the file resident."""
    config = checkpoint.load_config(tiny_llama)
    tensors = checkpoint.read_tensors(tiny_llama)
    spans = [(t.data_ptr(), t.data_ptr() + tensor_bytes(t)) for t in tensors.values()]
    model = model_from_tensors(config, tensors, ComputeMode.FP32)
    held = [model.embed, model.final_norm, model.lm_head.weight]
    for layer in model.layers:
        held += [layer.input_norm, layer.post_norm, layer.qkv.weight, layer.o.weight, layer.gate_up.weight]
    assert not [t for t in held if any(start <= t.data_ptr() < end for start, end in spans)]
