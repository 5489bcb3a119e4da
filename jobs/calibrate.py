#!/usr/bin/env python
"""Calibrate KnapSpec's latency model: on this device, or on every node of a Ray cluster.

    python jobs/calibrate.py                                  # embedded model, default dtype, CPU
    python jobs/calibrate.py --dtype fp32 --context-lengths 512,2048 --output out/latency.json
    python jobs/calibrate.py --address auto --device cuda     # every node of a running cluster

With --address, a ProfilerActor on each node calibrates that node's device for the model's
layer shapes (random weights: no node reads the checkpoint's layers) into the node's store,
where pipeline stages placed there find it; the table adds the measured hop between every
pair of nodes (and within each node).

Measures attention at each context length, the MLP, the fixed cost and verify forwards
(see profiling/microbench.py), stores the calibration in the store under the cache
directory (reused on the next run unless --force) and prints a markdown table.
Bad arguments end with one `error: ...` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from job_cli import (
    Parser,
    add_calibration_dir_argument,
    check_device,
    check_model,
    positive_int,
    run_reporting_errors,
)
from pipeline.engine import Engine, EngineConfig
from pipeline.errors import ConfigError
from pipeline.logs import configure_logging
from pipeline.model import checkpoint
from pipeline.model.linear import DTYPE_CHOICES, resolve_compute_mode
from profiling import microbench
from profiling.calibration import CalibrationStore
from profiling.record import DEFAULT_LAYOUT, Calibration, CalibrationKey

logger = logging.getLogger("calibrate")

# Contexts at which the table shows the knapsack's integer weights, besides the measured ones.
EXTRA_WEIGHT_CONTEXTS = (8192,)




def _context_lengths(value: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts like 128,1024, got {value!r}")
    return lengths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(prog="calibrate.py", description="Calibrate the KnapSpec latency model on this device.")
    parser.add_argument(
        "--model", help=f"a local Hugging Face checkpoint folder (default: the embedded {checkpoint.EMBEDDED_MODEL})"
    )
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--context-lengths",
        type=_context_lengths,
        default=",".join(map(str, microbench.DEFAULT_CONTEXT_LENGTHS)),
        help="cached tokens at which attention is timed (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=positive_int, default=microbench.DEFAULT_REPEATS)
    parser.add_argument(
        "--max-verify",
        type=positive_int,
        default=microbench.DEFAULT_MAX_VERIFY,
        help="verify forwards of 1..K tokens are timed (default: %(default)s)",
    )
    parser.add_argument("--output", type=Path, help="also write the calibration JSON here")
    parser.add_argument("--force", action="store_true", help="re-measure even if a calibration is stored")
    parser.add_argument("--cache-dir", type=Path, help=f"default: {checkpoint.default_cache_dir()}")
    add_calibration_dir_argument(parser, os.environ, flag="--store")
    parser.add_argument("--quiet", action="store_true", help="log warnings only")
    parser.add_argument(
        "--address", help="calibrate every node of this Ray cluster ('auto': the one started on this machine)"
    )
    parser.add_argument(
        "--threads", type=positive_int, help="torch threads per profiler with --address (default: Ray's, one per CPU asked)"
    )
    return parser.parse_args(argv)


def _check_settings(args: argparse.Namespace) -> None:
    """Everything that can be checked before the model is loaded."""
    check_device(args.device, args.dtype)
    check_model(args.model)
    if args.output is not None and args.output.is_dir():
        raise ConfigError(f"--output {args.output} is a folder; give a file name like {args.output / 'latency.json'}")


def run(args: argparse.Namespace) -> Calibration:
    _check_settings(args)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir))
    store = CalibrationStore(args.store or (args.cache_dir / "calibration" if args.cache_dir else None))
    key = CalibrationKey.for_model(engine.model, engine.name, layout=DEFAULT_LAYOUT)
    calibration = store.load_or_measure(
        engine.model,
        key,
        force=args.force,
        context_lengths=args.context_lengths,
        max_verify=args.max_verify,
        repeats=args.repeats,
    )
    if args.output is not None:
        calibration.save(args.output)
        logger.info("wrote %s", args.output)
    return calibration


def run_cluster(args: argparse.Namespace) -> tuple[list[dict], list[Calibration], list[list[float]]]:
    """Every node's calibration through its ProfilerActor, and the hop between every two nodes."""
    import ray

    from actors.profiler import echo_on, start_profilers
    from pipeline.model.spec import ModelSpec

    path = checkpoint.resolve_checkpoint(args.model, args.cache_dir)
    device = torch.device(args.device)
    mode = resolve_compute_mode(args.dtype, device)
    hidden_size = ModelSpec.from_hf_config(checkpoint.load_config(path)).hidden_size
    ray.init(address=args.address, log_to_driver=not args.quiet)
    try:
        profilers = start_profilers()
        infos = ray.get([handle.node.remote() for handle in profilers.values()])
        if device.type == "cuda":
            infos = [info for info in infos if info["resources"].get("GPU", 0) > 0]
            if not infos:
                raise ConfigError("--device cuda, but no node of the cluster has a GPU")
        nodes = [info["node_id"] for info in infos]
        measure = {
            "context_lengths": args.context_lengths, "max_verify": args.max_verify, "repeats": args.repeats,
            "force": args.force,
        }
        store = str(args.store) if args.store else None
        # One node at a time: nodes on one machine (or sharing a network) would slow each other.
        calibrations = [
            ray.get(profilers[node].calibrate.remote(str(path), mode.value, args.device, args.threads, measure, store))
            for node in nodes
        ]
        hops = [
            [
                ray.get(profilers[a].hop_to.remote(profilers[b] if a != b else echo_on(a), hidden_size))
                for b in nodes
            ]
            for a in nodes
        ]
        return infos, calibrations, hops
    finally:
        ray.shutdown()


