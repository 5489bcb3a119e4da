"""Prefill speed: each compute mode reads the same prompts in turn, the order reversed on every
other repeat; tokens/s side by side (medians), and how close each comes to what this CPU's
matrix products reach at the model's own shapes: the bf16 and fp32 peaks, measured in the same
run on the linears of a prefill chunk; and one layer's attention of each prompt's last chunk in
bf16, PyTorch's flash kernel beside ours where this CPU takes it (short_attention.long_attention).
The job (jobs/benchmark.py --prefill) prints the tables."""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.model import short_attention
from pipeline.model.layers import split_attention
from pipeline.model.spec import ModelSpec
from profiling.benchmark.runs import batch_prompts, build_engine, run_order
from profiling.timer import benchmark, timer_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillSettings:
    modes: tuple[str, ...]  # compute modes, the first the reference
    context_lengths: tuple[int, ...]  # prompt tokens
    repeats: int
    model: str | None = None


@dataclass(frozen=True)
class PrefillRow:
    doc_id: str
    prompt_tokens: int
    mode: str
    tokens_per_s: float  # median over repeats
    vs_reference: float  # median over repeats of the reference's time over this mode's
    gflops: float  # the prompt's FLOPs (prompt_flops) per second
    of_bf16_peak: float
    of_fp32_peak: float


def linear_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """(out, in) of a layer's products as the engine fuses them: qkv, o, gate_up, down."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    d, inner = spec.hidden_size, spec.intermediate_size
    return [(q + 2 * kv, d), (d, q), (2 * inner, d), (d, inner)]


def prompt_flops(spec: ModelSpec, tokens: int) -> float:
    """Floating-point operations of reading a prompt: every layer's products over its tokens, and
    causal attention's two products over the tokens × (tokens + 1) / 2 query-key pairs."""
    per_token = sum(2 * out * inner for out, inner in linear_shapes(spec))
    pairs = tokens * (tokens + 1) / 2
    attention = 4 * spec.num_heads * spec.head_dim * pairs
    return spec.num_layers * (per_token * tokens + attention)


