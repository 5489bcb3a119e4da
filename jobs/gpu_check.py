#!/usr/bin/env python
"""The GPU check: the decode step on one CUDA device, eager and captured, in a few minutes.

    python jobs/gpu_check.py --output out/      # on a machine with an H100/H200-class GPU

Stages, each reported on its own as it ends (a stage that fails prints its error, and the
others still run; the report is rewritten after each):

1. `steps`: a Llama-3.1-8B-shaped model with random weights in bf16 (decode cost depends on
   shapes, not values): the `ar` step at batch 1 / 8 / 32 with 4k and 16k tokens of context
   per request, eager and as captured CUDA graphs (pipeline/model/graphs) side by side in one
   process — ms, the fraction of the bandwidth floor (the weights plus every request's KV
   cache read once, at the copy bandwidth measured on this device), kernels and host launches
   per step, the host's time per step; verify(k), k rows per request, over one row; and the
   draft step of sub-networks skipping given shares of the attention and MLP items, against
   the share of the step's bytes they skip.
2. `knapspec`: the speed-up KnapSpec would predict from those captured times with the
   acceptance α that drafts skipping the same shares reached on a real model (SmolLM2 on CPU,
   jobs/acceptance.py's docs/results/acceptance-smollm2.json). Random weights have no
   meaningful acceptance of their own: the speed-ups are predictions.
3. `prefill`: prompt reading in 4k chunks (8k tokens: the second chunk split at its start,
   unmasked), tokens/s and the fraction of the bf16 matmul peak at the model's shapes,
   measured in the same run.
4. `attention`: the device's attention routes in bf16 against their masked references: a
   split prefill chunk against SDPA with a boolean mask, FlexAttention over slots against
   the masked matmuls.
5. `equality`: on a tiny random model in fp32, each request's greedy tokens in one continuous
   batch (mixed prompts and limits, prompt-lookup drafts), eager and captured, against the
   request alone; and how far the device's bf16 kernels move a row's logits as the rows beside
   it change (`row_drift`).
6. `sampling`: speculative sampling's (t1, t2, t3) on the device with captured steps against
   the exact law of plain sampling (χ²).

Writes OUTPUT/gpu_check.md and OUTPUT/gpu_check.json. `--device cpu --shape tiny` runs the
same code on small shapes, the captured steps run eagerly (the test suite does, so the script
runs first time on a GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from job_cli import Parser, run_reporting_errors
from pipeline.errors import ConfigError
from pipeline.knapspec.skip_fractions import project, spread_skip
from pipeline.logs import configure_logging
from pipeline.model.graphs import GraphSettings
from pipeline.model.linear import ComputeMode
from profiling.device_profile import shaped_model
from profiling.gpu.checks import attention_agreement, graph_settings, greedy_equality, sampling_law
from profiling.gpu.report import format_report
from profiling.gpu.steps import error_text, prefill_speed, step_costs

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ACCEPTANCE = REPO / "docs" / "results" / "acceptance-smollm2.json"
STAGES = ("steps", "knapspec", "prefill", "attention", "equality", "sampling")
# The draft skip shares timed against their bytes, of the attention items, the MLP items, or both.
DRAFT_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5)
VARIANT_SHARE = 0.3  # the draft (this share of both kinds) timed through every way of capturing a step
STEPS_SHARE = 0.6  # of the time budget, for the steps stage (the others take a minute or so on a GPU)
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
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument(
        "--prefill-tokens", type=int, default=8192, help="prompt tokens read by the prefill stage (two 4k chunks)"
    )
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=3000, help="speculative samples of the sampling stage")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=300.0,
        help="seconds the whole check aims at: the steps stage starts no new batch and context past "
        f"{STEPS_SHARE:.0%} of it, so that the stages after it still run (default 300)",
    )
    parser.add_argument(
        "--acceptance", type=Path, default=DEFAULT_ACCEPTANCE, help="α per share of skipped items (jobs/acceptance.py)"
    )
    parser.add_argument(
        "--attention",
        default="auto",
        choices=("auto", "flex", "matmul"),
        help="a captured step's attention: FlexAttention, the masked matmuls, or auto (FlexAttention on a GPU "
        "where PyTorch has it); the fallback where FlexAttention fails to compile is matmul",
    )
    parser.add_argument(
        "--unfused", action="store_true", help="captured steps without the fused element-wise kernels (a fallback)"
    )
    parser.add_argument("--output", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    return args


def llama_config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, tie_word_embeddings=False)


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
    """(attention items, MLP items) skipped on this model for each share the table measured,
    and for each of DRAFT_SHARES of the attention items, the MLP items, and both."""
    counts = {skipped_counts(row, num_layers) for row in acceptance["rows"]}
    for share in DRAFT_SHARES:
        n = min(round(share * num_layers), num_layers - 2)
        counts |= {(n, 0), (0, n), (n, n)}
    return sorted(c for c in counts if c != (0, 0))


def _draft_key(attention: int, mlp: int) -> str:
    return f"{attention}/{mlp}"


def projections(costs: list[dict], acceptance: dict, num_layers: int, verify_rows: list[int]) -> list[dict]:
    """Per batch and context: the share of skipped items whose borrowed α and measured step
    times predict the best speed-up over `ar` (KnapSpec's TPT over γ; AR where none wins)."""
    rows = []
    for cost in costs:
        if "draft_over_ar" not in cost or any(f"verify_{k}_over_1" not in cost for k in verify_rows):
            continue  # (a batch and context that failed or ran out of time before its drafts)
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


def growing(rows: Iterator[dict]) -> Iterator[list[dict]]:
    """The rows so far, after each new one."""
    so_far: list[dict] = []
    for row in rows:
        so_far.append(row)
        yield so_far


def run_stage(name: str, stage: Callable[[], object], results: dict, report: Callable[..., None]) -> None:
    """One stage: its result, or its error (the others still run); the report rewritten after
    it. A stage that yields its result as it grows has the files rewritten after each yield, so
    a run killed mid-stage keeps what it measured; where it then fails, what it had yielded
    stays beside the error (`partial`)."""
    started = time.perf_counter()
    try:
        result = stage()
        if isinstance(result, Iterator):
            for so_far in result:
                results[name] = so_far
                report(name, printed=False)
        else:
            results[name] = result
    except Exception as error:  # noqa: BLE001 — one stage's failure is reported, and the check goes on
        logger.error("stage %s failed:\n%s", name, traceback.format_exc())
        failure = {"error": error_text(error)}
        if name in results:
            failure["partial"] = results[name]
        results[name] = failure
    logger.info("stage %s: %.0f s", name, time.perf_counter() - started)
    report(name)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device here; the GPU check needs one (or --device cpu --shape tiny to try it)")
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    verify_rows = [int(x) for x in args.verify_rows.split(",")]
    stages = args.stages.split(",")
    acceptance = load_acceptance(args.acceptance)
    torch.manual_seed(0)
    started = time.perf_counter()
    mode = ComputeMode.BF16 if device.type == "cuda" else ComputeMode.FP32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    results: dict = {}
    header = {"device": name, "shape": args.shape, "mode": mode.value, "verify_rows": verify_rows,
              "acceptance": acceptance, "acceptance_path": str(args.acceptance)}  # fmt: skip
    args.output.mkdir(parents=True, exist_ok=True)

    def report(stage: str, printed: bool = True) -> None:
        """The files rewritten (each whole, then renamed over the last: a kill mid-write leaves the
        previous), and with `printed` the stage's section printed: a run cut short keeps what it had."""
        payload = header | {"acceptance": str(args.acceptance), "seconds": time.perf_counter() - started} | results
        for name, text in (("gpu_check.md", format_report(header, results) + "\n"),
                           ("gpu_check.json", json.dumps(payload, indent=2, default=str))):  # fmt: skip
            partial = args.output / f".{name}.partial"
            partial.write_text(text)
            partial.replace(args.output / name)
        if printed:
            print("\n" + format_report(header, results, only=stage), flush=True)

    settings = GraphSettings(attention=args.attention, fuse=False if args.unfused else None)
    header["graphs"] = f"{args.attention} attention" + (", unfused" if args.unfused else "")
    config = llama_config(args.shape)
    model = None
    if {"steps", "knapspec", "prefill"} & set(stages):
        with torch.inference_mode():
            model = shaped_model(config, mode, device, num_layers=config.num_hidden_layers)
        model.use_graphs(graph_settings(device, settings))
        logger.info("Built the %s-shaped model in %.0f s", args.shape, time.perf_counter() - started)
    if model is not None and ("steps" in stages or "knapspec" in stages):
        num_layers = model.spec.num_layers
        skips = {_draft_key(*c): spread_skip(num_layers, *c) for c in draft_counts(acceptance, num_layers)}
        variant = _draft_key(*[min(round(VARIANT_SHARE * num_layers), num_layers - 2)] * 2)
        deadline = started + STEPS_SHARE * args.time_budget
        run_stage(
            "steps",
            lambda: growing(
                step_costs(model, batch_sizes, contexts, verify_rows, args.iterations, skips, variant, deadline)
            ),
            results,
            report,
        )
        if "knapspec" in stages and isinstance(results["steps"], list):
            run_stage("knapspec", lambda: projections(results["steps"], acceptance, num_layers, verify_rows), results,
                      report)  # fmt: skip
    if model is not None and "prefill" in stages:
        tokens = min(args.prefill_tokens, model.max_context)
        run_stage("prefill", lambda: prefill_speed(model, tokens, args.prefill_chunk, 3), results, report)
    model = None  # (its memory back before the tiny models)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tiny = llama_config("tiny")
    if "attention" in stages:
        run_stage("attention", lambda: attention_agreement(device), results, report)
    if "equality" in stages:
        run_stage("equality", lambda: greedy_equality(tiny, device, settings), results, report)
    if "sampling" in stages:
        run_stage("sampling", lambda: sampling_law(tiny, device, args.samples, settings), results, report)
    failed = [
        stage for stage, result in results.items()
        if isinstance(result, dict) and (result.get("error") or result.get("failures"))
        or isinstance(result, list) and any("error" in row for row in result)
    ]  # fmt: skip
    if failed:
        logger.error("stages with failures: %s", ", ".join(failed))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(False)
    return run_reporting_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
