#!/usr/bin/env python
"""Side-by-side decoding speed: strategies and compute modes on the same prompts.

Every (document, context length) is run by every strategy in turn, repeated, the
order reversed on every other repeat (A B C, C B A, ...) so that a machine growing
busier or quieter hits all of them alike. Speeds are medians over repeats; a speed-up
is the median over repeats of the ratio to the reference (`ar` in the CPU default mode)
in the same repeat. `--control` runs the reference a second time at the other end of
the order: its "speed-up" is this machine's noise.

    python jobs/benchmark.py --ids gao-26-109008 --context-lengths 512,2048,4096 --repeats 3

Strategies are given as NAME:DTYPE (e.g. `hf:fp32,ar:fp32,ar:fp16w,static:fp16w`).
Writes OUT/benchmark.json and prints markdown tables. `--prefill fp16w,fp16w-bf16` times
prompt reading instead, mode beside mode, against the matmul peaks of the same run;
`--pipeline-parallel 2` one pipelined replica's throughput.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from job_cli import add_calibration_dir_argument, add_repetition_arguments, load_documents, sampling_params
from pipeline.engine import STRATEGIES
from pipeline.errors import ConfigError
from pipeline.logs import configure_logging
from pipeline.model.linear import resolve_compute_mode
from profiling.benchmark.comparison import compare
from profiling.benchmark.pipeline_throughput import pipeline_throughput, write_pipeline_report
from profiling.benchmark.prefill import PrefillSettings, prefill_speeds, write_prefill_report
from profiling.benchmark.report import write_report
from profiling.benchmark.settings import CONTROL, MATMUL, ComparisonSettings, PipelineSettings

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INPUT = REPO / "data" / "sample.jsonl"
DEFAULT_STRATEGIES = "hf:fp32,ar:fp32,hf:fp16w,ar:fp16w,static:fp16w"


def parse_strategy(text: str) -> tuple[str, str]:
    """NAME or NAME:DTYPE -> (name, compute mode); a bare name, or `auto`, takes the CPU default
    mode, as generate.py and summarize.py do. DTYPE+matmul (e.g. `ar:fp16w+matmul`) is the mode
    with attention by PyTorch's matmuls instead of the fused kernel, run beside it. Anything
    else ends the run with one error line."""
    name, _, dtype = text.strip().partition(":")
    dtype, plus, route = dtype.partition("+")
    if name not in STRATEGIES:
        raise SystemExit(f"error: unknown strategy {name!r} in {text!r}; choose from {', '.join(STRATEGIES)}")
    if plus and route != MATMUL:
        raise SystemExit(f"error: {text!r}: the only route after '+' is {MATMUL!r}")
    try:
        return name, resolve_compute_mode(dtype or "auto", "cpu").value + (f"+{MATMUL}" if plus else "")
    except ConfigError as e:
        raise SystemExit(f"error: {text!r}: {e}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, default=DEFAULT_INPUT, help="a .jsonl file with id and text")
    parser.add_argument("--ids", default="gao-26-109008", help="comma-separated document ids")
    parser.add_argument("--context-lengths", default="512,2048,4096", help="prompt tokens, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help="NAME:DTYPE pairs, comma-separated (a bare NAME: the CPU default mode; DTYPE+matmul: "
        "attention by PyTorch's matmuls instead of the fused kernel, e.g. ar:fp16w+matmul)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch-sizes",
        default="1",
        help="requests decoded together, comma-separated (e.g. 1,4,8,16): request k of a batch is the "
        "document read from its k-th part on, like the chunks of one document in the summarize job",
    )
    parser.add_argument("--reference", default="ar:fp16w", help="the NAME:DTYPE speedups are relative to")
    parser.add_argument("--output", type=Path, default=Path("out"))
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    add_calibration_dir_argument(parser, os.environ)
    parser.add_argument(
        "--no-fallback",
        action="store_true",
        help="also run the DP's best candidates as forced draft models, to test the latency model's predictions",
    )
    parser.add_argument("--forced", type=int, default=4, help="how many DP candidates --no-fallback runs")
    parser.add_argument(
        "--control", action="store_true", help=f"run the reference twice ({CONTROL}): the measured noise"
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure the latency model afresh before the run (and store it) instead of using a stored one",
    )
    add_repetition_arguments(parser.add_argument_group("repetition control (greedy, every strategy alike)"))
    pipe = parser.add_argument_group(
        "pipeline throughput (instead of the strategy comparison): requests through one replica of P stage "
        "actors, one at a time vs several in flight, and the cost of one hop"
    )
    pipe.add_argument("--pipeline-parallel", type=int, help="stages of the replica (e.g. 2)")
    pipe.add_argument("--in-flight", default="1,4", help="requests in flight, comma-separated")
    pipe.add_argument("--requests", type=int, default=8, help="requests per measurement")
    parser.add_argument_group(
        "prefill speed (instead of the strategy comparison): each document cut to each context length, "
        "read by every mode in turn, tokens/s against the bf16 and fp32 matmul peaks at the model's shapes"
    ).add_argument("--prefill", metavar="MODES", help="compute modes, comma-separated, the first the reference")
    return parser.parse_args(argv)


def comparison_settings(args: argparse.Namespace) -> ComparisonSettings:
    """The strategy comparison the options ask for: the reference runs first unless named among
    the strategies, and a second time at the end with --control."""
    pairs = [parse_strategy(s) for s in args.strategies.split(",")]
    reference = parse_strategy(args.reference)
    if reference not in pairs:
        pairs.insert(0, reference)
    if args.control:
        pairs.append((CONTROL, reference[1]))
    return ComparisonSettings(
        pairs=tuple(pairs),
        reference=reference,
        context_lengths=tuple(int(x) for x in args.context_lengths.split(",")),
        batch_sizes=tuple(sorted({int(x) for x in args.batch_sizes.split(",")})),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        params=sampling_params(args),
        model=args.model,
        calibration_dir=args.calibration_dir,
        recalibrate=args.recalibrate,
        no_fallback=args.no_fallback,
        num_forced=args.forced,
    )


def recorded_settings(args: argparse.Namespace) -> dict:
    """The options as benchmark.json records them."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def pipeline_benchmark(args: argparse.Namespace) -> int:
    """--pipeline-parallel: one pipelined replica's throughput instead of the strategy comparison."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: stay on 127.0.0.1
    name, dtype = args.strategies.split(",")[0].split(":") if ":" in args.strategies else ("ar", "fp16w")
    settings = PipelineSettings(
        stages=args.pipeline_parallel,
        in_flight=tuple(int(x) for x in args.in_flight.split(",")),
        context_tokens=int(args.context_lengths.split(",")[0]),
        strategy=name,
        dtype=dtype,
        max_new_tokens=args.max_new_tokens,
        requests=args.requests,
        repeats=args.repeats,
        model=args.model,
        calibration_dir=args.calibration_dir,
    )
    texts = list(load_documents(args.input, args.ids.split(",")).values())
    rows, hop_ms = pipeline_throughput(settings, texts)
    print(write_pipeline_report(settings, rows, hop_ms, args.output))
    return 0


def prefill_benchmark(args: argparse.Namespace) -> int:
    """--prefill: prompt reading, mode beside mode, instead of the strategy comparison."""
    try:
        modes = tuple(resolve_compute_mode(m.strip(), "cpu").value for m in args.prefill.split(","))
    except ConfigError as e:
        raise SystemExit(f"error: --prefill: {e}") from None
    settings = PrefillSettings(
        modes=modes,
        context_lengths=tuple(int(x) for x in args.context_lengths.split(",")),
        repeats=args.repeats,
        model=args.model,
    )
    rows, measured = prefill_speeds(settings, load_documents(args.input, args.ids.split(",")))
    print(write_prefill_report(rows, measured, settings, args.output))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    if args.pipeline_parallel:
        return pipeline_benchmark(args)
    if args.prefill:
        return prefill_benchmark(args)
    settings = comparison_settings(args)
    documents = load_documents(args.input, args.ids.split(","))
    comparison = compare(settings, documents)
    print(write_report(comparison, settings.reference, args.output, recorded_settings(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
