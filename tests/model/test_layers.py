"""The layer math against Hugging Face's own functions, bit for bit: the decode step's short
forms of RMSNorm and the rotary embedding must round exactly as the reference does."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from pipeline.model.layers import apply_rotary, rms_norm, signed_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (4, 576), (3, 2, 9, 64), (7, 100)])
def test_rms_norm_is_hugging_faces(dtype, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=generator)).to(dtype)
    norm = LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=generator))
        assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,head_dim", [(1, 12, 64), (5, 4, 32), (3, 9, 128)])
def test_rotary_is_hugging_faces(dtype, rows, heads, head_dim):
    generator = torch.Generator().manual_seed(rows * heads)
    x = torch.randn(1, rows, heads, head_dim, generator=generator).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 50
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # Hugging Face's layout: [batch, heads, T, head_dim] with cos/sin [batch, T, head_dim].
    expected, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos[None], sin[None])
    got = apply_rotary(x, cos[:, None], signed_sin(sin[:, None]))
    assert torch.equal(got, expected.transpose(1, 2))
