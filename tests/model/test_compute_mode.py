"""Which compute mode a user's `--dtype` means, on which device and CPU."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.model import linear
from pipeline.model.linear import ComputeMode, resolve_compute_mode


@pytest.mark.skipif(not linear.fp16w_available(), reason="needs FBGEMM")
@pytest.mark.parametrize("bf16_units,expected", [(True, ComputeMode.FP16W_BF16), (False, ComputeMode.FP16W)])
def test_auto_on_a_cpu_prefills_in_bf16_where_it_has_bf16_units(monkeypatch, bf16_units, expected):
    monkeypatch.setattr(linear, "cpu_has_bf16_units", lambda: bf16_units)
    assert resolve_compute_mode("auto", "cpu") is expected
    assert resolve_compute_mode("auto", "cuda") is ComputeMode.BF16
    assert resolve_compute_mode("fp16w", "cpu") is ComputeMode.FP16W


@pytest.mark.skipif(not linear.fp16w_available(), reason="needs FBGEMM")
def test_fp16w_bf16_asked_for_without_bf16_units_runs_and_warns(monkeypatch, caplog):
    monkeypatch.setattr(linear, "cpu_has_bf16_units", lambda: False)
    assert resolve_compute_mode("fp16w-bf16", "cpu") is ComputeMode.FP16W_BF16
    assert "no bf16 units" in caplog.text


def test_the_modes_dtypes_and_their_refusals():
    assert ComputeMode.FP16W_BF16.activation_dtype == torch.float32  # the cache decode reads
    assert ComputeMode.FP16W_BF16.prefill_dtype == torch.bfloat16
    assert ComputeMode.FP16W.prefill_dtype == torch.float32 and ComputeMode.BF16.prefill_dtype == torch.bfloat16
    assert [m.fp16_weights for m in ComputeMode] == [False, True, True, False]
    for dtype in ("fp16w", "fp16w-bf16"):
        with pytest.raises(ConfigError, match="GPU"):
            resolve_compute_mode(dtype, "cuda")
    with pytest.raises(ConfigError, match="fp16w-bf16"):
        resolve_compute_mode("fp8", "cpu")