def matmul_peak(spec: ModelSpec, rows: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of PyTorch's linear in `dtype` over this model's products at `rows` rows (a
    prefill chunk's): their FLOPs over the sum of their median times."""
    generator = torch.Generator().manual_seed(0)
    flops = seconds = 0.0
    for out, inner in linear_shapes(spec):
        x = torch.randn(rows, inner, generator=generator).to(dtype)
        weight = (torch.randn(out, inner, generator=generator) * inner**-0.5).to(dtype)
        seconds += benchmark(lambda x=x, weight=weight: F.linear(x, weight), timer_for("cpu"), repeats).median
        flops += 2.0 * rows * out * inner
    return flops / seconds / 1e9


def attention_speed(spec: ModelSpec, tokens: int, chunk: int, repeats: int = 3) -> dict:
    """One layer's bf16 attention of a `tokens`-token prompt's last chunk of `chunk` rows
    (layers.split_attention): ms and GFLOP/s through PyTorch's flash kernel and, where this CPU
    takes it, through ours ("kernel": None elsewhere)."""
    generator = torch.Generator().manual_seed(0)
    start = tokens - chunk
    q = torch.randn(chunk, spec.num_heads, spec.head_dim, generator=generator)
    keys, values = (torch.randn(spec.num_kv_heads, tokens, spec.head_dim, generator=generator) for _ in range(2))
    flops = 4 * spec.num_heads * spec.head_dim * chunk * (start + (chunk + 1) / 2)
    routes = {"flash": False}
    if short_attention.long_attention_available() and spec.head_dim % 64 == 0:
        routes["kernel"] = True
    result: dict = {"start": start, "rows": chunk, "kernel": None}
    for name, kernel in routes.items():
        run = lambda kernel=kernel: split_attention(
            q, keys, values, start, spec.head_dim**-0.5, torch.bfloat16, use_kernel=kernel
        )
        seconds = benchmark(run, timer_for("cpu"), repeats).median
        result[name] = {"ms": 1e3 * seconds, "gflops": flops / seconds / 1e9}
    return result


def prefill_speeds(settings: PrefillSettings, documents: dict[str, str]) -> tuple[list[PrefillRow], dict]:
    """One row per (document, length, mode), and what the run measured beside them: the matmul
    peaks per chunk size and each mode's weight bytes."""
    engines = {mode: build_engine(settings.model, mode) for mode in settings.modes}
    reference = settings.modes[0]
    first = engines[reference]
    spec, tokenizer = first.model.spec, first.tokenizer
    peaks: dict[int, dict[str, float]] = {}
    attention: dict[str, dict] = {}
    rows: list[PrefillRow] = []
    for doc_id, text in documents.items():
        for length in settings.context_lengths:
            prompt = batch_prompts(tokenizer, text, length, 1)[0]
            chunk = min(prompt.numel(), first.model.prefill_chunk)
            if chunk not in peaks:
                peaks[chunk] = {
                    "bf16": matmul_peak(spec, chunk, torch.bfloat16),
                    "fp32": matmul_peak(spec, chunk, torch.float32),
                }
                logger.info(
                    "matmul peaks at %d rows: %s GFLOP/s", chunk, {k: round(v) for k, v in peaks[chunk].items()}
                )
            if str(prompt.numel()) not in attention:
                attention[str(prompt.numel())] = attention_speed(spec, prompt.numel(), chunk)
            times = _alternating(engines, prompt, settings.repeats)
            flops = prompt_flops(spec, prompt.numel())
            for mode in settings.modes:
                seconds = statistics.median(times[mode])
                ratio = statistics.median(r / t for r, t in zip(times[reference], times[mode]))
                gflops = flops / seconds / 1e9
                rows.append(
                    PrefillRow(
                        doc_id,
                        prompt.numel(),
                        mode,
                        prompt.numel() / seconds,
                        ratio,
                        gflops,
                        gflops / peaks[chunk]["bf16"],
                        gflops / peaks[chunk]["fp32"],
                    )
                )
                logger.info("%s at %d tokens, %s: %.0f tokens/s", doc_id, prompt.numel(), mode, rows[-1].tokens_per_s)
    measured = {
        "matmul_peak_gflops": {str(chunk): peak for chunk, peak in peaks.items()},
        "attention": attention,
        "weight_bytes": {mode: weight_bytes(engine.model) for mode, engine in engines.items()},
    }
    return rows, measured


def weight_bytes(model) -> dict[str, int]:
    """The bytes a model's linears hold: the copy long blocks read, and the packed one of short blocks."""
    linears = [linear for layer in model.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    held = [linear.held_bytes for linear in [*linears, model.lm_head]]
    return {"long_blocks": sum(plain for plain, _ in held), "short_blocks": sum(packed for _, packed in held)}


def _alternating(engines: dict, prompt: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """Each mode's prefill seconds of `prompt`, repeat after repeat, the order reversed every other
    repeat; one unmeasured prefill per mode first (kernel builds, first-touch of the weights)."""
    modes = list(engines)
    for mode in modes:
        engines[mode].prefill(prompt, 1)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in run_order(modes, repeat):
            started = time.perf_counter()
            engines[mode].prefill(prompt, 1)
            times[mode].append(time.perf_counter() - started)
    return times


def write_prefill_report(rows: list[PrefillRow], measured: dict, settings: PrefillSettings, output: Path) -> str:
    """Write OUTPUT/prefill_benchmark.json; the tables to print."""
    output.mkdir(parents=True, exist_ok=True)
    record = {"settings": asdict(settings), "rows": [asdict(r) for r in rows], **measured}
    (output / "prefill_benchmark.json").write_text(json.dumps(record, indent=2))
    reference = settings.modes[0]
    lines = [
        f"| doc | prompt tokens | mode | prefill tok/s | vs {reference} | GFLOP/s | of bf16 matmul peak | of fp32 peak |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.doc_id} | {r.prompt_tokens} | {r.mode} | {r.tokens_per_s:.0f} | {r.vs_reference:.2f}× "
            f"| {r.gflops:.0f} | {r.of_bf16_peak:.2f} | {r.of_fp32_peak:.2f} |"
        )
    lines += ["", "| chunk rows | bf16 matmul peak GFLOP/s | fp32 GFLOP/s |", "|---:|---:|---:|"]
    for chunk, peak in measured["matmul_peak_gflops"].items():
        lines.append(f"| {chunk} | {peak['bf16']:.0f} | {peak['fp32']:.0f} |")
    lines += [
        "",
        "| prompt tokens | last chunk: start, rows | one layer's bf16 attention, flash ms | GFLOP/s | ours ms | GFLOP/s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for tokens, a in measured["attention"].items():
        ours = f"{a['kernel']['ms']:.1f} | {a['kernel']['gflops']:.0f}" if a["kernel"] else "— | —"
        lines.append(
            f"| {tokens} | {a['start']}, {a['rows']} | {a['flash']['ms']:.1f} | {a['flash']['gflops']:.0f} | {ours} |"
        )
    lines += ["", "| mode | weights of long blocks MB | of short blocks MB |", "|---|---:|---:|"]
    for mode, sizes in measured["weight_bytes"].items():
        lines.append(f"| {mode} | {sizes['long_blocks'] / 2**20:.0f} | {sizes['short_blocks'] / 2**20:.0f} |")
    return "\n".join(lines)
