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
`fp16w` keeps an fp32 copy for them. `fp16w-bf16` is `fp16w` whose prefill chunks run their
products in bf16 instead, over a bf16 copy (half the bytes of the fp32 one): on CPUs with bf16
units (AVX512-BF16, AMX) those run 2-10x faster than fp32's, and decode and verify, the rows a
speculative request is exact in, keep fp16w's kernels. It is the CPU default there
(`cpu_has_bf16_units`).
"""

from __future__ import annotations

import enum
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError
from pipeline.model import short_attention

logger = logging.getLogger(__name__)


class ComputeMode(str, enum.Enum):
    FP32 = "fp32"
    FP16W = "fp16w"
    FP16W_BF16 = "fp16w-bf16"
    BF16 = "bf16"

    @property
    def activation_dtype(self) -> torch.dtype:
        """The residual stream's, the KV cache's, and the short blocks' dtype."""
        return torch.bfloat16 if self is ComputeMode.BF16 else torch.float32

    @property
    def prefill_dtype(self) -> torch.dtype:
        """The dtype long blocks' (prefill chunks') products run in, and their weights' copy."""
        return torch.bfloat16 if self in (ComputeMode.BF16, ComputeMode.FP16W_BF16) else torch.float32

    @property
    def fp16_weights(self) -> bool:
        """Whether short blocks read fp16 weights (fp16w's kernels)."""
        return self in (ComputeMode.FP16W, ComputeMode.FP16W_BF16)

    @property
    def weight_bytes(self) -> int:
        """Bytes per weight a decode step reads."""
        return 4 if self is ComputeMode.FP32 else 2


DTYPE_CHOICES = ("auto", "fp32", "fp16w", "fp16w-bf16", "bf16")

# Up to this many rows (decode and verify blocks, alone or batched) a product takes the packed
# 16-bit weights; above, it is compute bound (a prefill chunk) and takes PyTorch's linear: fp16w
# over its fp32 copy, bf16 over its bf16 weights.
KERNEL_MAX_ROWS = 32


def resolve_compute_mode(dtype: str, device: torch.device | str) -> ComputeMode:
    """Map a user's `--dtype` to a compute mode: `auto` is bf16 on GPU; on CPU fp16w-bf16 where
    the CPU has bf16 units, else fp16w."""
    device = torch.device(device)
    if dtype == "auto":
        if device.type == "cuda":
            return ComputeMode.BF16
        return ComputeMode.FP16W_BF16 if cpu_has_bf16_units() else ComputeMode.FP16W
    try:
        mode = ComputeMode(dtype)
    except ValueError:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}") from None
    if mode.fp16_weights and device.type != "cpu":
        raise ConfigError(f"dtype {dtype!r} uses FBGEMM's CPU kernels; on a GPU use 'bf16' or 'fp32'")
    if mode.fp16_weights and not fp16w_available():
        raise ConfigError(f"dtype {dtype!r} needs a PyTorch build with FBGEMM; use 'fp32' on this machine")
    if mode is ComputeMode.FP16W_BF16 and not cpu_has_bf16_units():
        logger.warning("this CPU has no bf16 units (AVX512-BF16, AMX): fp16w-bf16's prefill will be slow; use fp16w")
    return mode


@functools.cache
def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), as PyTorch's oneDNN does
    there; without them it widens bf16 to fp32 and gains nothing."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if all(hasattr(torch.cpu, probe) for probe in probes):
        return any(getattr(torch.cpu, probe)() for probe in probes)
    try:  # PyTorch without the probes: the kernel's own flags, on Linux
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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
        self.weight = weight.to(mode.prefill_dtype).contiguous()  # [out, in]: what long blocks read
        self.bias = None if bias is None else bias.to(mode.prefill_dtype).contiguous()
        self._packed = self._kernel = self._kernel_bias = None
        if mode is ComputeMode.FP32 or self.weight.device.type != "cpu":
            return
        self._kernel = short_attention.linear_kernel()
        full = weight.to(mode.activation_dtype)
        full_bias = None if bias is None else bias.to(mode.activation_dtype).float().contiguous()
        if self._kernel is not None:
            # A second copy of the weights, packed from the checkpoint's (not the long blocks'
            # bf16 copy): fp16w-bf16's short blocks get fp16w's bits.
            self._packed = self._kernel.half_linear_pack(full, mode is ComputeMode.BF16)
            self._kernel_bias = full_bias
        elif mode.fp16_weights:
            self._packed = torch.ops.quantized.linear_prepack_fp16(full.contiguous(), full_bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def held_bytes(self) -> tuple[int, int]:
        """Bytes of the weights long blocks read, and of the packed 16-bit ones short blocks read."""
        plain = self.weight.numel() * self.weight.element_size()
        if self._packed is None:
            return plain, 0
        if isinstance(self._packed, torch.Tensor):
            return plain, self._packed.numel() * self._packed.element_size()
        return plain, self.weight.numel() * 2  # FBGEMM's fp16 packing, opaque

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
        if x.dtype != self.weight.dtype:
            # fp16w-bf16's long blocks: fp32 rows rounded to bf16 once, the products in bf16, their
            # result left in bf16 (the next operation widens it, or takes it as it is).
            y = F.linear(x.to(self.weight.dtype), self.weight, self.bias)
            return y if out is None else out.copy_(y)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        # What F.linear runs for a matrix: addmm with a bias, mm without.
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)
