"""A model built from a Hugging Face config and its tensors (names as in the checkpoint): the
weights read into the mode's layout (weights.py), the rotary embedding of the config (its
scaling included), the context the config allows."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pipeline.model.context import max_context_of
from pipeline.model.linear import ComputeMode
from pipeline.model.spec import ModelSpec
from pipeline.model.sublayer_model import SublayerModel
from pipeline.model.weights import read_weights


def model_from_tensors(
    config, tensors: Mapping[str, torch.Tensor], mode: ComputeMode, device: torch.device | str = "cpu"
) -> SublayerModel:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    spec = ModelSpec.from_hf_config(config)
    device = torch.device(device)
    weights = read_weights(spec, tensors, mode, device)
    return SublayerModel(
        spec=spec,
        layers=weights.layers,
        embed=weights.embed,
        final_norm=weights.final_norm,
        lm_head=weights.lm_head,
        rotary=LlamaRotaryEmbedding(config).to(device),
        mode=mode,
        max_context=max_context_of(config, spec),
        device=device,
    )
