"""The fused CPU kernel for short query blocks: the softmax attention it stands for, each row's
bits independent of the rows beside it, and the model's two routes through it (a request
alone, and its slot in a pooled batch) giving the same bits."""

from __future__ import annotations

import pytest
import torch

from pipeline.model import short_attention as sa
from pipeline.model.kv_pool import KVPool
from pipeline.model.layers import kernel_attention, pooled_attention
from tests.builders import pooled_rows

pytestmark = pytest.mark.skipif(not sa.cpu_supports_kernel(), reason="needs an x86 CPU with AVX2")

KV_HEADS, GROUPS = 3, 3
# This CPU's build, and on an AVX-512 CPU the AVX2 one too (what an AVX2-only machine runs): an
# instruction set below this CPU's own, so with the other reruns in `make test-isa` (its cold
# build takes most of a minute).
BUILDS = [pytest.param(sa.build_flags(), id="avx512" if "-mavx512f" in sa.build_flags() else "avx2")]
if sa.build_flags() != sa.FLAGS:
    BUILDS.append(pytest.param(sa.FLAGS, id="avx2", marks=pytest.mark.isa))


@pytest.fixture(params=BUILDS, scope="module")
def build(request):
    module = sa.build(request.param)
    assert module is not None
    return module


@pytest.fixture(scope="module")
def kernel(build):
    return build.short_attention


