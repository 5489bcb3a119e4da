"""A fused CPU kernel for the attention of short query blocks (decode, verify), built on
first use from `csrc/short_attention.cpp`.

PyTorch's route — two batched matmuls around a softmax — reads a request's keys and
values as MKL's small-matrix kernels do: one query row of a KV head (its three query
heads) keeps the matmuls far from memory speed, and the scores make a round trip through
memory between them. The kernel reads each key and value once, computes the scores of
every query row of the head while the key is in cache, and fuses the softmax and the sum
of values (flash decoding: chunks of keys in parallel, combined exactly).

The same build carries the attention of bf16 prompt chunks on CPUs with AVX512-BF16 and no
AMX (`csrc/long_attention.cpp`, `long_attention_applies`): PyTorch's flash kernel runs bf16 at
its fp32 speed there. And the mode's RMS norm of fp32 rows (`csrc/row_norm.cpp`,
`rms_norm_rows`): a decode step norms one row 61 times, where PyTorch's dispatch costs
more than the arithmetic. And the linears of decode and verify blocks (`csrc/half_linear.cpp`,
`linear_kernel`): fp16 or bf16 weights, fp32 rows, one FMA chain per output; with fp16 weights
bit-equal to FBGEMM's fp16 kernel on the CPUs measured, the AVX-512 build in 0.5-0.7x its time
at 1 to 32 rows.

Every row's bits depend on that row alone, whatever else shares the call: with these kernels
a request's greedy tokens are the same alone, speculative and batched, bit for bit, on whatever
CPU runs them (each build rounds alike within itself; the AVX2 and AVX-512 builds of the attention
differ in their last bits; pipeline/model/precision.py says which mode guarantees what).

Only x86 CPUs with AVX2 and FMA take it (`torch.backends.cpu.get_cpu_capability()`), built
16 floats wide where that says AVX-512, and only in the `fp16w`, `fp16w-bf16` and `bf16` modes
(the bf16 cache read as it lies, widened to fp32 as it is loaded): `fp32` stays the reference
of transformers' own math.
`use_kernel(False)` turns it off (for a comparison). A machine that cannot build it (no C++
compiler) falls back to the matmuls, with one warning. The build lands under
`~/.cache/knapspec-ray/kernels/`, keyed by the source, the flags, PyTorch's version and the
CPU's capability, so a machine with another CPU builds its own.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import stat
from pathlib import Path
from types import ModuleType

import torch

from pipeline.locks import LockFile

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
KERNEL_FILES = ("short_attention.cpp", "row_norm.cpp", "half_linear.cpp", "silu_mul.cpp", "long_attention.cpp")
SOURCES = tuple(CSRC / name for name in KERNEL_FILES)
HEADERS = (CSRC / "vec_exp.h",)  # included by the sources: part of what a build is keyed by
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
AVX512_FLAGS = ("-mavx512f", "-mavx512vl")  # where the CPU has AVX-512: the 16-wide build
HEAD_DIMS = (16, 32, 64, 128)
# How long a build waits for another process's build of the same kernel (a cold compile takes
# ~1-2 minutes on 2 cores) before it gives up and runs the matmuls.
BUILD_WAIT_S = 600.0
# How a model's decode and verify attention runs (SublayerModel.attention_route); latency
# tables are measured and stored per route.
KERNEL_ROUTE, MATMUL_ROUTE = "kernel", "matmul"
_enabled = True


def use_kernel(enabled: bool) -> None:
    """Turn the kernel on or off for models built after this call (the matmuls otherwise);
    a model already built keeps the route it was built with."""
    global _enabled
    _enabled = enabled


def cpu_supports_kernel() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build_flags() -> tuple[str, ...]:
    """The compiler's flags for this CPU: AVX2 and FMA, and AVX-512 where it has that."""
    return FLAGS + (AVX512_FLAGS if torch.backends.cpu.get_cpu_capability() == "AVX512" else ())


def build_dir(source: bytes, flags: tuple[str, ...] | None = None) -> Path:
    """Where this source, built with these flags for this PyTorch and CPU, lives."""
    parts = [
        source,
        " ".join(build_flags() if flags is None else flags).encode(),
        torch.__version__.encode(),
        torch.backends.cpu.get_cpu_capability().encode(),
    ]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return Path.home() / ".cache" / "knapspec-ray" / "kernels" / f"short_attention-{key}"


@functools.cache
def load_kernel() -> ModuleType | None:
    """The compiled kernel, or None where it cannot run (see the module's doc)."""
    return build(build_flags()) if cpu_supports_kernel() else None


