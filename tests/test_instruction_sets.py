"""The exactness tests (marker `exactness`) again, with PyTorch's CPU kernels forced down to each
instruction set below this CPU's own: oneDNN (bf16 linears and matmuls) through
ONEDNN_MAX_CPU_ISA, MKL (fp32) through MKL_ENABLE_INSTRUCTIONS, PyTorch's own vectorized kernels
and the kernel build's width (pipeline/model/short_attention.py) through ATEN_CPU_CAPABILITY.
A CPU of another kind takes those paths: an AVX2-only one, an AVX-512 one without bf16
instructions, a Zen 4 EPYC (AVX-512 with bf16, no AMX). A mode's promise
(pipeline/model/precision.py) must hold on each, so CI fails on a regression there whatever
CPU it runs on. (The bf16 mode's verify once parted from its decode on a Zen 4 EPYC and on this
suite forced to AVX-512 alone, while passing on an AMX Xeon.) The reruns (marker `isa`) take
several minutes each: `make test` leaves them to `make test-isa`, the second step of CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent

# From the least to the most the CPU may have: (the CPU flags it needs, what forces it).
LEVELS = {
    "avx2": (
        {"avx2", "fma"},
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    ),
    "avx512": (
        {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
        {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    ),
    "avx512-bf16": (
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
        {
            "ATEN_CPU_CAPABILITY": "avx512",
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        },
    ),
    "amx": ({"amx_bf16", "amx_tile"}, {}),
}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def levels_below_this_cpu(flags: set[str]) -> list[str]:
    """The levels this CPU has, less its own highest (the suite's normal run is that one)."""
    have = [name for name, (needs, _) in LEVELS.items() if needs <= flags]
    return have[:-1]


def test_levels_are_read_from_the_cpus_flags():
    zen4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    assert levels_below_this_cpu(zen4) == ["avx2", "avx512"]
    assert levels_below_this_cpu(zen4 | {"amx_bf16", "amx_tile"}) == ["avx2", "avx512", "avx512-bf16"]
    assert levels_below_this_cpu({"avx2", "fma"}) == []


@pytest.mark.isa
@pytest.mark.parametrize("level", [name for name in LEVELS if name != "amx"])
def test_exactness_holds_with_the_cpu_forced_down_to(level, tmp_path):
    if level not in levels_below_this_cpu(cpu_flags()):
        pytest.skip(f"this CPU runs {level} natively or cannot run it: the suite's own run covers it")
    # A cache of Inductor's own per level: its keys do not see the forced capability, and code
    # compiled for this CPU's widest vectors, reused under a narrower one, gives NaN or aborts.
    env = {**os.environ, **LEVELS[level][1], "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    marker = ["-m", "exactness and not gpu"]
    command = [sys.executable, "-m", "pytest", "-q", *marker, "-p", "no:cacheprovider", str(TESTS)]
    run = subprocess.run(command, check=False, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, f"exactness tests under {level}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
