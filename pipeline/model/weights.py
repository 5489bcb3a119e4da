"""A decoder's weights as the sublayer runner uses them: per layer the norms and the fused
linears (q/k/v as one, gate/up as one) in the compute mode, read from a checkpoint's tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError
from pipeline.model.linear import ComputeMode, Linear
from pipeline.model.spec import ModelSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    qkv: Linear  # d -> (H + 2 * kv_heads) * head_dim
    o: Linear  # H * head_dim -> d
    q_norm: torch.Tensor | None  # [head_dim], Qwen3 only
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # [d]
    gate_up: Linear  # d -> 2 * intermediate
    down: Linear  # intermediate -> d


@dataclass
class Weights:
    layers: list[LayerWeights]
    embed: torch.Tensor  # [V, d], in the activation dtype
    final_norm: torch.Tensor
    lm_head: Linear


def read_weights(
    spec: ModelSpec, tensors: Mapping[str, torch.Tensor], mode: ComputeMode, device: torch.device
) -> Weights:
    """The runner's weights from a state dict (names as in the checkpoint)."""

    def get(name: str) -> torch.Tensor:
        try:
            tensor = tensors[name]
        except KeyError:
            raise ConfigError(f"checkpoint is missing tensor {name!r}") from None
        # Always a copy: a checkpoint's tensors are views of the file mapped whole, and a weight
        # kept as such a view (an fp32 checkpoint's embedding or norms) kept every page of the
        # file resident for the process's life (SmolLM2: +513 MB beside its weights).
        return tensor.to(device=device, dtype=torch.float32, copy=True)

    def norm(name: str) -> torch.Tensor:
        return get(name).to(mode.activation_dtype)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        qkv_w = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        qkv_b = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if spec.attention_bias else None
        o_name = p + "self_attn.o_proj.bias"
        o_b = get(o_name) if o_name in tensors else None
        layers.append(
            LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=Linear(qkv_w, qkv_b, mode),
                o=Linear(get(p + "self_attn.o_proj.weight"), o_b, mode),
                q_norm=norm(p + "self_attn.q_norm.weight") if spec.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight") if spec.qk_norm else None,
                post_norm=norm(p + "post_attention_layernorm.weight"),
                gate_up=Linear(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]), None, mode),
                down=Linear(get(p + "mlp.down_proj.weight"), None, mode),
            )
        )
    embed = get("model.embed_tokens.weight")
    if spec.tie_word_embeddings:
        lm_head = Linear(embed, None, mode)
    elif "lm_head.weight" in tensors:
        lm_head = Linear(get("lm_head.weight"), None, mode)
    else:
        raise ConfigError("checkpoint has no lm_head.weight and does not tie it to the embeddings")
    return Weights(layers, embed.to(mode.activation_dtype), norm("model.norm.weight"), lm_head)
