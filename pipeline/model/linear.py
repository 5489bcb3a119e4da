"""Linear layers in the engine's compute modes.

`fp32` is the exact reference. `bf16` keeps weights and activations in bfloat16
(the GPU default); on a CPU with the kernel build its decode and verify blocks run the
project's kernel over bf16 weights (one FMA chain per output in fp32, rounded to bf16 once),
because oneDNN's bf16 kernels round a row differently as the number of rows changes
(precision.py). `fp16w` stores weights in fp16 packed for FBGEMM and keeps
activations and accumulation in fp32: on CPU a 1-row product is memory bound, so
halving the weight bytes is what makes a decode step fast, and FBGEMM's fp16
kernel costs nearly the same for 2-4 rows as for one, which is what makes
verifying a speculative draft cheap. Where the kernel build exists (x86 with AVX2) the
project's own kernel (short_attention.linear_kernel) replaces FBGEMM's: the same bits, and
with AVX-512 0.5-0.7x the time.
Prefill chunks are compute bound and the fp16 kernels are slower than fp32 there, so
`fp16w` keeps an fp32 copy for them.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError
from pipeline.model import short_attention


class ComputeMode(str, enum.Enum):
    FP32 = "fp32"
    FP16W = "fp16w"
    BF16 = "bf16"

    @property
    def activation_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is ComputeMode.BF16 else torch.float32

    @property
    def weight_bytes(self) -> int:
        """Bytes per weight a decode step reads."""
        return 4 if self is ComputeMode.FP32 else 2


DTYPE_CHOICES = ("auto", "fp32", "fp16w", "bf16")

# Up to this many rows (decode and verify blocks, alone or batched) a product takes the packed
# 16-bit weights; above, it is compute bound (a prefill chunk) and takes PyTorch's linear: fp16w
# over its fp32 copy, bf16 over its bf16 weights.
KERNEL_MAX_ROWS = 32


def resolve_compute_mode(dtype: str, device: torch.device | str) -> ComputeMode:
    """Map a user's `--dtype` to a compute mode: `auto` is bf16 on GPU, fp16w on CPU."""
    device = torch.device(device)
    if dtype == "auto":
        return ComputeMode.BF16 if device.type == "cuda" else ComputeMode.FP16W
    try:
        mode = ComputeMode(dtype)
    except ValueError:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}") from None
    if mode is ComputeMode.FP16W and device.type != "cpu":
        raise ConfigError("dtype 'fp16w' uses FBGEMM's CPU kernels; on a GPU use 'bf16' or 'fp32'")
    if mode is ComputeMode.FP16W and not fp16w_available():
        raise ConfigError("dtype 'fp16w' needs a PyTorch build with FBGEMM; use 'fp32' on this machine")
    return mode


def fp16w_available() -> bool:
    return (
        hasattr(torch.ops.quantized, "linear_prepack_fp16")
        and torch.backends.quantized.supported_engines.count("fbgemm") > 0
    )


class Linear:
    """y = x W^T + b for x of shape [rows, in_features], in one compute mode."""

    __slots__ = ("_kernel", "_kernel_bias", "_packed", "bias", "mode", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: ComputeMode) -> None:
        self.mode = mode
        dtype = mode.activation_dtype
        self.weight = weight.to(dtype).contiguous()  # [out, in]
        self.bias = None if bias is None else bias.to(dtype).contiguous()
        self._packed = self._kernel = self._kernel_bias = None
        if mode is ComputeMode.FP32 or self.weight.device.type != "cpu":
            return
        self._kernel = short_attention.linear_kernel()
        if self._kernel is not None:
            # bf16: a second copy of the weights, packed (the prefill's linear reads the first).
            self._packed = self._kernel.half_linear_pack(self.weight, mode is ComputeMode.BF16)
            self._kernel_bias = None if self.bias is None else self.bias.float()
        elif mode is ComputeMode.FP16W:
            self._packed = torch.ops.quantized.linear_prepack_fp16(self.weight, self.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def packed(self) -> bool:
        """Whether short blocks take packed 16-bit weights (and so the kernel each row would get alone)."""
        return self._packed is not None

    def __call__(self, x: torch.Tensor, packed: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`packed`: use the packed 16-bit weights (True) or PyTorch's linear over the plain ones
        (False) whatever the rows; None chooses by the rows. A batch passes the choice each
        request would get alone. `out` (contiguous [rows, out_features]): where the result goes,
        so that a batch's row ranges fill one tensor instead of being concatenated (the copy of
        a prefill chunk's rows cost 5-10% of its step); the same kernel as without it, so the
        same bits."""
        if self._packed is not None and (x.shape[0] <= KERNEL_MAX_ROWS if packed is None else packed):
            if self._kernel is None:
                y = torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
                return y if out is None else out.copy_(y)
            if x.dtype == torch.float32:
                return self._kernel.half_linear(x, self._packed, self._kernel_bias, self.out_features, out)
            # bf16 rows widen exactly; the fp32 sums are rounded to bf16 once, as oneDNN rounds its own.
            y = self._kernel.half_linear(x.float(), self._packed, self._kernel_bias, self.out_features, None)
            return y.to(x.dtype) if out is None else out.copy_(y)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        # What F.linear runs for a matrix: addmm with a bias, mm without.
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)
