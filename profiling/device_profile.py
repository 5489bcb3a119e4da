"""A device's latency table for a model's layer shapes, and a pipeline stage's share of it.

What a node's profiler times is a model with the checkpoint's layer shapes and random weights.

Latency depends on shapes, dtype and device, not on the weights' values, so a profiler
need not read a checkpoint (tens of GB for a 70B model) to calibrate a node for it. It
builds enough layers that their weights exceed the caches — each layer is then timed
reading its weights from memory, as in decoding — but no more than the model has.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math

import torch

from pipeline.knapspec.latency import LatencyModel
from pipeline.model.linear import ComputeMode
from pipeline.model.loading import model_from_tensors
from pipeline.model.spec import ModelSpec
from pipeline.model.sublayer_model import SublayerModel
from profiling.calibration import CalibrationStore
from profiling.record import Calibration, CalibrationKey

# The calibration layout of a device table: per-layer costs, valid for any stage of any split.
LAYER_SHAPES_LAYOUT = "layer-shapes"

# Layer weights that no CPU or GPU cache holds: 4x the largest last-level caches of today.
PROFILE_WEIGHT_BYTES = 1 << 30


def layer_parameters(spec: ModelSpec) -> int:
    d, hd = spec.hidden_size, spec.head_dim
    attention = d * hd * (2 * spec.num_heads + 2 * spec.num_kv_heads)
    return attention + 3 * d * spec.intermediate_size


def profile_num_layers(spec: ModelSpec, mode: ComputeMode) -> int:
    """Layers to build: enough that their weights overflow the caches, at most the model's."""
    layer_bytes = layer_parameters(spec) * mode.weight_bytes
    return min(spec.num_layers, max(2, math.ceil(PROFILE_WEIGHT_BYTES / max(layer_bytes, 1))))


def shaped_tensors(spec: ModelSpec, num_layers: int, device: torch.device | str = "cpu", seed: int = 0) -> dict:
    """Random tensors named and shaped as a checkpoint's, for `num_layers` layers."""
    generator = torch.Generator(device=device).manual_seed(seed)
    d, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device) * 0.02

    tensors = {"model.embed_tokens.weight": rand(spec.vocab_size, d), "model.norm.weight": torch.ones(d, device=device)}
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(spec.vocab_size, d)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(spec.num_heads * hd, d)
        tensors[p + "self_attn.k_proj.weight"] = rand(spec.num_kv_heads * hd, d)
        tensors[p + "self_attn.v_proj.weight"] = rand(spec.num_kv_heads * hd, d)
        tensors[p + "self_attn.o_proj.weight"] = rand(d, spec.num_heads * hd)
        if spec.attention_bias:
            for name, rows in (("q", spec.num_heads), ("k", spec.num_kv_heads), ("v", spec.num_kv_heads)):
                tensors[p + f"self_attn.{name}_proj.bias"] = rand(rows * hd)
        if spec.qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = torch.ones(hd, device=device)
            tensors[p + "self_attn.k_norm.weight"] = torch.ones(hd, device=device)
        tensors[p + "input_layernorm.weight"] = torch.ones(d, device=device)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(d, device=device)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, d)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, d)
        tensors[p + "mlp.down_proj.weight"] = rand(d, inter)
    return tensors


def shaped_model(
    config, mode: ComputeMode, device: torch.device | str = "cpu", num_layers: int | None = None, seed: int = 0
) -> SublayerModel:
    """`config`'s model with random weights and `num_layers` layers (default: profile_num_layers)."""
    spec = ModelSpec.from_hf_config(config)
    num_layers = num_layers or profile_num_layers(spec, mode)
    config = copy.deepcopy(config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    return model_from_tensors(config, shaped_tensors(spec, num_layers, device, seed), mode, device)


def device_calibration(
    config,
    model_name: str,
    mode: ComputeMode,
    device: torch.device | str = "cpu",
    store_dir=None,
    **measure_kwargs,
) -> Calibration:
    """This device's per-layer calibration for `config`'s shapes, from the store or measured
    on a shaped model (and stored)."""
    model = shaped_model(config, mode, device)
    # The shapes are what was timed: two checkpoints of one name and other shapes are two keys.
    shapes = hashlib.sha256(repr(ModelSpec.from_hf_config(config)).encode()).hexdigest()[:8]
    key = CalibrationKey.for_model(model, f"{model_name}-{shapes}", layout=LAYER_SHAPES_LAYOUT)
    return CalibrationStore(store_dir).load_or_measure(model, key, **measure_kwargs)


def stage_table(table: LatencyModel, num_layers: int, has_head: bool) -> LatencyModel:
    """A pipeline stage's table from its device's: the same per-layer costs over its own
    layers; the fixed cost (embedding lookup, final norm, LM head: the head dominates) on
    the stage that holds the head."""
    return dataclasses.replace(table, num_layers=num_layers, t_fixed=table.t_fixed if has_head else 0.0)
