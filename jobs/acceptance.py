#!/usr/bin/env python
"""Acceptance of layer-skip drafts by the share of attention and MLP items they skip.

For each document the prompt is prefilled and the first answer tokens decoded plainly; the
knapsack DP on unit weights then picks, for every number of skipped items of a kind
(attention only, MLP only, or both), the skip set whose hidden states stay closest to the
full model's on those tokens (pipeline/knapspec/skip_fractions.py). Each set drafts γ tokens
per step (no confidence stop) for the rest of the answer; α is the per-token acceptance that
explains its tokens per verification. Greedy, so every answer equals plain decoding's.

    python jobs/acceptance.py --ids gao-26-107759,crs-r47194 --output docs/results/acceptance-smollm2.json

The GPU check (jobs/gpu_check.py) reads the JSON: a large model with random weights has real
step times but no meaningful acceptance, so it borrows these α for the same skip shares.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

import torch

from job_cli import load_documents, run_reporting_errors
from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import LayerSkipDrafter
from pipeline.decoding.loop import DecodeConfig, prefill
from pipeline.decoding.sampling import SamplingParams
from pipeline.engine import Engine, EngineConfig
from pipeline.knapspec.skip_fractions import KINDS, alpha_from_tokens, best_skip_sets, fractions
from pipeline.logs import configure_logging
from pipeline.summarization.prompts import build_prompt

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INPUT = REPO / "data" / "sample.jsonl"
DEFAULT_OUTPUT = REPO / "docs" / "results" / "acceptance-smollm2.json"
logger = logging.getLogger("acceptance")


def _counts(text: str) -> list[int]:
    counts = sorted({int(x) for x in text.split(",") if x.strip()})
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive item counts like 3,6,9, got {text!r}")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="acceptance.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, default=DEFAULT_INPUT, help="a .jsonl file with id and text")
    parser.add_argument("--ids", default="gao-26-107759,crs-r47194", help="comma-separated document ids")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", help="compute mode (default: the CPU default, fp16w-bf16 or fp16w)")
    parser.add_argument("--context-length", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--reference-tokens", type=int, default=16, help="answer tokens the DP scores on")
    parser.add_argument("--max-new-tokens", type=int, default=80, help="answer tokens in all")
    parser.add_argument("--gamma", type=int, default=4, help="tokens drafted per step")
    parser.add_argument("--attention", type=_counts, default=_counts("3,6,9,12,15,18,21"), help="attention items")
    parser.add_argument("--mlp", type=_counts, default=_counts("2,4,6,9"), help="MLP items skipped")
    parser.add_argument("--both", type=_counts, default=_counts("4,8,12,16"), help="items of either kind")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if args.reference_tokens < 2 or args.max_new_tokens <= args.reference_tokens + args.gamma:
        parser.error("need --reference-tokens >= 2 and --max-new-tokens > reference tokens + gamma")
    return args


def measure_document(engine: Engine, text: str, args: argparse.Namespace) -> list[dict]:
    """Every skip set's α on one document: (kind, count) -> its shares and acceptance."""
    model = engine.model
    prompt = build_prompt(engine.tokenizer, text, max_prompt_tokens=args.context_length).token_ids
    r = args.reference_tokens
    opening = decode(model, prefill(model, prompt, r), DecodeConfig(r), SamplingParams()).token_ids
    # The DP scores on the answer's first r tokens; α is measured on the answer after them.
    scored = torch.cat([prompt, torch.tensor(opening, dtype=prompt.dtype)])
    held_out = args.max_new_tokens - r
    config = DecodeConfig(held_out)  # no EOS: every set drafts over the same answer
    prefilled = prefill(model, scored, held_out)
    plain = decode(model, prefilled.copy(), config, SamplingParams()).token_ids
    rows = []
    for kind in KINDS:
        counts = getattr(args, kind)
        sets = best_skip_sets(model, prefilled.cache, scored[-r:], scored.numel() - r, kind, max(counts))
        for count in counts:
            if count not in sets:
                logger.info("%s: no skip set of %d items keeps the cosine threshold", kind, count)
                continue
            skip = sets[count]
            drafter = LayerSkipDrafter(skip, model.spec.num_items, max_draft=args.gamma, confidence_threshold=0.0)
            result = decode(model, prefilled.copy(), config, SamplingParams(), drafter)
            if result.token_ids != plain:  # a multi-row verify may round a near-tie the other way
                logger.warning("%s x%d: the drafted answer differs from plain decoding's", kind, count)
            stats = result.stats
            attention, mlp = fractions(skip, model.spec.num_layers)
            rows.append(
                {"kind": kind, "count": count, "attention_skipped": attention, "mlp_skipped": mlp,
                 "alpha": alpha_from_tokens(stats.mean_accepted_len, args.gamma),
                 "acceptance_rate": stats.acceptance_rate, "tokens_per_step": stats.mean_accepted_len,
                 "tokens_equal": result.token_ids == plain, "skip": sorted(skip)}
            )  # fmt: skip
            logger.info("%s x%d: α %.2f", kind, count, rows[-1]["alpha"])
    return rows


def summarize(per_document: dict[str, list[dict]]) -> list[dict]:
    """One row per (kind, count) that every document measured: shares and α as medians."""
    keys = [(row["kind"], row["count"]) for row in next(iter(per_document.values()))]
    summary = []
    for kind, count in keys:
        found = [row for rows in per_document.values() for row in rows if (row["kind"], row["count"]) == (kind, count)]
        if len(found) < len(per_document):
            continue
        summary.append(
            {"kind": kind, "count": count, "documents": len(found),
             **{name: statistics.median(row[name] for row in found)
                for name in ("attention_skipped", "mlp_skipped", "alpha", "acceptance_rate", "tokens_per_step")}}
        )  # fmt: skip
    return summary


def format_table(summary: list[dict], model_name: str, args: argparse.Namespace) -> str:
    lines = [
        f"Acceptance of layer-skip drafts, {model_name}, {args.context_length}-token prompts, γ = {args.gamma}, "
        "greedy; medians over documents:",
        "",
        "| kind | items | attention skipped | MLP skipped | α | accepted / drafted | tokens per step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        lines.append(
            f"| {row['kind']} | {row['count']} | {row['attention_skipped']:.0%} | {row['mlp_skipped']:.0%} "
            f"| {row['alpha']:.2f} | {row['acceptance_rate']:.2f} | {row['tokens_per_step']:.2f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    documents = load_documents(args.input, [i.strip() for i in args.ids.split(",") if i.strip()])
    per_document = {}
    for doc_id, text in documents.items():
        logger.info("%s", doc_id)
        per_document[doc_id] = measure_document(engine, text, args)
    summary = summarize(per_document)
    payload = {
        "model": engine.name,
        "num_layers": engine.model.spec.num_layers,
        "dtype": engine.mode.value,
        "context_length": args.context_length,
        "gamma": args.gamma,
        "max_new_tokens": args.max_new_tokens,
        "reference_tokens": args.reference_tokens,
        "documents": list(documents),
        "rows": summary,
        "per_document": per_document,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(format_table(summary, engine.name, args))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    return run_reporting_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
