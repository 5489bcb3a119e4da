#!/usr/bin/env python
"""The GPU check: batched decoding on one CUDA device, in a few minutes.

    python jobs/gpu_check.py --output out/      # on a machine with an H100/H200-class GPU

1. A Llama-3.1-8B-shaped model with random weights in bf16 (decode cost depends on shapes,
   not on weight values): an `ar` step at batch 1 / 8 / 32 with 4k and 16k tokens of
   context per request, against the bandwidth floor (weights plus every request's KV cache
   read once, at the copy bandwidth measured on this device), and verify(k) — a step of k
   rows per request — relative to one row, at each batch.
2. KnapSpec there: the draft step of sub-networks that skip given shares of the attention
   and MLP items, timed at each batch and context, and the speed-up KnapSpec would predict
   from those times with the acceptance α that drafts skipping the same shares reached on a
   real model (SmolLM2 on CPU, jobs/acceptance.py's docs/results/acceptance-smollm2.json). Random
   weights have no meaningful acceptance of their own: the speed-ups are predictions.
3. Greedy equality on a tiny random model on the device: each request's tokens decoded in
   one continuous batch (mixed prompt lengths and limits, prompt lookup drafts) against the
   same request alone, as the mode promises (pipeline/model/precision.py): in fp32 a differing
   token must sit at a top-2 logit gap within the mode's tie gap. And how far the device's bf16
   kernels move a row's logits as the rows beside it change (`row_drift`), against the bound
   bf16's near-ties are judged by (measured on CPUs only until a GPU run reports it here).

Writes OUTPUT/gpu_check.md and OUTPUT/gpu_check.json. `--device cpu --shape tiny` runs the
same code on small shapes (the test suite does, so the script stays runnable without a GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from job_cli import Parser, run_reporting_errors
from pipeline.decoding.decode import decode
from pipeline.decoding.loop import DecodeConfig, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.errors import ConfigError
from pipeline.knapspec.skip_fractions import project, spread_skip
from pipeline.logs import configure_logging
from pipeline.model.linear import ComputeMode
from pipeline.model.packing import RequestRows
from pipeline.model.precision import MAX_DRIFT, row_drift
from profiling.device_profile import shaped_model, shaped_tensors

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ACCEPTANCE = REPO / "docs" / "results" / "acceptance-smollm2.json"
logger = logging.getLogger("gpu_check")

# Llama-3.1-8B's shapes; "tiny" keeps the same structure small enough for a CPU.
SHAPES = {
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192,
    ),
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--contexts", default="4096,16384", help="tokens of context per request, comma-separated")
    parser.add_argument("--verify-rows", default="2,3,4,5,8", help="rows per request of the verify steps timed")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument(
        "--acceptance", type=Path, default=DEFAULT_ACCEPTANCE, help="α per share of skipped items (jobs/acceptance.py)"
    )
    parser.add_argument("--output", type=Path, default=Path("out"))
    return parser.parse_args(argv)


def llama_config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, tie_word_embeddings=False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iterations: int) -> float:
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


def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read plus write)."""
    source = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), device, 10)
    return 2 * num_bytes / seconds


def load_acceptance(path: Path) -> dict:
    """The α per share of skipped items that jobs/acceptance.py measured on a real model."""
    if not path.is_file():
        raise ConfigError(f"no acceptance table at {path}: run jobs/acceptance.py (or pass --acceptance)")
    table = json.loads(path.read_text())
    if not table.get("rows"):
        raise ConfigError(f"{path} holds no acceptance rows")
    return table


def skipped_counts(row: dict, num_layers: int) -> tuple[int, int]:
    """(attention items, MLP items) an acceptance row's shares skip on a model of `num_layers`."""
    most = num_layers - 2  # the first and last layers always run
    return tuple(min(round(row[f"{kind}_skipped"] * num_layers), most) for kind in ("attention", "mlp"))


