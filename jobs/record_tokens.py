#!/usr/bin/env python
"""Greedy tokens of every strategy, recorded before a change to the engine and compared after.

Records, for each strategy, each bundled document cut to each prompt length, the greedy
answer decoded alone and in batches, with the statistics that do not depend on timing. The
searching strategies plan on a fixed latency model, so that their plans, and the statistics
of a request decoded alone, repeat; a batch's draft budget learns from measured step times,
so batched statistics are recorded but not compared.

    python jobs/record_tokens.py --output /tmp/tokens-before.json     # on the old code
    python jobs/record_tokens.py --output /tmp/tokens-after.json      # on the new code
    python jobs/record_tokens.py --compare /tmp/tokens-before.json /tmp/tokens-after.json

Record both on one machine: prefill runs PyTorch's kernels, whose bits differ between CPUs.
`--compare` names each answer that differs, where, and the top-2 logit gap of plain decoding
at that token (a difference at a gap under 1e-4 is a near-tie; above it, a bug). It exits 1
when an answer differs above the tie gap or a timing-free statistic differs. Two records of
two compute modes (`--dtype`) compare too: how many tokens their answers share, on average.

`--forced REFERENCE` measures how far a compute mode moves the model's numbers, which ROUGE
over a few references cannot: the reference mode's greedy answers (plain decoding, each
document alone) are fed back token by token through both modes, one decode step per token,
and at every position it counts whether this mode's next-token choice is the reference's,
and the KL divergence of its distribution from the reference's:

    python jobs/record_tokens.py --forced fp32 --dtype fp16w-bf16 --lengths 4096 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from job_cli import positive_int, run_reporting_errors
from pipeline.logs import configure_logging

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = REPO / "data" / "sample.jsonl"
TIE_GAP = 1e-4
# The statistics of a request alone that no timing touches.
COMPARED_STATS = ("prompt_tokens", "output_tokens", "steps", "drafted_tokens", "accepted_tokens")

logger = logging.getLogger("record_tokens")


def bundled_documents(count: int) -> list[dict]:
    """The first `count` bundled documents."""
    return [json.loads(line) for line in DOCUMENTS.read_text().splitlines() if line.strip()][:count]


def fixed_latency(num_layers: int):
    """A latency model that repeats on every machine: verification nearly free, so the
    searching strategies draft, and their drafts are really checked."""
    from pipeline.knapspec.latency import LatencyModel

    return LatencyModel(
        attn_slope=2e-7, attn_base=4e-4, t_mlp=5e-4, t_fixed=1e-3, verify_ratios=(1.0,) * 11, num_layers=num_layers
    )


def record(args: argparse.Namespace) -> dict:
    from pipeline.engine import Engine, EngineConfig, StrategyConfig
    from pipeline.model import checkpoint
    from pipeline.summarization.prompts import build_prompt

    config = checkpoint.load_config(checkpoint.resolve_checkpoint(args.model))
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, latency=fixed_latency(config.num_hidden_layers)))
    docs = bundled_documents(args.documents)
    out = {"meta": _meta(engine), "prompts": {}, "runs": {}}
    for length in args.lengths:
        prompts = [build_prompt(engine.tokenizer, d["text"], max_prompt_tokens=length).token_ids for d in docs]
        for doc, prompt in zip(docs, prompts):
            out["prompts"][f"{length}/{doc['id']}"] = prompt.tolist()
        for name in args.strategies:
            strategy = StrategyConfig(name)
            ways = [("alone", [engine.generate(p, strategy, args.max_new_tokens) for p in prompts])]
            if args.batch:
                batch = engine.generate_batch(prompts, strategy, args.max_new_tokens, max_batch=args.batch)
                ways.append((f"batch{args.batch}", batch))
            for way, results in ways:
                for doc, result in zip(docs, results):
                    stats = result.stats.to_dict()
                    out["runs"][f"{name}/{length}/{way}/{doc['id']}"] = {
                        "tokens": result.token_ids,
                        "finish_reason": result.finish_reason,
                        "stats": {k: stats[k] for k in COMPARED_STATS},
                    }
            logger.info(
                "%s at %d prompt tokens: %d documents alone and in batches of %d", name, length, len(docs), args.batch
            )
    return out


def _meta(engine) -> dict:
    """What decides the bits of a record: the CPU and the kernels PyTorch picks on it, the mode."""
    from profiling.record import cpu_model_name

    return {
        "cpu": cpu_model_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "mode": engine.mode.value,
        "model": engine.name,
    }


def compare(before: dict, after: dict, args: argparse.Namespace) -> int:
    """Print what differs; 1 when an answer differs above the tie gap or a timing-free statistic differs."""
    if before["meta"] != after["meta"]:
        print(f"warning: recorded on different setups:\n  {before['meta']}\n  {after['meta']}")
    bad = 0
    differs = any(run["tokens"] != after["runs"].get(key, {}).get("tokens") for key, run in before["runs"].items())
    gaps = _Gaps(args) if differs else None
    missing = sorted(set(before["runs"]) ^ set(after["runs"]))
    if missing:
        print(f"{len(missing)} runs recorded on one side only, e.g. {missing[:3]}")
        bad += 1
    same = 0
    agreed = []  # per answer, the tokens both records share before they part
    for key in sorted(set(before["runs"]) & set(after["runs"])):
        old, new = before["runs"][key], after["runs"][key]
        if old["tokens"] == new["tokens"] and old["finish_reason"] == new["finish_reason"]:
            same += 1
            agreed.append(len(old["tokens"]))
            if key.split("/")[2] == "alone" and old["stats"] != new["stats"]:
                print(f"{key}: same tokens, statistics differ: {old['stats']} -> {new['stats']}")
                bad += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(old["tokens"], new["tokens"])) if a != b), None)
        at = min(len(old["tokens"]), len(new["tokens"])) if at is None else at
        _, length, _, doc = key.split("/")
        gap = gaps.at(before["prompts"][f"{length}/{doc}"], old["tokens"][:at])
        verdict = "near-tie" if gap < TIE_GAP else "DIFFERS"
        bad += gap >= TIE_GAP
        print(f"{key}: first different token at {at} of {len(old['tokens'])}, top-2 gap {gap:.2e} ({verdict})")
        agreed.append(at)
    print(f"{same} of {len(agreed)} answers identical token for token")
    if agreed:  # (across compute modes, two records --dtype apart: how long their answers agree)
        print(f"answers agree on their first {sum(agreed) / len(agreed):.1f} tokens on average")
    return 1 if bad else 0


def forced_logits(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The logits [len(answer), V] before each answer token, the answer fed back token by
    token: the prompt's prefill, then one decode step per token (as greedy decoding computes them)."""
    cache = model.new_cache(len(prompt) + len(answer))
    with torch.inference_mode():
        rows = [model.prefill(cache, torch.tensor(prompt, device=model.device))]
        for i, token in enumerate(answer[:-1]):
            ids = torch.tensor([token], device=model.device)
            rows.append(model.forward(cache, ids, len(prompt) + i, logits="last").logits[0])
            cache.commit(len(prompt) + i + 1)
    return torch.stack(rows).float().cpu()


