"""The fused element-wise functions (pipeline/model/fused.py), compiled here by Inductor for the
CPU: the eager functions' values (bf16's rounding included), and a batch decoded with them
through captured steps as each request alone."""

from __future__ import annotations

import pytest
import torch

from pipeline.model import short_attention
from pipeline.model.fused import EAGER, fused_ops
from pipeline.model.graphs import GraphSettings
from pipeline.model.layers import signed_sin
from tests.builders import batch_through_captured_steps, load_tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_functions_give_the_eager_values(dtype):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    fused = fused_ops()
    x, weight = rand(5, 64), rand(64)
    qk, cos, sin = rand(5, 10, 32), rand(5, 1, 32), signed_sin(rand(5, 1, 32))
    gate_up = rand(5, 96)
    pairs = [
        (fused.norm(x, weight, 1e-5), EAGER.norm(x, weight, 1e-5)),
        (fused.rotary(qk, cos, sin), EAGER.rotary(qk, cos, sin)),
        (fused.gate(gate_up), EAGER.gate(gate_up)),
    ]
    for got, expected in pairs:
        assert got.dtype == expected.dtype == dtype
        # bf16: rounded where the eager functions round, so at most one unit apart (an fp32 sum's order)
        torch.testing.assert_close(got, expected, atol=1e-5 if dtype == torch.float32 else 2**-7, rtol=2**-7)
    # a second shape: the same compiled functions (dynamic now), the same values
    x = rand(3, 64)
    torch.testing.assert_close(fused.norm(x, weight, 1e-5), EAGER.norm(x, weight, 1e-5), atol=1e-5, rtol=2**-7)


@pytest.mark.exactness
def test_a_batch_through_fused_captured_steps_equals_each_request_alone(tiny_llama, monkeypatch):
    """As a GPU runs it (no CPU kernels): fused element-wise work in every forward, decode, verify
    and draft steps captured, against each request decoded alone eagerly."""
    monkeypatch.setattr(short_attention, "_enabled", False)
    monkeypatch.setattr(short_attention, "linear_kernel", lambda: None)
    _, model = load_tiny(tiny_llama)
    batch_through_captured_steps(model, GraphSettings(capture="eager", fuse=True), limits=(20, 12, 16, 6, 10))
    assert model.ops is fused_ops()
    model.use_graphs(None)
    assert model.ops is EAGER