def draft_counts(acceptance: dict, num_layers: int) -> list[tuple[int, int]]:
    """(attention items, MLP items) skipped on this model for each share the table measured."""
    counts = {skipped_counts(row, num_layers) for row in acceptance["rows"]}
    return sorted(c for c in counts if c != (0, 0))


def _draft_key(attention: int, mlp: int) -> str:
    return f"{attention}/{mlp}"


def decode_costs(
    model, batch_sizes: list[int], contexts: list[int], verify_rows: list[int], iterations: int,
    drafts: list[tuple[int, int]],
) -> list[dict]:  # fmt: skip
    """Per batch size and context: the `ar` step, verify(k) steps and the draft steps of the
    skip sets with `drafts` (attention, MLP) items skipped, over caches holding `context` positions."""
    spec, device = model.spec, model.device
    weight_bytes = (
        sum(
            linear.weight.numel() * linear.weight.element_size()
            for layer in model.layers
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        + model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    )
    position_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * model.embed.element_size()
    bandwidth = copy_bandwidth(device)
    skips = {_draft_key(*c): spread_skip(spec.num_layers, *c) for c in drafts}
    rows = []
    for context in contexts:
        for batch in batch_sizes:
            pool = model.new_pool(batch, context + max(verify_rows))
            caches = []
            for _ in range(batch):
                cache = pool.acquire(context + max(verify_rows))
                cache.commit(context)  # what the keys hold does not change what reading them costs
                caches.append(cache)

            def step(k: int, skip: frozenset[int] = frozenset(), caches: list = caches):
                ids = torch.arange(k, device=device) + 10
                blocks = [RequestRows(c, ids, c.length) for c in caches]
                return lambda: model.forward_batch(blocks, skip=skip)

            ar = timed(step(1), device, iterations)
            floor = (weight_bytes + batch * context * position_bytes) / bandwidth
            row = {"batch": batch, "context": context, "ar_step_ms": ar * 1e3, "tokens_per_s": batch / ar,
                   "floor_ms": floor * 1e3, "floor_over_step": floor / ar}  # fmt: skip
            for k in verify_rows:
                row[f"verify_{k}_over_1"] = timed(step(k), device, iterations) / ar
            row["draft_over_ar"] = {key: timed(step(1, skip), device, iterations) / ar for key, skip in skips.items()}
            logger.info("batch %d, context %d: %.2f ms per ar step (floor %.2f ms)", batch, context, ar * 1e3,
                        floor * 1e3)  # fmt: skip
            rows.append(row)
            for cache in caches:  # a live slot and its pool refer to each other: released, the pool goes at once
                pool.release(cache)
            del pool, caches
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def projections(costs: list[dict], acceptance: dict, num_layers: int, verify_rows: list[int]) -> list[dict]:
    """Per batch and context: the share of skipped items whose borrowed α and measured step
    times predict the best speed-up over `ar` (KnapSpec's TPT over γ; AR where none wins)."""
    rows = []
    for cost in costs:
        t_verify = {k: cost[f"verify_{k}_over_1"] for k in verify_rows}  # in units of the ar step
        best = None
        for entry in acceptance["rows"]:
            attention, mlp = skipped_counts(entry, num_layers)
            draft = cost["draft_over_ar"].get(_draft_key(attention, mlp))
            if draft is None:
                continue
            plan = project(entry["alpha"], 1.0, draft, t_verify)
            if best is None or plan.speedup > best["speedup"]:
                best = {"batch": cost["batch"], "context": cost["context"], "kind": entry["kind"],
                        "attention_skipped": attention / num_layers, "mlp_skipped": mlp / num_layers,
                        "alpha": entry["alpha"], "draft_over_ar": draft, "gamma": plan.gamma,
                        "speedup": plan.speedup}  # fmt: skip
        if best is not None:
            rows.append(best)
    return rows


def greedy_equality(device: torch.device) -> dict:
    """Batched against alone on a tiny random model in fp32 on `device`; the bf16 row drift."""
    config = llama_config("tiny")
    spec_tensors = shaped_tensors(_spec(config), config.num_hidden_layers, device, seed=1)
    # shaped_tensors draws N(0, 0.02²); rescaled as the test models are (projections at 1/√fan-in,
    # the head and embeddings five times that): a confident model, greedy choices far from ties.
    for name, tensor in spec_tensors.items():
        if name.endswith("proj.weight"):
            tensor.mul_(1.0 / tensor.shape[-1] ** 0.5 / 0.02)
        elif name in ("lm_head.weight", "model.embed_tokens.weight"):
            tensor.mul_(5.0 / tensor.shape[-1] ** 0.5 / 0.02)
    from pipeline.model.loading import model_from_tensors

    model = model_from_tensors(config, spec_tensors, ComputeMode.FP32, device)
    generator = torch.Generator().manual_seed(3)
    phrase = torch.randint(3, config.vocab_size, (8,), generator=generator)
    prompts = [torch.cat([torch.randint(3, config.vocab_size, (n,), generator=generator), phrase, phrase]) for n in
               (30, 200, 75, 500, 12, 140)]  # fmt: skip
    limits = [40, 25, 60, 30, 50, 20]
    longest = max(p.numel() + m for p, m in zip(prompts, limits))
    batcher = ContinuousBatcher(model, max_batch=4, prefill_chunk=64, slot_positions=longest)
    tickets = [
        batcher.submit(
            GenerationRequest(p, DecodeConfig(m), SamplingParams(), PromptLookupDrafter() if i % 2 else None)
        )
        for i, (p, m) in enumerate(zip(prompts, limits))
    ]
    finished = {done.ticket: done for done in batcher.run()}
    equal, near_ties, failures = 0, 0, []
    for ticket, prompt, limit in zip(tickets, prompts, limits):
        done = finished[ticket]
        if done.error is not None:
            failures.append(f"request {ticket}: {done.error}")
            continue
        alone = decode(model, prefill(model, prompt, limit), DecodeConfig(limit), SamplingParams()).token_ids
        got = done.result.token_ids
        if got == alone:
            equal += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(got, alone)) if a != b), min(len(got), len(alone)))
        cache = model.new_cache(prompt.numel() + first + 1)
        history = torch.cat([prompt, torch.tensor(alone[:first], dtype=torch.long)])
        logits = model.prefill(cache, history.to(device))
        top2 = logits.topk(2).values
        gap, bound = float(top2[0] - top2[1]), model.exactness.tie_gap(logits)
        if gap < bound:
            near_ties += 1
        else:
            failures.append(
                f"request {ticket}: token {first} differs at a top-2 gap of {gap:.2e} (tie gap {bound:.2e})"
            )
    bf16 = model_from_tensors(config, spec_tensors, ComputeMode.BF16, device)
    drift = row_drift(bf16, prompts[1][:120], prompts[1][120:140].tolist(), (2, 5, 11))
    if drift > bf16.exactness.drift:
        failures.append(f"bf16 logits drift {drift:.3g} of their largest, over the bound {bf16.exactness.drift:g}")
    return {
        "requests": len(prompts), "equal": equal, "near_ties": near_ties, "failures": failures,
        "bf16_drift": drift, "bf16_row_exact": bf16.exactness.row_exact, "bf16_drift_bound": MAX_DRIFT[ComputeMode.BF16],
    }  # fmt: skip


