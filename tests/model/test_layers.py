"""The layer math against Hugging Face's own functions, bit for bit: the decode step's short
forms of RMSNorm and the rotary embedding must round exactly as the reference does."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from pipeline.model.layers import (
    apply_rotary,
    block_mask,
    fused_attention,
    rms_norm,
    signed_sin,
    split_attention,
    split_attention_available,
)


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


@pytest.mark.skipif(not split_attention_available(), reason="PyTorch without its CPU flash kernel")
@pytest.mark.parametrize("start,num_tokens", [(0, 40), (1, 20), (37, 64), (600, 300)])
def test_a_long_block_split_at_its_start_is_the_masked_attention(start, num_tokens):
    """The keys before a prefill chunk in one unmasked call, its own causally, merged by their
    log-sum-exps: in fp32 the masked call's result to rounding, in bf16 to bf16's; the same
    bits into a given tensor."""
    generator = torch.Generator().manual_seed(start + num_tokens)
    q = torch.randn(num_tokens, 6, 16, generator=generator)
    keys, values = (torch.randn(2, start + num_tokens, 16, generator=generator) for _ in range(2))
    scale = 16**-0.5
    masked = fused_attention(q, keys, values, start, block_mask(num_tokens, start, q.device), scale)
    torch.testing.assert_close(split_attention(q, keys, values, start, scale, torch.float32), masked)
    bf16 = split_attention(q, keys, values, start, scale, torch.bfloat16)
    assert bf16.dtype == torch.float32 and bf16.shape == masked.shape
    torch.testing.assert_close(bf16, masked, atol=3e-2, rtol=3e-2)
    out = torch.full((num_tokens + 3, 6 * 16), float("nan"))
    split_attention(q, keys, values, start, scale, torch.bfloat16, out[2:-1])
    assert torch.equal(out[2:-1], bf16) and out[:2].isnan().all() and out[-1].isnan().all()
