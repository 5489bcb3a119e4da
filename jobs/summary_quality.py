#!/usr/bin/env python
"""Summary quality of decoding settings side by side: ROUGE against the references and loops.

Every document is summarized as the summarize job does it (the same chunking, prompts and
map-reduce, `pipeline.summarization.summarizer`), once per setting, in one process: each
map prompt is prefilled once and every setting decodes from its own copy, so a sweep costs
about one job's prefill plus one decode per setting. Decoding is greedy `ar` in the CPU
default mode: every strategy emits the same tokens, so the settings are what differ.

    python jobs/summary_quality.py --settings "off,reduce=previous;ngram=3;ngram=3,reduce=topic;penalty=1.1"

A setting is comma-separated `ngram=N` (no_repeat_ngram_size), `penalty=P`
(repetition_penalty), `scope=all|answer` (default answer), `reduce=NAME` (the reduce
step's instruction, one of REDUCE_INSTRUCTIONS), `final=N` (the final summary's token
budget; default --max-new-tokens) and `sentence=SHARE|off` (the summarize job's
--end-on-sentence; default off); `off` is none of them. Writes OUT/summary_quality.json and
prints a markdown table: ROUGE, loops, how the summaries end, and the seconds each setting's
own prefills and decoding took (the map prompts' prefill is counted once, by the first setting).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
logger = logging.getLogger("summary_quality")

# Reduce-step instructions measured against each other ("summaries" and "part-summaries"
# requests: summaries of consecutive parts, combined).
REDUCE_INSTRUCTIONS = {
    "job": None,  # what the summarize job uses now (prompts.INSTRUCTIONS)
    "previous": {  # the job's until the sweep in docs/summary-quality.md chose "job"
        "summaries": (
            "The following are summaries of consecutive parts of one document. "
            "Combine them into a single summary of the whole document in a few sentences.\n\n{document}"
        ),
        "part-summaries": (
            "The following are summaries of consecutive parts of a long document. "
            "Condense them into one shorter summary.\n\n{document}"
        ),
    },
    "topic": {
        "summaries": (
            "Here are summaries of the parts of a document, in order. In three or four sentences, say what "
            "the whole document is about and what it concludes. Do not repeat yourself.\n\n{document}"
        ),
        "part-summaries": (
            "Here are summaries of parts of a long document, in order. Shorten them into one summary of "
            "these parts. Do not repeat yourself.\n\n{document}"
        ),
    },
}


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    repetition_scope: str = "answer"
    reduce: str = "job"
    final: int | None = None  # the final summary's token budget (None: --max-new-tokens)
    sentence: float | None = None  # end on a sentence past this share of every budget (None: off)


def parse_setting(text: str) -> Setting:
    text = text.strip()
    if text == "off":
        return Setting("off")
    fields = {}
    for part in text.split(","):
        if part.strip() == "off":
            continue  # no repetition control, whatever else the setting says
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"setting {text!r}: expected KEY=VALUE parts, got {part!r}")
        fields[key.strip()] = value.strip()
    known = {"ngram": ("no_repeat_ngram_size", int), "penalty": ("repetition_penalty", float)}
    known |= {"scope": ("repetition_scope", str), "reduce": ("reduce", str), "final": ("final", int)}
    known |= {"sentence": ("sentence", lambda v: None if v == "off" else float(v))}
    unknown = set(fields) - set(known)
    if unknown:
        raise ValueError(f"setting {text!r}: unknown {', '.join(sorted(unknown))} (use {', '.join(known)})")
    setting = Setting(text, **{known[k][0]: known[k][1](v) for k, v in fields.items()})
    if setting.reduce not in REDUCE_INSTRUCTIONS:
        raise ValueError(f"setting {text!r}: reduce must be one of {', '.join(REDUCE_INSTRUCTIONS)}")
    return setting


class PrefilledCalls:
    """A summarizer's `generate_many` on one in-process engine: greedy `ar`, requests decoded
    together in batches, each distinct prompt prefilled once and reused by every setting."""

    def __init__(self, engine, max_batch: int, max_new_tokens: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_new_tokens = max_new_tokens  # the largest budget of any setting: every prefill has room for it
        self.prefilled: dict[tuple[int, ...], object] = {}
        # Greedy decoding is a function of the prompt and the settings: settings that differ only
        # in the reduce step share their map step's results.
        self.results: dict[tuple, dict] = {}
        self.setting = ""  # whose calls these are: the seconds below are counted by setting
        self.seconds: dict[str, dict[str, float]] = {}

    def __call__(self, calls: list) -> list[dict]:
        import torch

        from pipeline.decoding.decode import decode_requests
        from pipeline.decoding.loop import DecodingRequest

        seconds = self.seconds.setdefault(self.setting, {"prefill": 0.0, "decode": 0.0})
        todo = []
        for ids, max_new_tokens, params in calls:
            key = (tuple(ids), max_new_tokens, params)
            if key in self.results:
                continue
            if key[0] not in self.prefilled:
                started = time.perf_counter()
                self.prefilled[key[0]] = self.engine.prefill(torch.tensor(ids), self.max_new_tokens)
                seconds["prefill"] += time.perf_counter() - started
            config = self.engine.decode_config(max_new_tokens, params)
            todo.append((key, DecodingRequest(self.prefilled[key[0]].copy(), config, params, None, list(ids))))
        started = time.perf_counter()
        for at in range(0, len(todo), self.max_batch):
            batch = todo[at : at + self.max_batch]
            for (key, _), r in zip(batch, decode_requests(self.engine.model, [request for _, request in batch])):
                self.results[key] = {
                    "token_ids": r.token_ids,
                    "finish_reason": r.finish_reason,
                    "stats": r.stats.to_dict(),
                    "extra": r.extra,
                }
        seconds["decode"] += time.perf_counter() - started
        return [self.results[(tuple(ids), m, params)] for ids, m, params in calls]

    def forget(self) -> None:
        self.prefilled.clear()
        self.results.clear()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from job_cli import Parser, positive_int

    parser = Parser(prog="summary_quality.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, default=REPO / "data" / "sample.jsonl", help="a .jsonl file")
    parser.add_argument("--ids", help="comma-separated document ids (default: every document)")
    parser.add_argument("--settings", default="off;ngram=4", help="settings separated by ';' (see above)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--max-chunk-tokens", type=positive_int, default=4096)
    parser.add_argument("--max-batch", type=positive_int, default=8)
    parser.add_argument("--output", type=Path, default=Path("out"))
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.engine import Engine, EngineConfig
    from pipeline.summarization.prompts import INSTRUCTIONS
    from pipeline.summarization.quality import ends_on_sentence, repetitions
    from pipeline.summarization.summarizer import DocumentSummarizer, SummarizeSettings

    settings = [parse_setting(s) for s in args.settings.split(";") if s.strip()]
    documents = [json.loads(line) for line in args.input.read_text().splitlines() if line.strip()]
    if args.ids:
        wanted = args.ids.split(",")
        documents = [d for d in documents if d["id"] in wanted]
    engine = Engine(EngineConfig(dtype=args.dtype))
    calls = PrefilledCalls(engine, args.max_batch, max([args.max_new_tokens] + [s.final or 0 for s in settings]))
    summarizers = {}
    for s in settings:
        params = SamplingParams(
            repetition_penalty=s.repetition_penalty,
            no_repeat_ngram_size=s.no_repeat_ngram_size,
            repetition_scope=s.repetition_scope,
        )
        instructions = dict(INSTRUCTIONS) | (REDUCE_INSTRUCTIONS[s.reduce] or {})
        room = engine.model.max_context - max(args.max_new_tokens, s.final or 0)
        config = SummarizeSettings(
            model=engine.name,
            strategy="ar",
            max_new_tokens=args.max_new_tokens,
            max_summary_tokens=s.final,
            end_on_sentence=s.sentence,
            max_prompt_tokens=min(args.max_chunk_tokens, room),
            params=params,
            instructions=instructions,
        )
        summarizers[s.name] = DocumentSummarizer(engine.tokenizer, calls, config)
    rows = []
    for doc in documents:
        for s in settings:
            calls.setting = s.name
            row = summarizers[s.name].summarize(doc["id"], doc["text"], doc.get("reference_summary"))
            found = repetitions(row["summary"])
            rows.append(
                {"setting": s.name, "id": doc["id"], "loops": bool(found), "repeated": [r.text for r in found[:3]]}
                | {"ends_on_sentence": ends_on_sentence(row["summary"]), "words": len(row["summary"].split())}
                | {k: row[k] for k in ("rouge1", "rouge2", "rougeL", "finish_reason", "output_tokens", "summary")}
            )
            logger.info(
                "%s [%s]: rouge1 %s, %s", doc["id"], s.name, _fmt(row["rouge1"]), "LOOPS" if found else "no loop"
            )
        calls.forget()
    table = summary_table(rows, [s.name for s in settings], calls.seconds)
    args.output.mkdir(parents=True, exist_ok=True)
    out = {
        "rows": rows,
        "table": table,
        "settings": vars(args) | {"input": str(args.input), "output": str(args.output)},
    }
    (args.output / "summary_quality.json").write_text(json.dumps(out, indent=2, default=str))
    print(format_table(table, len(documents)))
    return 0


def summary_table(rows: list[dict], names: list[str], seconds: dict[str, dict[str, float]]) -> list[dict]:
    table = []
    for name in names:
        mine = [r for r in rows if r["setting"] == name]
        scored = [r for r in mine if r["rouge1"] is not None]
        table.append(
            {
                "setting": name,
                "documents": len(mine),
                "looping": sum(r["loops"] for r in mine),
                "looping_ids": [r["id"] for r in mine if r["loops"]],
                "ends_on_sentence": sum(r["ends_on_sentence"] for r in mine),
                "finish_reasons": dict(Counter(r["finish_reason"] for r in mine)),
                "mean_words": statistics.mean(r["words"] for r in mine) if mine else None,
            }
            | {k: statistics.mean(r[k] for r in scored) if scored else None for k in ("rouge1", "rouge2", "rougeL")}
            | {f"{k}_s": seconds.get(name, {}).get(k, 0.0) for k in ("prefill", "decode")}
        )
    return table


def format_table(table: list[dict], num_documents: int) -> str:
    lines = [
        (
            "| setting | ROUGE-1 | ROUGE-2 | ROUGE-L | summaries that loop | end on a sentence | how they ended "
            "| words (mean) | own prefill s | decode s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        ended = ", ".join(f"{reason} {n}" for reason, n in sorted(t["finish_reasons"].items(), key=str))
        lines.append(
            f"| {t['setting']} | {_fmt(t['rouge1'])} | {_fmt(t['rouge2'])} | {_fmt(t['rougeL'])} "
            f"| {t['looping']} / {num_documents} | {t['ends_on_sentence']} / {num_documents} | {ended} "
            f"| {t['mean_words']:.0f} | {t['prefill_s']:.0f} | {t['decode_s']:.0f} |"
        )
    return "\n".join(lines)


def _fmt(value) -> str:
    return "—" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    from job_cli import run_reporting_errors
    from pipeline.logs import configure_logging

    args = parse_args(argv)
    configure_logging()
    return run_reporting_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