def reference(q, keys, values, limits):
    """Row by row: softmax(q k^T) v over the keys each row sees, in float64."""
    slots, heads, rows, _ = q.shape
    block = limits.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(slots):
        for h in range(heads):
            for m in range(rows):
                n = int(limits[s, m // (rows // block)])  # rows by position, then query head
                k, v = keys[s * heads + h, :n].double(), values[s * heads + h, :n].double()
                out[s, h, m] = torch.softmax(k @ q[s, h, m].double(), -1) @ v
    return out


@pytest.mark.parametrize("head_dim", sa.HEAD_DIMS)
@pytest.mark.parametrize("lengths", [(1,), (7, 300), (257, 513, 1000)])
def test_the_kernel_is_softmax_attention(kernel, head_dim, lengths):
    torch.manual_seed(head_dim + len(lengths))
    block = 3
    slots = len(lengths)
    q = torch.randn(slots, KV_HEADS, GROUPS * block, head_dim) * head_dim**-0.5
    keys = torch.randn(slots * KV_HEADS, 1100, head_dim)
    values = torch.randn(slots * KV_HEADS, 1100, head_dim)
    limits = torch.tensor([[max(n - block + 1 + t, 1) for t in range(block)] for n in lengths], dtype=torch.int32)
    out = kernel(q, keys, values, limits)
    torch.testing.assert_close(out.double(), reference(q, keys, values, limits), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [777, 1021])
def test_a_row_gets_the_same_bits_whatever_shares_its_call(kernel, n):
    """Alone, beside other rows, in a longer padded block: a row's output is bit for bit the same
    (a batch must give each request what it gets alone)."""
    torch.manual_seed(n)
    head_dim = 64
    keys, values = torch.randn(KV_HEADS, 1024, head_dim), torch.randn(KV_HEADS, 1024, head_dim)
    row = torch.randn(1, KV_HEADS, GROUPS, head_dim)
    alone = kernel(row, keys, values, torch.tensor([[n]], dtype=torch.int32))
    # A block of 4 positions whose position 2 is ours, each seeing one key more than the last.
    block = torch.randn(1, KV_HEADS, 4, GROUPS, head_dim)
    block[:, :, 2] = row
    seen = torch.tensor([[n - 2, n - 1, n, n + 1]], dtype=torch.int32)
    inside = kernel(block.reshape(1, KV_HEADS, 4 * GROUPS, head_dim), keys, values, seen)
    assert torch.equal(inside.view(1, KV_HEADS, 4, GROUPS, head_dim)[:, :, 2], alone)


def test_a_bf16_cache_gives_the_bits_of_the_same_cache_widened_to_fp32(kernel):
    """The bf16 mode's cache is read as it lies: bf16 keys and values widen exactly, so the
    arithmetic, and every bit of the result, is the fp32 kernel's over the widened cache."""
    torch.manual_seed(3)
    head_dim, block = 64, 4
    q = torch.randn(2, KV_HEADS, GROUPS * block, head_dim) * head_dim**-0.5
    keys = torch.randn(2 * KV_HEADS, 700, head_dim).bfloat16()
    values = torch.randn(2 * KV_HEADS, 700, head_dim).bfloat16()
    limits = torch.tensor([[300, 301, 302, 303], [697, 698, 699, 700]], dtype=torch.int32)
    out = kernel(q, keys, values, limits)
    assert torch.equal(out, kernel(q, keys.float(), values.float(), limits))
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        kernel(q, keys, values.float(), limits)


def test_a_row_that_sees_no_key_is_zero():
    q = torch.randn(1, 1, 2, 32)
    keys, values = torch.randn(1, 8, 32), torch.randn(1, 8, 32)
    out = sa.short_attention(q, keys, values, torch.tensor([[0]], dtype=torch.int32))
    assert torch.equal(out, torch.zeros_like(out))


def test_bad_shapes_are_refused():
    q = torch.randn(1, KV_HEADS, GROUPS, 48)
    keys = torch.randn(KV_HEADS, 8, 48)
    with pytest.raises(RuntimeError, match="head_dim"):
        sa.short_attention(q, keys, keys, torch.tensor([[8]], dtype=torch.int32))
    q = torch.randn(1, KV_HEADS, GROUPS, 64)
    keys = torch.randn(KV_HEADS, 8, 64)
    with pytest.raises(RuntimeError, match="limit past the keys"):
        sa.short_attention(q, keys, keys, torch.tensor([[9]], dtype=torch.int32))


def test_pooled_slots_get_the_bits_of_their_request_alone():
    """Three requests verifying blocks of 1, 4 and 2 rows from slots 0, 1 and 3 of one pool:
    each one's rows equal its own call over its own cache, bit for bit."""
    torch.manual_seed(1)
    head_dim, heads = 64, KV_HEADS * GROUPS
    pool = KVPool(1, KV_HEADS, head_dim, 4, 1024, torch.float32)
    caches = [pool.acquire(1024) for _ in range(4)]
    pool.release(caches[2])
    spans = [(caches[0], 600, 1), (caches[1], 100, 4), (caches[3], 900, 2)]
    for cache, start, n in spans:
        cache.keys[0, :, : start + n] = torch.randn(KV_HEADS, start + n, head_dim)
        cache.values[0, :, : start + n] = torch.randn(KV_HEADS, start + n, head_dim)
    qs = [torch.randn(n, heads, head_dim) for _, _, n in spans]
    layout, rest = pooled_rows(spans, max_rows=16)
    assert rest == []
    pooled = pooled_attention(torch.cat(qs), layout, 0, KV_HEADS, kernel=True)
    alone = [
        kernel_attention(
            q, *cache.view(0, start + n), torch.arange(start + 1, start + n + 1, dtype=torch.int32)[None], KV_HEADS
        )
        for q, (cache, start, n) in zip(qs, spans)
    ]
    assert torch.equal(pooled, torch.cat(alone))
    # And both are the matmuls' attention, up to rounding.
    torch.testing.assert_close(pooled, pooled_attention(torch.cat(qs), layout, 0, KV_HEADS), atol=1e-5, rtol=1e-4)


def test_the_switch_turns_the_kernel_off_for_models_built_after_it():
    sa.use_kernel(False)
    try:
        assert not sa.kernel_applies(True, torch.device("cpu"), 64)
        # A model built with the kernel keeps it: the module stays loaded.
        assert sa.load_kernel() is not None
    finally:
        sa.use_kernel(True)
    assert sa.kernel_applies(True, torch.device("cpu"), 64)
    assert not sa.kernel_applies(False, torch.device("cpu"), 64)  # (fp32 stays the reference)
    assert not sa.kernel_applies(True, torch.device("cpu"), 48)


@pytest.fixture(scope="module")
def row_norm(build):
    return build.rms_norm_rows


def test_the_row_norm_is_llamas_rms_norm_and_each_rows_bits_are_its_own(row_norm):
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(576, generator=generator)
    x = torch.randn(4100, 576, generator=generator) * 3  # a prefill chunk's rows: split among threads
    got = row_norm(x, weight, 1e-5)
    x64 = x.double()
    expected = weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(got.double(), expected, rtol=2e-6, atol=2e-6)
    for r in (0, 63, 64, 2049, 4099):  # alone, a row gets the bits it got among 4,100
        assert torch.equal(row_norm(x[r : r + 1], weight, 1e-5), got[r : r + 1])
        shifted = torch.empty(577)  # and wherever it lies in memory (no alignment regroups its sum)
        shifted[1:] = x[r]
        assert torch.equal(row_norm(shifted[1:].view(1, 576), weight, 1e-5), got[r : r + 1])
    heads = x[:8].view(8, 9, 64)[:, 2:5]  # a strided view (Qwen3's norm of query heads)
    assert torch.equal(row_norm(heads, weight[:64].contiguous(), 1e-5), row_norm(heads.contiguous(), weight[:64], 1e-5))


def test_the_row_norm_refuses_what_it_cannot_norm(row_norm):
    with pytest.raises(RuntimeError, match="fp32"):
        row_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="last size"):
        row_norm(torch.ones(2, 8), torch.ones(6), 1e-5)


@pytest.mark.parametrize("width", [1536, 1000, 13])  # SmolLM2's MLP, and widths no vector divides
def test_silu_mul_gives_a_row_its_bits_whatever_the_rows_and_threads(build, width):
    """PyTorch's element-wise kernels cut a call between a vector and a scalar exp by its rows and
    threads; the kernel build's SiLU(gate) * up takes one path for every element."""
    generator = torch.Generator().manual_seed(width)
    gate_up = torch.randn(25, 2 * width, generator=generator) * 4
    got = build.silu_mul_rows(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 3):
            torch.set_num_threads(num_threads)
            for rows in (1, 5, 25):
                assert torch.equal(build.silu_mul_rows(gate_up[:rows]), got[:rows])
            assert torch.equal(build.silu_mul_rows(gate_up[7:8]), got[7:8])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="fp32"):
        build.silu_mul_rows(gate_up.double())