def build(flags: tuple[str, ...]) -> ModuleType | None:
    """The kernel compiled with `flags` (built once per key, then loaded); None, with one
    warning, where it cannot be built."""
    from torch.utils import cpp_extension

    directory = build_dir(b"\0".join(path.read_bytes() for path in SOURCES + HEADERS), flags)
    lock = LockFile(directory.with_name(directory.name + ".build.lock"))
    try:
        _private_folder(directory.parent)
        directory.mkdir(exist_ok=True)
        # PyTorch's own build lock is a bare file that a process killed mid-compile leaves behind,
        # and every later build waits on it forever. Ours names its holder: a dead one's is taken
        # over, and under ours a leftover bare lock is stale by construction.
        lock.acquire(wait_s=BUILD_WAIT_S)
        (directory / "lock").unlink(missing_ok=True)
        module = cpp_extension.load(
            name=f"knapspec_{directory.name.replace('-', '_')}",
            sources=[str(source) for source in _sources_in(directory)],
            extra_cflags=list(flags),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as error:  # no compiler, no ninja, a read-only home, a build lock held too long: matmuls
        logger.warning("short-block attention kernel not built (%s); using PyTorch's matmuls", error)
        return None
    finally:
        lock.release()
    logger.debug("short-block attention kernel loaded from %s", directory)
    return module


def _sources_in(directory: Path) -> list[Path]:
    """The sources as copies inside the build's own folder: ninja rebuilds when a source's path
    changes, and the same code runs from other paths (a Ray job's working directory is unpacked
    under each job's runtime resources), which would each compile the kernel again (~1 minute)."""
    folder = directory / "src"
    folder.mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        copy = folder / path.name
        data = path.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:  # an unchanged copy keeps its time: no work for ninja
            tmp = copy.with_name(copy.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(copy)
    return [folder / path.name for path in SOURCES]


def _private_folder(folder: Path) -> None:
    """Create `folder` for this user alone; refuse one that another user owns or others can write
    (whoever can write there chooses the code this process loads)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{folder} is not this user's alone (owner uid {info.st_uid}, mode {info.st_mode & 0o777:o})"
        )


def kernel_applies(mode_takes_kernel: bool, device: torch.device, head_dim: int) -> bool:
    """Whether a model whose mode takes the kernel (all but fp32), on this device, with this head size does."""
    return (
        _enabled and mode_takes_kernel and device.type == "cpu" and head_dim in HEAD_DIMS and load_kernel() is not None
    )


def short_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """q [S, kv_heads, T * groups, head_dim] (already scaled; each KV head's rows by position,
    then query head) over keys/values [S * kv_heads, n, head_dim] (fp32, or bf16); position t of
    slot s sees its keys [0, limits[s, t]) (int32 [S, T]). Returns q's shape and dtype: bf16
    queries are widened to fp32 and the result rounded back, per element."""
    out = _loaded().short_attention(q.float().contiguous(), keys, values, limits)
    return out.to(q.dtype)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of x's fp32 rows [..., d] by `weight` [d], as Hugging Face's LlamaRMSNorm
    (its rounding differs by the order of the sum); each row's bits depend on that row alone."""
    return _loaded().rms_norm_rows(x, weight, eps)


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of an MLP's fused [rows, 2 * I] gate and up -> [rows, I], in its dtype: every
    element through one vector path, so a row's bits depend on that row alone (PyTorch's
    element-wise kernels split a call between a vector and a scalar exp by rows and threads).
    bf16 rows are computed in fp32 and rounded once."""
    if gate_up.dtype not in (torch.float32, torch.bfloat16):
        return _loaded().silu_mul_rows(gate_up.float()).to(gate_up.dtype)
    return _loaded().silu_mul_rows(gate_up)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (PyTorch's flash kernel multiplies bf16 on them)."""
    return _cpu_has("_is_amx_tile_supported", "amx_tile")


@functools.cache
def long_attention_available() -> bool:
    """Whether the bf16 attention of prompt chunks runs here: the AVX-512 build, on a CPU with AVX512-BF16."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    return _cpu_has("_is_avx512_bf16_supported", "avx512_bf16") and load_kernel() is not None


def long_attention_applies(head_dim: int) -> bool:
    """Whether a bf16 prompt chunk's attention takes the kernel: head sizes of 64's multiples, on
    a CPU with AVX512-BF16 and no AMX (with AMX, PyTorch's flash kernel runs bf16 on the tiles:
    ~540 GFLOP/s on 2 cores of a Xeon, beyond the ~350 this kernel reached on 2 cores of an
    EPYC; it has not been timed on an AMX CPU)."""
    return _enabled and head_dim % 64 == 0 and not cpu_has_amx() and long_attention_available()


def long_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Causal attention of a chunk's queries q [H, T, head_dim] (bf16, unscaled) at positions
    [start, start + T) over keys/values [kv_heads, start + T, head_dim] (bf16) -> fp32
    [T, H * head_dim], into `out` where it is a contiguous fp32 tensor of that shape."""
    heads, rows, head_dim = q.shape
    target = out if out is not None and out.dtype == torch.float32 and out.is_contiguous() else None
    result = target if target is not None else torch.empty(rows, heads * head_dim)
    _loaded().long_attention_bf16(q.contiguous(), keys.contiguous(), values.contiguous(), start, scale, result)
    if out is not None and target is None:
        return out.copy_(result)
    return result


def _cpu_has(probe: str, flag: str) -> bool:
    """PyTorch's probe of the CPU (private: some versions lack it), else the flag in /proc/cpuinfo."""
    check = getattr(torch.cpu, probe, None)
    if check is not None:
        return bool(check())
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def linear_kernel() -> ModuleType | None:
    """The build, where it carries the 16-bit linears (AVX-512, or AVX2 with F16C); None
    elsewhere (the fp16w modes then run FBGEMM's kernel, the bf16 mode PyTorch's). Not turned
    off by `use_kernel`, which is about attention."""
    kernel = load_kernel()
    return kernel if kernel is not None and kernel.half_linear_available() else None


def _loaded() -> ModuleType:
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU kernels of the fp16w, fp16w-bf16 and bf16 modes are not available on this machine")
    return kernel
