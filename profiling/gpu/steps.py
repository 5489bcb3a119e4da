"""What a step costs on one device, eager and captured side by side.

A step is timed with the device synchronized after each call (median of `iterations` after two
warm-ups); the host's share is the time until the call returns, before synchronizing (what the
host spends issuing it); the kernels and launches of one step come from `torch.profiler`. The
bandwidth floor is the bytes a step must read — the weights once, every request's KV cache —
at the copy bandwidth measured on the device. A draft's bytes are the step's less its skipped
items' weights and, for attention, their layers' KV.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import time
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from pipeline.model import items
from pipeline.model.fused import EAGER, ItemOps, fused_ops
from pipeline.model.graphs import Granularity, GraphSettings, StepGraphs
from pipeline.model.packing import RequestRows, check_logit_choices
from profiling.benchmark.prefill import linear_shapes, prompt_flops

logger = logging.getLogger(__name__)

# Host calls that launch work on a GPU: a kernel each, or a whole captured graph.
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, iterations: int) -> float:
    """Median seconds of `fn` after two warm-up calls."""
    for _ in range(2):
        fn()
    synchronize(device)
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def host_seconds(fn: Callable[[], object], device: torch.device, iterations: int) -> float:
    """Median seconds until `fn` returns, the device idle before each call: the host's part."""
    times = []
    for _ in range(iterations):
        synchronize(device)
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    synchronize(device)
    return statistics.median(times)


def launches(fn: Callable[[], object], device: torch.device) -> dict[str, int]:
    """One call's device kernels and host launches (a graph's replay is one launch); on a CPU,
    its ATen operators."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.events()
    if device.type != "cuda":
        return {"kernels": sum(1 for e in events if e.name.startswith("aten::")), "launches": 0}
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"kernels": kernels, "launches": sum(1 for e in events if e.name in LAUNCH_CALLS)}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read plus write)."""
    num_bytes = (1 << 30) if device.type == "cuda" else (1 << 26)
    source = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / timed(lambda: target.copy_(source), device, 10)


def item_weight_bytes(model) -> tuple[int, int, int]:
    """Bytes of one attention item's weights, one MLP item's, and the LM head's."""

    def size(linear) -> int:
        return linear.weight.numel() * linear.weight.element_size()

    layer = model.layers[0]
    return size(layer.qkv) + size(layer.o), size(layer.gate_up) + size(layer.down), size(model.lm_head)


def position_bytes(model) -> int:
    """One position's keys and values in one layer."""
    spec = model.spec
    return 2 * spec.num_kv_heads * spec.head_dim * model.embed.element_size()


def step_bytes(model, batch: int, context: int, skip: frozenset[int] = frozenset()) -> int:
    """What a one-row step over `batch` requests of `context` positions must read."""
    attention, mlp, head = item_weight_bytes(model)
    kv = batch * context * position_bytes(model)
    total = head
    for item in range(items.num_items(model.spec.num_layers)):
        if item not in skip:
            total += attention + kv if items.is_attention(item) else mlp
    return total


def pool_fits(model, batch: int, positions: int) -> str | None:
    """Why a pool of `batch` slots of `positions` would not fit the device's free memory, or None."""
    needed = (batch + 1) * positions * position_bytes(model) * model.spec.num_layers
    if model.device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(model.device)
    if needed > 0.8 * free:
        return f"a KV pool of {needed / 2**30:.1f} GiB does not fit in {free / 2**30:.1f} GiB free"
    return None


# Ways to capture a step, timed beside the model's own (graphs/pieces.py, flex.py).
VARIANTS = {
    "runs, flex, fused": (Granularity.RUNS, "flex", True),
    "items, flex, fused": (Granularity.ITEMS, "flex", True),
    "plans, flex, fused": (Granularity.PLANS, "flex", True),
    "runs, matmul, fused": (Granularity.RUNS, "matmul", True),
    "runs, flex, unfused": (Granularity.RUNS, "flex", False),
}


@contextlib.contextmanager
def item_ops(model, ops: ItemOps) -> Iterator[None]:
    """`model`'s items run their element-wise work through `ops` inside (fused.py)."""
    saved, model.ops = model.ops, ops
    try:
        yield
    finally:
        model.ops = saved


def variant_costs(model, pool, blocks: list[RequestRows], draft: frozenset[int], iterations: int) -> dict:
    """The `ar` step and one draft's step through each of VARIANTS' captured steps over `pool`."""
    settings = model.graphs or GraphSettings(capture="eager")
    wanted = check_logit_choices(blocks, "all")
    costs = {}
    for name, (granularity, attention, fuse) in VARIANTS.items():
        graphs = StepGraphs(model, pool, dataclasses.replace(settings, granularity=granularity, attention=attention))
        with item_ops(model, fused_ops() if fuse else EAGER):  # (what its pieces capture)
            bucket = graphs.bucket_of(blocks)
            costs[name] = {}
            for kind, skip in (("ar", frozenset()), ("draft", draft)):
                step = functools.partial(graphs.run, bucket, blocks, skip, wanted)
                costs[name][f"{kind}_ms"] = 1e3 * timed(step, model.device, iterations)
            costs[name]["captures"] = graphs.pieces.captures
    return costs