def _spec(config):
    from pipeline.model.spec import ModelSpec

    return ModelSpec.from_hf_config(config)


def format_report(
    device_name: str, shape: str, costs: list[dict], plans: list[dict], acceptance: dict, equality: dict,
    verify_rows: list[int], mode: str,
) -> str:  # fmt: skip
    lines = [
        f"GPU check on {device_name}: {shape}-shaped model, random weights, {mode}, one process.",
        "",
        "| batch | context | ar step ms | tokens/s | bandwidth floor ms | floor / step | "
        + " | ".join(f"verify {k} / 1" for k in verify_rows) + " |",
        "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(verify_rows),
    ]  # fmt: skip
    for row in costs:
        lines.append(
            f"| {row['batch']} | {row['context']} | {row['ar_step_ms']:.2f} | {row['tokens_per_s']:.0f} "
            f"| {row['floor_ms']:.2f} | {row['floor_over_step']:.2f} | "
            + " | ".join(f"{row[f'verify_{k}_over_1']:.2f}" for k in verify_rows) + " |"
        )  # fmt: skip
    lines += [
        "",
        f"KnapSpec's predicted speed-up over `ar` at the same batch: this model's measured draft and verify steps, "
        f"with the α that drafts skipping the same shares of items reached on {acceptance.get('model', '?')} "
        f"({acceptance.get('dtype', '?')}, {acceptance.get('context_length', '?')}-token prompts, "
        f"{len(acceptance.get('documents', []))} documents; jobs/acceptance.py). Random weights have no meaningful "
        "acceptance: these are predictions from measured step times and borrowed α, not measured speed-ups. "
        "γ is searched over the verify widths timed; AR where no draft wins.",
        "",
        "| batch | context | best draft | attention skipped | MLP skipped | α | draft / ar step | γ "
        "| predicted speed-up |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for plan in plans:
        if plan["gamma"] == 0:
            lines.append(f"| {plan['batch']} | {plan['context']} | AR | — | — | — | — | — | 1.00× |")
            continue
        lines.append(
            f"| {plan['batch']} | {plan['context']} | {plan['kind']} | {plan['attention_skipped']:.0%} "
            f"| {plan['mlp_skipped']:.0%} | {plan['alpha']:.2f} | {plan['draft_over_ar']:.2f} | {plan['gamma']} "
            f"| {plan['speedup']:.2f}× |"
        )
    verdict = "PASS" if not equality["failures"] else "FAIL"
    lines += [
        "",
        f"Greedy equality, tiny model in fp32 on the device, batched vs alone: {verdict} — "
        f"{equality['equal']} of {equality['requests']} requests equal, {equality['near_ties']} at a near-tie.",
        "",
        f"bf16 row drift on the device (a logit's largest move between a one-row decode and verify blocks of 2-11 "
        f"rows, alone and pooled, relative to its row's largest): {equality['bf16_drift']:.3g}"
        + (" (row-exact kernels)" if equality["bf16_row_exact"] else f"; bound {equality['bf16_drift_bound']:g}."),
    ]
    lines += [f"- {failure}" for failure in equality["failures"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device here; the GPU check needs one (or --device cpu --shape tiny to try it)")
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    verify_rows = [int(x) for x in args.verify_rows.split(",")]
    acceptance = load_acceptance(args.acceptance)
    torch.manual_seed(0)
    started = time.perf_counter()
    mode = ComputeMode.BF16 if device.type == "cuda" else ComputeMode.FP32
    config = llama_config(args.shape)
    with torch.inference_mode():
        model = shaped_model(config, mode, device, num_layers=config.num_hidden_layers)
    logger.info("Built the %s-shaped model in %.0f s", args.shape, time.perf_counter() - started)
    num_layers = model.spec.num_layers
    costs = decode_costs(
        model, batch_sizes, contexts, verify_rows, args.iterations, draft_counts(acceptance, num_layers)
    )
    plans = projections(costs, acceptance, num_layers, verify_rows)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    equality = greedy_equality(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = format_report(name, args.shape, costs, plans, acceptance, equality, verify_rows, mode.value)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "gpu_check.md").write_text(report + "\n")
    payload = {"device": name, "shape": args.shape, "costs": costs, "knapspec": plans,
               "acceptance": str(args.acceptance), "equality": equality,
               "seconds": time.perf_counter() - started}  # fmt: skip
    (args.output / "gpu_check.json").write_text(json.dumps(payload, indent=2))
    print(report)
    return 0 if not equality["failures"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(False)
    return run_reporting_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
