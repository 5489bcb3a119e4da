"""Summarize one document — however long — through a pool of replicas, and the Ray Data stage around it.

A document that fits the prompt budget is one request. A longer one is cut into chunks on
paragraph boundaries, the chunks are summarized as independent requests (spread over the
replicas at once), and their summaries are summarized again until one request covers
them all (`pipeline/summarization/chunking.py`). Every request goes to a replica as token ids and comes
back as token ids with decoding statistics; this module turns those into the output row.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pyarrow as pa

from pipeline.decoding.sampling import SamplingParams
from pipeline.errors import ConfigError, KnapSpecError
from pipeline.summarization.chunking import SummaryRequest, check_chunk_budget, map_reduce
from pipeline.summarization.output import STATUS_OK, error_row, now, rows_to_table
from pipeline.summarization.prompts import build_prompt

logger = logging.getLogger(__name__)

INSTRUCTIONS = {
    "document": "Summarize the following document in a few sentences.\n\n{document}",
    "part": "Summarize the following part of a longer document in a few sentences.\n\n{document}",
    "part-summaries": (
        "The following are summaries of consecutive parts of a long document. "
        "Condense them into one shorter summary.\n\n{document}"
    ),
    "summaries": (
        "The following are summaries of consecutive parts of one document. "
        "Combine them into a single summary of the whole document in a few sentences.\n\n{document}"
    ),
}
# Tokens kept free in every prompt: re-tokenizing a chunk inside the template can add a few.
_PROMPT_MARGIN = 16
_ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")

# A replica call: (prompt token ids, max new tokens, sampling) for each request -> one result
# dict per request ({"token_ids", "stats", "extra", ...}, as EngineReplica.generate returns).
GenerateMany = Callable[[list[tuple[list[int], int, SamplingParams]]], list[dict]]


@dataclass(frozen=True)
class SummarizeSettings:
    model: str  # the name written to the `model` column
    strategy: str
    max_new_tokens: int = 64
    max_prompt_tokens: int = 4096  # per request, instruction and chat template included
    params: SamplingParams = field(default_factory=SamplingParams)
    max_levels: int = 8

    def __post_init__(self) -> None:
        check_chunk_budget(self.max_prompt_tokens, self.max_new_tokens)


@dataclass
class _Totals:
    """Decoding statistics summed over the requests of one document."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    skipped_attn: list[float] = field(default_factory=list)
    skipped_mlp: list[float] = field(default_factory=list)

    def add(self, result: dict) -> None:
        stats, extra = result["stats"], result.get("extra") or {}
        self.requests += 1
        for name in ("prompt_tokens", "output_tokens", "steps", "drafted_tokens", "accepted_tokens"):
            setattr(self, name, getattr(self, name) + int(stats[name]))
        self.prefill_s += float(stats["prefill_s"])
        self.decode_s += float(stats["decode_s"])
        if extra.get("mean_skipped_attn") is not None:
            self.skipped_attn.append(float(extra["mean_skipped_attn"]))
            self.skipped_mlp.append(float(extra["mean_skipped_mlp"]))

    def columns(self) -> dict:
        # Each request's first token comes from its prefill, as in GenerationStats.tokens_per_s.
        decoded = self.output_tokens - self.requests
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            "mean_accepted_len": (self.accepted_tokens + self.steps) / self.steps if self.steps else None,
            "mean_skipped_attn": _mean(self.skipped_attn),
            "mean_skipped_mlp": _mean(self.skipped_mlp),
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "tokens_per_s": decoded / self.decode_s if self.decode_s > 0 and decoded > 0 else None,
        }


class DocumentSummarizer:
    """Map-reduce summarization of one document over `generate_many` (pure of Ray)."""

    def __init__(self, tokenizer, generate_many: GenerateMany, settings: SummarizeSettings) -> None:
        self.tokenizer = tokenizer
        self.generate_many = generate_many
        self.settings = settings
        overhead = max(self._template_tokens(kind) for kind in INSTRUCTIONS)
        # The document text a request may carry: the prompt budget minus the instruction,
        # the chat template and a margin.
        self.max_text_tokens = settings.max_prompt_tokens - overhead - _PROMPT_MARGIN
        if self.max_text_tokens < 4 * settings.max_new_tokens:
            raise ConfigError(
                f"a prompt budget of {settings.max_prompt_tokens} tokens leaves {self.max_text_tokens} for text after "
                f"the instruction; need at least {4 * settings.max_new_tokens} (4 × max_new_tokens) for chunks to "
                "shrink at every level; raise --max-chunk-tokens or lower --max-new-tokens"
            )

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def summarize(self, doc_id: str, text: str, reference: str | None = None) -> dict:
        """The output row of one document; raises RowError when it cannot be summarized."""
        totals = _Totals()

        def summarize_requests(requests: list[SummaryRequest]) -> list[str]:
            calls = [
                (self._prompt_ids(r), self.settings.max_new_tokens, self._params(doc_id, r)) for r in requests
            ]
            results = self.generate_many(calls)
            for result in results:
                totals.add(result)
            return [self.tokenizer.decode(r["token_ids"], skip_special_tokens=True).strip() for r in results]

        outcome = map_reduce(
            text,
            count_tokens=self.count_tokens,
            max_tokens=self.max_text_tokens,
            summarize=summarize_requests,
            max_levels=self.settings.max_levels,
        )
        row = {
            "id": doc_id,
            "summary": outcome.summary,
            "status": STATUS_OK,
            "error": None,
            "model": self.settings.model,
            "strategy": self.settings.strategy,
            "num_chunks": outcome.num_chunks,
            **totals.columns(),
            **rouge(outcome.summary, reference),
            "finished_at": now(),
        }
        return row

    def _prompt_ids(self, request: SummaryRequest) -> list[int]:
        prompt = build_prompt(
            self.tokenizer, request.text, self.settings.max_prompt_tokens, instruction=INSTRUCTIONS[request.kind]
        )
        if prompt.truncated:
            # Chunks are sized to fit; a cut here means the token arithmetic is off.
            logger.warning("A %s request of %d tokens was cut to fit the prompt budget", request.kind,
                           prompt.document_tokens)
        return prompt.token_ids.tolist()

    def _params(self, doc_id: str, request: SummaryRequest) -> SamplingParams:
        """Seeded sampling gives each request its own seed, derived from the document and its place,
        so that a rerun (or a retried request) draws the same tokens wherever it runs."""
        if self.settings.params.greedy or self.settings.params.seed is None:
            return self.settings.params
        key = f"{self.settings.params.seed}:{doc_id}:{request.level}:{request.index}".encode()
        return replace(self.settings.params, seed=int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)

    def _template_tokens(self, kind: str) -> int:
        return len(build_prompt(self.tokenizer, ".", None, instruction=INSTRUCTIONS[kind]).token_ids)


