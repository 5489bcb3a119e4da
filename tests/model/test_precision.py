"""What each compute mode promises (pipeline/model/precision.py), measured on the real model:
a row-exact mode gives a row the same bits whatever shares its call, and a mode that is equal
up to near-ties moves a row's logits no more than its bound. Both run again under every
instruction set this CPU can be forced down to (tests/test_instruction_sets.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine import Engine, EngineConfig, StrategyConfig
from pipeline.model import short_attention
from pipeline.model.linear import ComputeMode
from pipeline.model.precision import MAX_DRIFT, exactness, row_drift
from pipeline.summarization.prompts import build_prompt
from tests.builders import sample_documents

BLOCKS = (2, 5, 11, 24)  # a short verify, longer ones (γ = 10, KnapSpec's), past the fused attention's 16 rows


def drift_of(engine: Engine) -> float:
    text = next(d["text"] for d in sample_documents() if d["id"] == "crs-r48179")
    prompt = build_prompt(engine.tokenizer, text, max_prompt_tokens=400).token_ids
    continuation = engine.generate(prompt, StrategyConfig("ar"), 24).token_ids
    return row_drift(engine.model, prompt, continuation, BLOCKS)


def test_the_promise_follows_the_mode_and_the_kernels():
    assert exactness(ComputeMode.FP16W, row_kernels=True).row_exact
    assert exactness(ComputeMode.BF16, row_kernels=True).row_exact
    assert not exactness(ComputeMode.FP32, row_kernels=True).row_exact  # transformers' math
    assert not exactness(ComputeMode.BF16, row_kernels=False).row_exact
    logits = torch.tensor([20.0, -3.0, 19.5])
    assert exactness(ComputeMode.FP16W, row_kernels=True).tie_gap(logits) == 0.0
    assert exactness(ComputeMode.BF16, row_kernels=False).tie_gap(logits) == pytest.approx(
        2 * MAX_DRIFT[ComputeMode.BF16] * 20
    )


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.skipif(short_attention.linear_kernel() is None, reason="row-exact modes need the kernel build")
@pytest.mark.parametrize("dtype", ["fp16w", "fp16w-bf16", "bf16"])
def test_a_row_exact_mode_gives_a_row_its_bits_in_any_verify_and_batch(dtype):
    engine = Engine(EngineConfig(dtype=dtype))
    assert engine.model.exactness.row_exact
    assert drift_of(engine) == 0.0


@pytest.mark.slow
@pytest.mark.exactness
def test_fp32_logits_drift_within_the_bound_its_near_ties_are_judged_by():
    engine = Engine(EngineConfig(dtype="fp32"))
    assert not engine.model.exactness.row_exact
    assert drift_of(engine) <= MAX_DRIFT[ComputeMode.FP32]


@pytest.mark.slow
@pytest.mark.exactness
def test_bf16_without_the_kernels_drifts_within_its_bound(monkeypatch):
    """PyTorch's own bf16 kernels (oneDNN here, cuBLAS on a GPU) pick their blocking by rows: a
    GPU's bf16 and a CPU without the kernel build are equal up to near-ties, by this bound."""
    monkeypatch.setattr(short_attention, "linear_kernel", lambda: None)
    short_attention.use_kernel(False)
    try:
        engine = Engine(EngineConfig(dtype="bf16"))
    finally:
        short_attention.use_kernel(True)
    assert not engine.model.exactness.row_exact
    assert drift_of(engine) <= MAX_DRIFT[ComputeMode.BF16]