def format_cluster(infos: list[dict], calibrations: list[Calibration], hops: list[list[float]]) -> str:
    names = [f"{info['node_id'][:8]}" for info in infos]
    parts = []
    for name, info, calibration in zip(names, infos, calibrations):
        resources = ", ".join(f"{k} {v:g}" for k, v in sorted(info["resources"].items()) if k in ("CPU", "GPU"))
        parts += [f"# Node {name} ({info['cpu']}; {resources})", "", format_table(calibration), ""]
    parts += [
        "## Per-hop latency: one hidden state there and back (ms, median)",
        "",
        "| from \\ to | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    parts += [f"| {name} | " + " | ".join(f"{t * 1e3:.2f}" for t in row) + " |" for name, row in zip(names, hops)]
    return "\n".join(parts)


def format_table(calibration: Calibration) -> str:
    """The calibration as markdown: the fit, the measurements, verify ratios and weights."""
    lat = calibration.latency
    residuals = calibration.fit_residuals
    ms = 1e3
    lines = [
        f"## Latency model: {calibration.model} "
        f"({calibration.dtype}, {calibration.layout}, {calibration.attention} attention)",
        "",
        f"{calibration.device}; torch {calibration.torch_version}; measured {calibration.created_at}, "
        f"median of {calibration.repeats}",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| t_attn(n) = a·n + b | a = {lat.attn_slope * 1e6:.4f} µs/token, b = {lat.attn_base * ms:.3f} ms "
        f"(residual {_percent(residuals.get('t_attn'))}) |",
        f"| t_mlp | {lat.t_mlp * ms:.3f} ms |",
        f"| t_fixed (embed + norm + LM head) | {lat.t_fixed * ms:.3f} ms |",
        f"| t_forward({calibration.reference_context}) model / measured | "
        f"{lat.t_forward(calibration.reference_context) * ms:.2f} / {calibration.t_verify_measured[0] * ms:.2f} ms "
        f"({_percent(residuals.get('t_forward'))}) |",
        f"| one knapsack search, B·r branch-tokens | t_forward · ({lat.search_base:.2f} + {lat.search_per_token:.4f}·B·r): "
        f"{lat.t_search(12, calibration.reference_context) * ms:.0f} ms (B = 1) / "
        f"{lat.t_search(48, calibration.reference_context) * ms:.0f} ms (B = 4) at r = 12 |",
        "",
        "| n | attention ms (measured) | fit ms | attention / MLP | weights attn / MLP |",
        "|---|---|---|---|---|",
    ]
    measured = dict(zip(calibration.context_lengths, calibration.t_attn_measured))
    for n in sorted(set(calibration.context_lengths) | set(EXTRA_WEIGHT_CONTEXTS)):
        weights = lat.item_weights(n)
        shown = f"{measured[n] * ms:.3f}" if n in measured else "—"
        lines.append(
            f"| {n} | {shown} | {lat.t_attn(n) * ms:.3f} | {_ratio(lat.t_attn(n), lat.t_mlp)} | "
            f"{weights[0]} / {weights[1]} |"
        )
    ks = range(1, lat.max_verify + 1)
    lines += [
        "",
        f"Verify of k tokens at context {calibration.reference_context}, relative to one token:",
        "",
        "| k | " + " | ".join(str(k) for k in ks) + " |",
        "|---|" + "---|" * len(ks),
        "| ratio | " + " | ".join(f"{r:.2f}" for r in lat.verify_ratios) + " |",
        "| ms | " + " | ".join(f"{t * ms:.1f}" for t in calibration.t_verify_measured) + " |",
    ]
    if calibration.correction is not None:
        lines += ["", *_correction_lines(calibration)]
    return "\n".join(lines)


def _correction_lines(calibration: Calibration) -> list[str]:
    """The measured table beside the one engines plan from: corrected by their timed steps."""
    measured, corrected, c = calibration.latency, calibration.corrected_latency, calibration.correction
    n, widest = calibration.reference_context, measured.max_verify
    return [
        f"Corrected by the fit of {c.steps} timed batch steps ({c.updated_at}); engines plan from the corrected table "
        "(`--force` measures afresh):",
        "",
        "| quantity | measured | corrected |",
        "|---|---|---|",
        f"| t_forward({n}) | {measured.t_forward(n) * 1e3:.2f} ms | {corrected.t_forward(n) * 1e3:.2f} ms |",
        f"| attention slope a | {measured.attn_slope * 1e6:.4f} µs/token | {corrected.attn_slope * 1e6:.4f} µs/token |",
        f"| verify ratio, k = {widest} | {measured.verify_ratios[-1]:.2f} | {corrected.verify_ratios[-1]:.2f} |",
        f"| weights attn / MLP at {n} | {' / '.join(map(str, measured.item_weights(n)[:2]))} "
        f"| {' / '.join(map(str, corrected.item_weights(n)[:2]))} |",
    ]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "inf"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    return run_reporting_errors(lambda: _calibrate(args))


def _calibrate(args: argparse.Namespace) -> int:
    if args.address is not None:
        if args.output is not None:
            raise ConfigError("--output writes one device's calibration; with --address they go to each node's store")
        print(format_cluster(*run_cluster(args)))
    else:
        print(format_table(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