def test_silu_mul_of_bf16_rows_rounds_the_fp32_path_once(build):
    """A bf16 prefill chunk's SiLU(gate) * up: the bits of widening it, the fp32 kernel and
    rounding to bf16 (a mixed step widens the chunk's rows first), NaN and infinities too."""
    generator = torch.Generator().manual_seed(11)
    wide = torch.randn(9, 4 * 37, generator=generator) * 6
    wide[0, 0], wide[1, 5], wide[2, 37] = float("nan"), float("inf"), -float("inf")
    gate_up = wide.bfloat16()[:, : 2 * 37]  # rows apart in memory, as a slice of a wider product
    got = build.silu_mul_rows(gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == (9, 37)
    expected = build.silu_mul_rows(gate_up.float()).bfloat16()
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(sa.silu_mul_rows(gate_up[3:4]), got[3:4])


needs_linear_kernel = pytest.mark.skipif(sa.linear_kernel() is None, reason="the 16-bit linears need the kernel build")


@pytest.fixture(scope="module")
def linear_build(build):
    assert build.half_linear_available()
    return build


@needs_linear_kernel
@pytest.mark.parametrize("shape", [(576, 576), (960, 576), (100, 40), (7, 3)])  # whole panels, a ragged last one
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fp16_linear_is_fbgemms_and_each_rows_bits_are_its_own(linear_build, shape, with_bias):
    kernel = linear_build
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(shape, generator=generator) * 0.05
    bias = torch.randn(shape[0], generator=generator) if with_bias else None
    packed = kernel.half_linear_pack(weight, False)
    fbgemm = torch.ops.quantized.linear_prepack_fp16(weight, bias)
    x = torch.randn(32, shape[1], generator=generator)
    got = kernel.half_linear(x, packed, bias, shape[0], None)
    expected = x.double() @ weight.half().double().t() + (0 if bias is None else bias.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # The same bits as FBGEMM's fp16 kernel (the mode ran that alone before: stored tables and
    # outputs keep their meaning), at every row count of a decode or verify block, in either
    # build (each block's rows and slices: 1-2 rows over three slices or 3-6 a pass on AVX2).
    for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 17, 32):
        assert torch.equal(got[:rows], torch.ops.quantized.linear_dynamic_fp16(x[:rows], fbgemm))
    for r in (0, 7, 8, 31):  # a row alone, or among others at another place: its own bits
        assert torch.equal(kernel.half_linear(x[r : r + 1], packed, bias, shape[0], None), got[r : r + 1])
        assert torch.equal(kernel.half_linear(x[[r, 3, 4]], packed, bias, shape[0], None)[:1], got[r : r + 1])
    out = torch.full((32, shape[0]), float("nan"))
    assert kernel.half_linear(x, packed, bias, shape[0], out) is out and torch.equal(out, got)


def bf16_sums_in_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 sums of bf16 products, one output at a time over k in order, then the bias: what
    every build must give bit for bit (a bf16 product is exact in fp32, so an FMA and a
    product then a sum round alike)."""
    x32, w32 = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = acc + x32[:, k : k + 1] * w32[:, k]
    return acc if bias is None else acc + bias.float()


@needs_linear_kernel
@pytest.mark.parametrize("shape", [(960, 576), (100, 40), (7, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_bf16_linear_sums_in_order_and_each_rows_bits_are_its_own(linear_build, shape, with_bias):
    """The bf16 mode's short blocks: bf16 weights widened exactly, one fp32 sum per output over k
    in order, in both builds; so a row's bits are the same in a 1-row decode, an 11-row verify
    and a 32-row batch, on any x86 CPU (oneDNN's bf16 kernels were not: see precision.py)."""
    kernel = linear_build
    generator = torch.Generator().manual_seed(8)
    weight = (torch.randn(shape, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(shape[0], generator=generator).bfloat16() if with_bias else None
    packed = kernel.half_linear_pack(weight, True)
    assert packed.dtype == torch.bfloat16
    x = torch.randn(32, shape[1], generator=generator).bfloat16().float()
    got = kernel.half_linear(x, packed, None if bias is None else bias.float(), shape[0], None)
    assert torch.equal(got, bf16_sums_in_order(x, weight, bias))
    for rows in (1, 2, 3, 5, 9, 11, 17):
        assert torch.equal(
            kernel.half_linear(x[:rows], packed, None if bias is None else bias.float(), shape[0], None), got[:rows]
        )


@needs_linear_kernel
def test_the_half_linear_refuses_what_it_cannot_multiply(linear_build):
    kernel = linear_build
    packed = kernel.half_linear_pack(torch.ones(48, 8), False)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.half_linear(torch.ones(2, 8, dtype=torch.float64), packed, None, 48, None)
    with pytest.raises(RuntimeError, match="packed"):
        kernel.half_linear(torch.ones(2, 6), packed, None, 48, None)
    with pytest.raises(RuntimeError, match="packed"):
        kernel.half_linear(torch.ones(2, 8), packed.float(), None, 48, None)
    with pytest.raises(RuntimeError, match="out"):
        kernel.half_linear(torch.ones(2, 8), packed, None, 48, torch.empty(3, 48))


@needs_linear_kernel
def test_a_fp16w_linear_takes_the_kernel_for_short_blocks_and_the_fp32_copy_for_long_ones():
    from pipeline.model.linear import KERNEL_MAX_ROWS, ComputeMode, Linear

    generator = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    linear = Linear(weight, bias, ComputeMode.FP16W)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 64, generator=generator)
    assert torch.equal(linear(x[:4]), sa.linear_kernel().half_linear(x[:4], linear._packed, bias, 96, None))
    torch.testing.assert_close(linear(x), x @ weight.t() + bias, rtol=1e-5, atol=1e-5)  # fp32 weights
    assert not torch.equal(linear(x)[:4], linear(x[:4]))  # (fp16 weights round differently)


@needs_linear_kernel
def test_a_fp16w_bf16_linear_is_fp16w_for_short_blocks_and_bf16_for_long_ones():
    """fp16w-bf16: short blocks get fp16w's bits (packed from the checkpoint's weights, not the
    bf16 copy); a long block's product runs in bf16 and stays bf16, also into an fp32 `out`."""
    from pipeline.model.linear import KERNEL_MAX_ROWS, ComputeMode, Linear

    generator = torch.Generator().manual_seed(8)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    mixed, fp16w = Linear(weight, bias, ComputeMode.FP16W_BF16), Linear(weight, bias, ComputeMode.FP16W)
    x = torch.randn(KERNEL_MAX_ROWS + 8, 64, generator=generator)
    assert torch.equal(mixed(x[:5]), fp16w(x[:5]))
    assert mixed.weight.dtype == torch.bfloat16 and mixed.weight.element_size() * 2 == fp16w.weight.element_size()
    long = mixed(x)
    assert long.dtype == torch.bfloat16
    assert torch.equal(long, torch.nn.functional.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()))
    out = torch.empty(x.shape[0] + 2, 96)
    mixed(x, False, out[1:-1])
    assert torch.equal(out[1:-1], long.float())


@needs_linear_kernel
def test_a_bf16_linear_rounds_the_kernels_sums_once_for_short_blocks():
    from pipeline.model.linear import KERNEL_MAX_ROWS, ComputeMode, Linear

    generator = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    linear = Linear(weight, bias, ComputeMode.BF16)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 64, generator=generator).bfloat16()
    short = linear(x[:KERNEL_MAX_ROWS])
    assert short.dtype == torch.bfloat16
    assert torch.equal(short, bf16_sums_in_order(x[:KERNEL_MAX_ROWS], linear.weight, linear.bias).bfloat16())
    assert all(torch.equal(linear(x[r : r + 1]), short[r : r + 1]) for r in range(KERNEL_MAX_ROWS))
    out = torch.empty(3, 96, dtype=torch.bfloat16)
    assert linear(x[:3], out=out) is out and torch.equal(out, short[:3])
    # A prefill chunk takes PyTorch's bf16 linear over the same weights.
    torch.testing.assert_close(linear(x).float(), (x.float() @ linear.weight.float().t() + bias), rtol=2e-2, atol=5e-2)


def test_a_build_lock_left_by_a_killed_build_is_taken_over(caplog):
    """A replica killed mid-compile left PyTorch's bare `lock` file, and every later build on the
    node waited on it forever."""
    import json
    import socket
    import subprocess
    import sys

    flags = sa.build_flags()
    directory = sa.build_dir(b"\0".join(path.read_bytes() for path in sa.SOURCES + sa.HEADERS), flags)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    ours = directory.with_name(directory.name + ".build.lock")
    sa._private_folder(directory.parent)
    directory.mkdir(exist_ok=True)
    ours.write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout), "started": "earlier"}))
    (directory / "lock").write_text("")  # PyTorch's, as a killed build leaves it
    with caplog.at_level("WARNING"):
        module = sa.build(flags)
    assert module is not None and "which is gone" in caplog.text
    assert not ours.exists() and not (directory / "lock").exists()