def forced_agreement(reference: torch.Tensor, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Positions whose argmax is the reference's, and KL(reference || logits) at each [n]."""
    ref, own = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (ref.exp() * (ref - own)).sum(-1).clamp_min(0.0)
    return int((reference.argmax(-1) == logits.argmax(-1)).sum()), kl


def forced(args: argparse.Namespace) -> int:
    """--forced: the reference mode's greedy answers through both modes (module doc)."""
    from pipeline.engine import Engine, EngineConfig, StrategyConfig
    from pipeline.summarization.prompts import build_prompt

    engines = {dtype: Engine(EngineConfig(model=args.model, dtype=dtype)) for dtype in (args.forced, args.dtype)}
    reference, other = engines[args.forced], engines[args.dtype]
    docs = bundled_documents(args.documents)
    agree = positions = 0
    divergences = []
    for length in args.lengths:
        for doc in docs:
            prompt = build_prompt(reference.tokenizer, doc["text"], max_prompt_tokens=length).token_ids.tolist()
            answer = reference.generate(torch.tensor(prompt), StrategyConfig("ar"), args.max_new_tokens).token_ids
            if not answer:
                continue
            same, kl = forced_agreement(forced_logits(reference.model, prompt, answer),
                                        forced_logits(other.model, prompt, answer))  # fmt: skip
            agree, positions = agree + same, positions + len(answer)
            divergences.append(kl)
            logger.info("%s at %d prompt tokens: %d of %d choices agree", doc["id"], len(prompt), same, len(answer))
    kl = torch.cat(divergences) if divergences else torch.zeros(1)
    print(f"{other.model.mode.value} against {reference.model.mode.value}, {len(divergences)} answers teacher-forced:")
    print(f"next-token choice agrees at {agree} of {positions} positions")
    print(f"KL from the reference: mean {kl.mean():.2e}, median {kl.median():.2e}, p99 {kl.quantile(0.99):.2e}")
    return 0


class _Gaps:
    """Top-2 logit gaps of plain decoding, on the model of the code that runs the comparison."""

    def __init__(self, args: argparse.Namespace) -> None:
        from pipeline.engine import Engine, EngineConfig

        self.engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))

    def at(self, prompt: list[int], prefix: list[int]) -> float:
        model = self.engine.model
        ids = torch.tensor(prompt + prefix)
        cache = model.new_cache(ids.numel() + 1)
        logits = model.prefill(cache, ids)
        top = torch.topk(logits.float().reshape(-1), 2).values
        return float(top[0] - top[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from pipeline.engine import STRATEGIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="where to write the record (keep it out of the repository)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two records")
    parser.add_argument("--forced", metavar="REFERENCE", help="teacher-force REFERENCE mode's answers through --dtype")
    parser.add_argument("--strategies", type=lambda v: v.split(","), default=list(STRATEGIES))
    parser.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 4096],
                        help="prompt tokens, each document cut to fit (default 1024,4096)")  # fmt: skip
    parser.add_argument("--documents", type=positive_int, default=10, help="the first N bundled documents")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="requests per batch; 0: each answer alone only")
    parser.add_argument("--model", help="a checkpoint folder (default: the embedded model)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.output, args.compare, args.forced)) != 1:
        parser.error("give --output to record, --compare BEFORE AFTER, or --forced REFERENCE")
    if args.batch < 0:
        parser.error(f"--batch must be >= 0, got {args.batch}")
    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategies: {', '.join(unknown)}")
    return args


def run(args: argparse.Namespace) -> int:
    if args.compare:
        before, after = (json.loads(path.read_text()) for path in args.compare)
        return compare(before, after, args)
    if args.forced:
        return forced(args)
    args.output.write_text(json.dumps(record(args)))
    print(f"Recorded to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    return run_reporting_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