def rouge(summary: str, reference: str | None) -> dict:
    """ROUGE-1/2/L F-measures against the reference (null without one)."""
    if reference is None or not str(reference).strip():
        return dict.fromkeys(_ROUGE_TYPES)
    scores = _rouge_scorer().score(str(reference), summary)
    return {name: scores[name].fmeasure for name in _ROUGE_TYPES}


_scorer = None
_scorer_lock = threading.Lock()


def _rouge_scorer():
    global _scorer
    with _scorer_lock:
        if _scorer is None:
            from rouge_score import rouge_scorer

            _scorer = rouge_scorer.RougeScorer(list(_ROUGE_TYPES), use_stemmer=True)
    return _scorer


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ----------------------------------------------------------------------------- Ray Data stage


class ReplicaDispatcher:
    """Sends requests to the replica with the fewest requests in flight from this process."""

    def __init__(self, handles: list) -> None:
        if not handles:
            raise ConfigError("no replicas to send requests to")
        self.handles = handles
        self.in_flight = [0] * len(handles)
        self._lock = threading.Lock()

    def generate_many(self, calls: list[tuple[list[int], int, SamplingParams]]) -> list[dict]:
        import ray

        picks = []
        with self._lock:
            for _ in calls:
                index = min(range(len(self.handles)), key=self.in_flight.__getitem__)
                self.in_flight[index] += 1
                picks.append(index)
        refs = [self.handles[i].generate.remote(*call) for i, call in zip(picks, calls)]
        try:
            return ray.get(refs)
        finally:
            with self._lock:
                for index in picks:
                    self.in_flight[index] -= 1


class SummarizeBatch:
    """Ray Data `map_batches` class: documents in, output rows (OUTPUT_SCHEMA) out.

    One instance summarizes one document at a time, waiting on the replicas its chunks went
    to; the job runs several instances so that many documents are in flight. Any failure of
    a document becomes its error row; the job goes on.
    """

    def __init__(
        self,
        replicas: list,
        settings: SummarizeSettings,
        tokenizer_path: str,
        duplicate_ids: dict[str, int] | set[str] | None = None,
    ) -> None:
        from pathlib import Path

        from pipeline.model import checkpoint

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.settings = settings
        self.dispatcher = ReplicaDispatcher(replicas)
        tokenizer = checkpoint.load_tokenizer(Path(tokenizer_path))
        self.summarizer = DocumentSummarizer(tokenizer, self.dispatcher.generate_many, settings)
        self.duplicate_ids = duplicate_ids or {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        return rows_to_table([self.summarize_row(row) for row in batch.to_pylist()])

    def summarize_row(self, row: dict) -> dict:
        from pipeline.summarization.documents import validate_row

        problem = validate_row(row["id"], row["text"], row["input_error"], self.duplicate_ids)
        if problem is not None:
            return error_row(row["id"], problem, self.settings.model, self.settings.strategy)
        started = time.perf_counter()
        try:
            out = self.summarizer.summarize(row["id"], row["text"], row.get("reference"))
        except KnapSpecError as e:
            message = str(e)
        except Exception as e:  # a replica that could not recover, or a bug: the row says so, the job goes on
            logger.exception("Document %r failed", row["id"])
            message = f"{type(e).__name__}: {e}"
        else:
            logger.info(
                "Summarized %s: %d chunks, %d prompt + %d output tokens in %.1f s",
                row["id"], out["num_chunks"], out["prompt_tokens"], out["output_tokens"],
                time.perf_counter() - started,
            )
            return out
        logger.warning("Document %r: %s", row["id"], message)
        return error_row(row["id"], message, self.settings.model, self.settings.strategy)
