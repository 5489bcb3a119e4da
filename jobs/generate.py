"""Summarize one document in a single process (no Ray), with any decoding strategy.

    python jobs/generate.py --input data/sample.jsonl --id gao-26-109008 --strategy static --json
    python jobs/generate.py --input data/sample.jsonl --ids A,B,C,D --max-batch 4 --json

The input is a .txt file (the whole file is the document, its id the file stem) or a
.jsonl / .parquet file with `id` and `text` columns, one row of which `--id` picks (or
several, `--ids`, decoded together in batches; one JSON object per line with `--json`).
Bad arguments and inputs end with one `error: ...` line on stderr and exit code 2;
they are checked before the model is loaded, as far as they can be without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import torch

from job_cli import (
    Parser,
    add_calibration_dir_argument,
    add_sampling_arguments,
    check_device,
    check_model,
    positive_int,
    run_reporting_errors,
    sampling_params,
)
from pipeline.decoding.sampling import SamplingParams
from pipeline.engine import (
    DEFAULT_MAX_BATCH,
    REGISTRY,
    SEARCHING_STRATEGIES,
    STRATEGIES,
    Engine,
    EngineConfig,
    StrategyConfig,
)
from pipeline.errors import ConfigError
from pipeline.logs import configure_logging
from pipeline.model import checkpoint
from pipeline.model.linear import DTYPE_CHOICES, resolve_compute_mode
from pipeline.summarization.one_document import load_document
from pipeline.summarization.prompts import DEFAULT_INSTRUCTION, build_prompt
from profiling.calibration import store_calibrator

logger = logging.getLogger("generate")


def _id_list(value: str) -> list[str]:
    ids = list(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    if not ids:
        raise argparse.ArgumentTypeError(f"expected comma-separated ids, got {value!r}")
    return ids


def _skip_items(value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(item) for item in value.split(",") if item.strip())
    except ValueError:
        items = ()
    # An empty set would draft with the full model: twice the work for nothing.
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated item indices like 4,6,8, got {value!r}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(
        prog="generate.py",
        description="Summarize one document with the KnapSpec engine in this process.",
    )
    parser.add_argument("--input", required=True, type=Path, help="a .txt, .jsonl or .parquet file")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--id", dest="doc_id", help="the row of a .jsonl/.parquet input to summarize (its `id`)")
    which.add_argument(
        "--ids", type=_id_list, help="several rows, comma-separated: decoded together, up to --max-batch at a time"
    )
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        default=DEFAULT_MAX_BATCH,
        help=f"requests decoded together in one batch (default {DEFAULT_MAX_BATCH}); each gets the tokens it "
        "would alone",
    )
    parser.add_argument(
        "--model", help=f"a local Hugging Face checkpoint folder (default: the embedded {checkpoint.EMBEDDED_MODEL})"
    )
    parser.add_argument(
        "--strategy",
        default="ar",
        choices=STRATEGIES,
        help="decoding strategy (default: ar): " + "; ".join(f"{n}: {s.description}" for n, s in REGISTRY.items()),
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--max-context",
        type=positive_int,
        help="most prompt tokens; the document is cut to fit (default: what the model's context allows)",
    )
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--device", default="cpu")
    add_sampling_arguments(parser)
    parser.add_argument(
        "--end-on-sentence-after",
        type=positive_int,
        metavar="N",
        help="end an answer at its first sentence end once it is N tokens long, and cut an unfinished last "
        "sentence from one that uses its whole budget (default: end at EOS or the budget only)",
    )
    parser.add_argument(
        "--skip", type=_skip_items, help="items the `static` drafter skips, e.g. 4,6,8 (item 2i: attention of layer i)"
    )
    parser.add_argument(
        "--max-draft",
        type=positive_int,
        help=f"most drafted tokens per step (default: {REGISTRY['static'].max_draft}; {REGISTRY['lookup'].max_draft} "
        f"for the lookups; {REGISTRY['knapspec'].max_draft} for the searching strategies, which choose γ below it)",
    )
    parser.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="prompt template containing {document}")
    parser.add_argument("--cache-dir", type=Path, help=f"default: {checkpoint.default_cache_dir()}")
    add_calibration_dir_argument(parser, os.environ)
    parser.add_argument(
        "--pipeline-parallel",
        type=positive_int,
        default=1,
        help="run the model as this many pipeline stages, Ray actors each holding its share of the layers "
        "(a local Ray cluster unless --address names one)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        help="split each stage's attention heads and MLP over this many Ray actors on one node, "
        "all-reducing through torch.distributed (Gloo on CPU, NCCL on GPU)",
    )
    parser.add_argument(
        "--address", help="the Ray cluster for --pipeline-parallel / --tensor-parallel (default: a new local one)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--quiet", action="store_true", help="log warnings only")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------- run


def _check_settings(args: argparse.Namespace) -> tuple[StrategyConfig, SamplingParams]:
    """Everything that can be checked without the model."""
    check_device(args.device, args.dtype)
    if "{document}" not in args.instruction:
        raise ConfigError("the instruction template must contain '{document}'")
    check_model(args.model)
    if args.tensor_parallel > 1:
        from pipeline.model.spec import ModelSpec
        from pipeline.parallel.tensor_parallel import check_tensor_parallel

        config = checkpoint.load_config(checkpoint.resolve_checkpoint(args.model))
        check_tensor_parallel(ModelSpec.from_hf_config(config), args.tensor_parallel)
    if args.skip is not None and args.strategy != "static":
        logger.warning("--skip is used only by --strategy static; ignored for %s", args.strategy)
    strategy = StrategyConfig(name=args.strategy, skip=args.skip, max_draft=args.max_draft)
    return strategy, sampling_params(args)


def run(args: argparse.Namespace) -> list[dict]:
    """Load the documents and the model, generate, and return one result record per document."""
    ids = args.ids if args.ids is not None else [args.doc_id]
    documents = [load_document(args.input, doc_id) for doc_id in ids]
    strategy, params = _check_settings(args)

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        calibration_dir=args.calibration_dir,
    )
    sharded = args.pipeline_parallel > 1 or args.tensor_parallel > 1
    if sharded:
        engine = _sharded_engine(args, config)
    else:
        engine = Engine(config, calibrator=store_calibrator(config.calibration_dir))
    engine.drafter(strategy)  # checks --skip against the model's items before any prefill

    # Room for the answer is reserved whatever the strategy, so every strategy sees
    # the same prompt for the same arguments.
    room = engine.model.max_context - args.max_new_tokens
    if room < 1:
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in this model's "
            f"{engine.model.max_context}-token context"
        )
    if args.max_context is not None and args.max_context > room:
        raise ConfigError(
            f"--max-context {args.max_context} plus --max-new-tokens {args.max_new_tokens} exceeds this model's "
            f"{engine.model.max_context}-token context; use --max-context {room} or less"
        )
    max_prompt = args.max_context if args.max_context is not None else room

    prompts = []
    for doc_id, document in documents:
        prompt = build_prompt(engine.tokenizer, document, max_prompt, args.instruction)
        if prompt.truncated:
            logger.info(
                "truncated document %s from %d document tokens to a prompt of %d tokens",
                doc_id,
                prompt.document_tokens,
                prompt.token_ids.numel(),
            )
        prompts.append(prompt)
    logger.info(
        "Generating up to %d tokens for %s with %s",
        args.max_new_tokens,
        ", ".join(i for i, _ in documents),
        strategy.name,
    )
    if len(prompts) == 1:
        results = [engine.generate(p.token_ids, strategy, args.max_new_tokens, params) for p in prompts]
    else:
        ids_only = [p.token_ids for p in prompts]
        results = engine.generate_batch(ids_only, strategy, args.max_new_tokens, params, max_batch=args.max_batch)
    return [
        {
            "id": doc_id,
            "model": engine.name,
            "strategy": strategy.name,
            "token_ids": [int(t) for t in result.token_ids],
            "text": engine.tokenizer.decode(result.token_ids, skip_special_tokens=True),
            "prompt_tokens": prompt.token_ids.numel(),
            "document_tokens": prompt.document_tokens,
            "output_tokens": len(result.token_ids),
            "truncated": prompt.truncated,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
            "search": result.extra,  # what a searching strategy decided (empty for the others)
        }
        for (doc_id, _), prompt, result in zip(documents, prompts, results)
    ]


def _sharded_engine(args: argparse.Namespace, config: EngineConfig) -> Engine:
    """The engine over stage actors on Ray; they end with this process's Ray session."""
    import ray

    from actors.profiler import calibrate_pipeline
    from actors.shard import start_pipeline

    if args.strategy in ("hf", "hf-lookup"):
        raise ConfigError(f"--strategy {args.strategy} runs transformers in one process; it has no pipeline form")
    ray.init(address=args.address or "local", include_dashboard=False, log_to_driver=not args.quiet)
    path = checkpoint.resolve_checkpoint(config.model, config.cache_dir)
    mode = resolve_compute_mode(config.dtype, config.device)
    threads = max(1, torch.get_num_threads() // (args.pipeline_parallel * args.tensor_parallel))
    staged = start_pipeline(
        path,
        args.pipeline_parallel,
        mode,
        config.device,
        num_cpus=0.5,
        num_threads=threads,
        tensor_parallel=args.tensor_parallel,
    )
    if args.strategy in SEARCHING_STRATEGIES:
        # Each stage weighed by its own node's device table (one profiler per node), plus the hop.
        latency = calibrate_pipeline(
            staged, path, mode, config.device, config.calibration_dir, threads, tensor_parallel=args.tensor_parallel
        )
        config = dataclasses.replace(config, latency=latency)
    return Engine(config, model=staged.model)


def _stats_line(record: dict) -> str:
    stats = record["stats"]
    line = (
        f"{record['id']} [{record['strategy']}]: {record['output_tokens']} tokens ({record['finish_reason']}), "
        f"prompt {record['prompt_tokens']} tokens{' (truncated)' if record['truncated'] else ''}, "
        f"prefill {stats['prefill_s']:.2f} s, decode {stats['tokens_per_s']:.1f} tok/s"
    )
    if stats["drafted_tokens"]:
        line += f", acceptance {stats['acceptance_rate']:.2f}, {stats['mean_accepted_len']:.2f} tokens/step"
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.pipeline_parallel > 1 or args.tensor_parallel > 1) and args.address is None:
        # A local cluster needs no network: Ray stays on 127.0.0.1 (it reads this when imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    configure_logging(args.quiet)
    return run_reporting_errors(lambda: _print(run(args), args.json))


def _print(records: list[dict], as_json: bool) -> int:
    for record in records:
        if as_json:
            print(json.dumps(record, ensure_ascii=False))  # one object per line
            continue
        if len(records) > 1:
            print(f"# {record['id']}")
        print(record["text"])
        # On stderr, so that stdout is only the summaries and can be redirected to a file.
        print(_stats_line(record), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
