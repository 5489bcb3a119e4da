"""The bf16 attention of prompt chunks on CPUs with AVX512-BF16 (csrc/long_attention.cpp):
against exact attention over the same bf16 inputs, no further from it than PyTorch's bf16
flash kernel; a row's bits independent of the rows beside it; and where it is routed."""

from __future__ import annotations

import pytest
import torch

from pipeline.model import layers, short_attention

needs_kernel = pytest.mark.skipif(
    not short_attention.long_attention_available(), reason="needs AVX512-BF16 and the AVX-512 kernel build"
)


def exact_attention(q, keys, values, start: int, scale: float) -> torch.Tensor:
    """fp64 attention over the bf16-rounded inputs: q [T, H, D] at [start, start + T) -> [T, H * D]."""
    rows, heads, dims = q.shape
    groups = heads // keys.shape[0]
    q, k, v = (x.to(torch.bfloat16).double() for x in (q, keys[:, : start + rows], values[:, : start + rows]))
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)  # [H, S, D]
    scores = torch.einsum("thd,hsd->hts", q, k) * scale
    hidden = torch.arange(start + rows)[None, :] > (start + torch.arange(rows))[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hts,hsd->thd", probs, v).reshape(rows, heads * dims)


def kernel_attention(q, keys, values, start: int, scale: float) -> torch.Tensor:
    rows, heads, dims = q.shape
    out = torch.empty(rows, heads * dims)
    kv = [x[:, : start + rows].to(torch.bfloat16).contiguous() for x in (keys, values)]
    short_attention.load_kernel().long_attention_bf16(q.transpose(0, 1).to(torch.bfloat16).contiguous(), *kv, start,
                                                      scale, out)  # fmt: skip
    return out


CHUNKS = [(0, 1), (0, 37), (0, 200), (5, 64), (130, 67), (1000, 129)]
SHAPES = [(9, 3, 64), (4, 4, 128), (8, 2, 64)]


@needs_kernel
@pytest.mark.parametrize(("start", "rows"), CHUNKS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_a_chunks_attention_is_as_close_to_exact_as_pytorchs_bf16_kernel(start, rows, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(start + rows + head_dim)
    q = torch.randn(rows, heads, head_dim, generator=g) * 2
    keys = torch.randn(kv_heads, start + rows + 7, head_dim, generator=g)  # more keys than the chunk reads
    values = torch.randn(kv_heads, start + rows + 7, head_dim, generator=g)
    scale = head_dim**-0.5
    exact = exact_attention(q, keys, values, start, scale)
    got = kernel_attention(q, keys, values, start, scale).double()
    # PyTorch's flash kernel in bf16, the route the kernel replaces
    theirs = layers.split_attention(q, keys[:, : start + rows], values[:, : start + rows], start, scale,
                                    torch.bfloat16, use_kernel=False).double()  # fmt: skip
    ours, reference = (got - exact).abs().max().item(), (theirs - exact).abs().max().item()
    assert ours <= max(2 * reference, 1e-2), (ours, reference)
    assert torch.isfinite(got).all()


@needs_kernel
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """Rows [0, 37) of a chunk alone and inside a chunk of 200 rows at the same start: other
    tiles, other tasks, other threads, the same bits (a request's chunk alone and in a batch)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(200, 9, 64, generator=g)
    keys, values = torch.randn(3, 700, 64, generator=g), torch.randn(3, 700, 64, generator=g)
    whole = kernel_attention(q, keys, values, 500, 0.125)
    for first, end in ((0, 37), (3, 70)):
        part = kernel_attention(q[first:end], keys, values, 500 + first, 0.125)
        assert torch.equal(part, whole[first:end])


def test_chunks_take_the_kernel_only_where_it_is_faster(monkeypatch):
    """On a CPU with AVX512-BF16 but no AMX (whose bf16 flash kernel runs at its fp32 speed)
    and head sizes of 64's multiples; elsewhere PyTorch's flash kernel."""
    monkeypatch.setattr(short_attention, "long_attention_available", lambda: True)
    for amx, head_dim, expected in ((False, 64, True), (False, 128, True), (True, 64, False), (False, 80, False)):
        monkeypatch.setattr(short_attention, "cpu_has_amx", lambda amx=amx: amx)
        assert short_attention.long_attention_applies(head_dim) is expected
    monkeypatch.setattr(short_attention, "long_attention_available", lambda: False)
    monkeypatch.setattr(short_attention, "cpu_has_amx", lambda: False)
    assert not short_attention.long_attention_applies(64)