def error_text(error: BaseException) -> str:
    """How the report names a failure: its type and message."""
    return f"{type(error).__name__}: {error}"


def out_of_time(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


OUT_OF_TIME = "out of the check's time (--time-budget)"


def step_costs(
    model, batch_sizes: list[int], contexts: list[int], verify_rows: list[int], iterations: int,
    skips: dict[str, frozenset[int]], variant_draft: str | None = None, deadline: float | None = None,
) -> Iterator[dict]:  # fmt: skip
    """Per context and batch, a row as soon as it is measured: the `ar` step eager and captured
    (ms, the floor's fraction, kernels and launches, host ms), verify(k) over one row and each
    draft's step over the `ar` step (captured), with the share of the step's bytes each draft
    skips; and with `variant_draft`, the `ar` step and that draft's through each of VARIANTS.

    Past `deadline` (time.perf_counter's) no new batch and context starts (reported skipped)
    and a started one measures no further part (its `left` names them), so that the stages
    after this one still run within the check's time. A batch and context that fails keeps
    what it measured, with its `error`; the others still run."""
    device = model.device
    bandwidth = copy_bandwidth(device)
    for context in contexts:
        for batch in batch_sizes:
            row: dict = {"batch": batch, "context": context}
            if out_of_time(deadline):
                logger.warning("batch %d, context %d skipped: out of the check's time", batch, context)
                row["skipped"] = OUT_OF_TIME
            else:
                try:
                    measure_step(model, row, bandwidth, verify_rows, iterations, skips, variant_draft, deadline)
                except Exception as error:  # noqa: BLE001 — one batch and context's failure, reported in its row
                    logger.error("batch %d, context %d failed:\n%s", batch, context, traceback.format_exc())
                    row["error"] = error_text(error)
                if device.type == "cuda":  # (its pool went with measure_step's frame: kv_pool.py, StepGraphs)
                    torch.cuda.empty_cache()
            yield row


@torch.inference_mode()
def measure_step(
    model, row: dict, bandwidth: float, verify_rows: list[int], iterations: int, skips: dict[str, frozenset[int]],
    variant_draft: str | None, deadline: float | None,
) -> None:  # fmt: skip
    """One batch and context's measurements, into `row` as each part ends (step_costs)."""
    device, batch, context = model.device, row["batch"], row["context"]
    capacity = context + max(verify_rows)
    too_big = pool_fits(model, batch, capacity)
    if too_big is not None:
        logger.warning("batch %d, context %d skipped: %s", batch, context, too_big)
        row["skipped"] = too_big
        return
    pool = model.new_pool(batch, capacity)
    caches = [pool.acquire(capacity) for _ in range(batch)]
    for cache in caches:
        cache.commit(context)  # what the keys hold does not change what reading them costs

    def step(k: int, skip: frozenset[int] = frozenset(), captured: bool = True) -> Callable[[], object]:
        blocks = [RequestRows(c, list(range(10, 10 + k)), c.length) for c in caches]
        if captured:
            return lambda: model.forward_batch(blocks, skip=skip)
        return lambda: model.run_blocks(blocks, skip, "all")

    floor = step_bytes(model, batch, context) / bandwidth
    row["floor_ms"] = floor * 1e3
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    for path, captured in (("eager", False), ("graphs", True)):
        # The eager step is the plain one: kernel by kernel, its element-wise work unfused.
        with item_ops(model, model.ops if captured else EAGER):
            seconds = timed(step(1, captured=captured), device, iterations)
            host = host_seconds(step(1, captured=captured), device, iterations)
            counted = launches(step(1, captured=captured), device)
        row[f"{path}_ms"], row[f"{path}_floor_over_step"] = seconds * 1e3, floor / seconds
        row[f"{path}_host_ms"] = host * 1e3
        row[f"{path}_kernels"], row[f"{path}_launches"] = counted["kernels"], counted["launches"]
    ar = row["graphs_ms"] / 1e3
    row["tokens_per_s"] = batch / ar

    def captures() -> None:
        """What capturing every step so far cost: graphs, the host's time, the memory they hold."""
        pieces = pool.graphs.pieces
        row["captures"], row["capture_s"] = pieces.captures, pieces.capture_seconds
        if device.type == "cuda":
            row["graphs_memory_mib"] = (torch.cuda.memory_reserved(device) - reserved) / 2**20

    captures()
    logger.info(
        "batch %d, context %d: ar step %.2f ms eager, %.2f ms captured (floor %.2f ms)",
        batch, context, row["eager_ms"], row["graphs_ms"], floor * 1e3,
    )  # fmt: skip
    parts = ["verify", "drafts"] + (["variants"] if variant_draft is not None else [])
    for part in parts:
        if out_of_time(deadline):
            row["left"] = parts[parts.index(part) :]
            logger.warning("batch %d, context %d: %s left out of the check's time", batch, context, row["left"])
            break
        if part == "verify":
            for k in verify_rows:
                row[f"verify_{k}_over_1"] = timed(step(k), device, iterations) / ar
        elif part == "drafts":
            full = step_bytes(model, batch, context)
            row["draft_over_ar"] = {key: timed(step(1, skip), device, iterations) / ar for key, skip in skips.items()}
            row["draft_bytes_skipped"] = {
                key: 1 - step_bytes(model, batch, context, skip) / full for key, skip in skips.items()
            }
        else:
            blocks = [RequestRows(c, [10], c.length) for c in caches]
            row["variants"] = variant_costs(model, pool, blocks, skips[variant_draft], iterations)
            row["variant_draft"] = variant_draft
        captures()


def prefill_speed(model, tokens: int, chunk: int, iterations: int) -> Iterator[dict]:
    """Prompt reading in chunks of `chunk` tokens: tokens/s and its FLOP rate against the
    device's matmul peak at the model's shapes and a chunk's rows (same dtype, same run). Where
    the model captures its steps, also the batcher's way side by side: the prompt into a pool's
    slot in the model's own prefill chunks, eager and as captured chunk steps (`captured`; its
    error in its place where it fails). Yields the result as each part ends."""
    result = eager_prefill_speed(model, tokens, chunk, iterations)
    yield result
    if model.graphs is not None:
        try:
            result["captured"] = pooled_prefill_speed(model, tokens, iterations)
        except Exception as error:  # noqa: BLE001 — the eager part stands; the captured one's error beside it
            logger.error("captured prefill failed:\n%s", traceback.format_exc())
            result["captured"] = {"error": error_text(error)}
        yield result


@torch.inference_mode()
def eager_prefill_speed(model, tokens: int, chunk: int, iterations: int) -> dict:
    device = model.device
    ids = torch.randint(3, model.spec.vocab_size, (tokens,), device=device)
    cache = model.new_cache(tokens)

    def read() -> None:
        cache.crop(0)
        model.prefill(cache, ids, chunk)

    seconds = timed(read, device, iterations)
    flops = prompt_flops(model.spec, tokens)
    peak_flops = peak_seconds = 0.0
    for out, inner in linear_shapes(model.spec):
        x = torch.randn(chunk, inner, device=device).to(model.dtype)
        weight = (torch.randn(out, inner, device=device) * inner**-0.5).to(model.dtype)
        peak_seconds += timed(lambda x=x, weight=weight: F.linear(x, weight), device, iterations)
        peak_flops += 2.0 * chunk * out * inner
    peak = peak_flops / peak_seconds
    return {
        "tokens": tokens, "chunk": chunk, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
        "peak_tflops": peak / 1e12, "of_peak": flops / seconds / peak,
    }  # fmt: skip


@torch.inference_mode()
def pooled_prefill_speed(model, tokens: int, iterations: int) -> dict:
    """`tokens` prompt tokens into one slot of a pool in the model's prefill chunks, as the
    continuous batcher feeds a prompt: eager (a pool without captured steps, the element-wise
    work unfused) and captured."""
    settings, chunk = model.graphs, model.prefill_chunk
    ids = torch.randint(3, model.spec.vocab_size, (tokens,), device=model.device)
    pools = {}
    for path in ("eager", "captured"):
        model.use_graphs(settings if path == "captured" else None)  # (a pool's steps follow its making)
        pools[path] = model.new_pool(1, tokens)
    model.use_graphs(settings)
    slots = {path: pool.acquire(tokens) for path, pool in pools.items()}

    def read(path: str) -> Callable[[], None]:
        slot = slots[path]

        def run() -> None:
            for offset in range(0, tokens, chunk):
                wanted = "last" if offset + chunk >= tokens else "none"
                model.forward_batch([RequestRows(slot, ids[offset : offset + chunk], offset, wanted)])

        return run

    seconds = {}
    for path in slots:
        with item_ops(model, model.ops if path == "captured" else EAGER):
            seconds[path] = timed(read(path), model.device, iterations)
    graphs = pools["captured"].graphs
    return {
        "chunk": chunk, "eager_tokens_per_s": tokens / seconds["eager"],
        "captured_tokens_per_s": tokens / seconds["captured"], "speedup": seconds["eager"] / seconds["captured"],
        "chunk_steps": sum(n for bucket, n in graphs.steps_run.items() if bucket.chunk) if graphs else 0,
    }  # fmt: skip