def test_kernels_load_only_from_a_folder_of_this_users_alone(tmp_path):
    folder = tmp_path / "kernels"
    sa._private_folder(folder)
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o777)  # anyone could put a library there
    with pytest.raises(PermissionError, match="not this user's alone"):
        sa._private_folder(folder)


def test_the_same_sources_at_another_path_load_the_built_kernel_without_compiling(tmp_path):
    """A Ray job's working directory is unpacked under the job's runtime resources: the package
    runs from a new path, and a build that named the sources by their path compiled again there
    (most of a minute, in every replica of every job after a change)."""
    import shutil
    import subprocess
    import sys

    flags = sa.build_flags()
    assert sa.build(flags) is not None  # built (or already there) from the package's own path
    directory = sa.build_dir(b"\0".join(path.read_bytes() for path in sa.SOURCES + sa.HEADERS), flags)
    library = next(directory.glob("*.so"))
    built = library.stat().st_mtime_ns
    copy = tmp_path / "unpacked"
    shutil.copytree(sa.CSRC.parent.parent, copy / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    code = "import pipeline.model.short_attention as sa; assert sa.load_kernel() is not None; print(sa.__file__)"
    run = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().startswith(str(copy))  # the copy ran, not the installed package
    assert library.stat().st_mtime_ns == built
