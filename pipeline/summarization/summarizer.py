"""Summarize one document — however long — through a pool of replicas (pure of Ray).

A document that fits the prompt budget is one request. A longer one is cut into chunks on
paragraph boundaries, the chunks are summarized as independent requests (spread over the
replicas at once), and their summaries are summarized again until one request covers
them all (`pipeline/summarization/chunking.py`). Every request goes to a replica as token ids and comes
back as token ids with decoding statistics; this module turns those into the output row.
The Ray Data stage that runs it is `pipeline/summarization/stage.py`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.stats import GenerationStats
from pipeline.errors import ConfigError, RowError
from pipeline.summarization.chunking import SummaryRequest, check_chunk_budget, map_reduce
from pipeline.summarization.output import STATUS_OK, now
from pipeline.summarization.prompts import INSTRUCTIONS, build_prompt

logger = logging.getLogger(__name__)

# The request kinds (chunking.SummaryRequest.kind) whose answer is the document's summary.
FINAL_KINDS = frozenset({"document", "summaries"})
# Tokens kept free in every prompt: re-tokenizing a chunk inside the template can add a few.
_PROMPT_MARGIN = 16
_ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")

# A replica call: (prompt token ids, max new tokens, sampling) for each request -> one result
# dict per request ({"token_ids", "stats", "extra", ...}, as EngineReplica.generate returns).
GenerateMany = Callable[[list[tuple[list[int], int, SamplingParams]]], list[dict]]


# Greedy decoding of a small model loops ("She is very strange. She is very strange. ..."),
# mostly in the reduce step. No 3-gram twice in an answer, chosen by measurement on the bundled
# documents (docs/summary-quality.md); over the answer only, so that it may still quote its
# document. A hard ban, unlike a penalty, also rules out a loop on documents not measured.
DEFAULT_SUMMARY_PARAMS = SamplingParams(no_repeat_ngram_size=3, repetition_scope="answer")
# Chosen by measurement with the final budget below (docs/summary-quality.md).
DEFAULT_END_ON_SENTENCE = 0.9
DEFAULT_MAX_SUMMARY_TOKENS = 128
# A row over this many bytes of text is an error before it is tokenized: 10 MB is ~2.3M SmolLM2
# tokens (4.4 bytes each on the bundled documents), ~550 chunk requests, and ~80 minutes of a
# 2-core CPU replica's prefill at the default job's 473 prompt tokens/s (docs/job.md).
DEFAULT_MAX_DOCUMENT_BYTES = 10_000_000


@dataclass(frozen=True)
class RequestTimeout:
    """How long one request may take, queueing at its replica included: `base_s` plus
    `per_token_s` for each prompt and answer token (pipeline/summarization/dispatch.py). A
    replica is judged hung after that long. The per-token default is ~100 times what the
    embedded model takes on 2 CPU cores (473 prompt tokens/s, docs/job.md): a model ten times
    its size on such a CPU, queued behind a full batch, still fits."""

    base_s: float = 600.0
    per_token_s: float = 0.25

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.per_token_s < 0:
            raise ConfigError(f"a request timeout needs base_s > 0 and per_token_s >= 0, got {self}")

    def seconds(self, prompt_tokens: int, max_new_tokens: int) -> float:
        return self.base_s + self.per_token_s * (prompt_tokens + max_new_tokens)

    def no_progress_s(self, settings: SummarizeSettings, attempts: int) -> float:
        """How long the summarize stage may go without a finished document while healthy: the
        longest request of `settings` through `attempts` tries, each to its timeout. Ray Data's
        guard against a hung run (`execution_no_progress_timeout_s`, 30 minutes by default)
        must not be shorter: on a slow device a healthy run of long documents would trip it."""
        longest = self.seconds(
            settings.max_prompt_tokens, max(settings.max_new_tokens, settings.max_summary_tokens or 0)
        )
        return attempts * longest


DEFAULT_REQUEST_TIMEOUT = RequestTimeout()


@dataclass(frozen=True)
class SummarizeSettings:
    model: str  # the name written to the `model` column
    strategy: str
    max_new_tokens: int = 64  # per request whose summary is summarized again (a chunk's)
    # The final summary's budget (the one request of a short document, the last reduce step of a
    # long one): what is read, and not summarized again. None: max_new_tokens.
    max_summary_tokens: int | None = DEFAULT_MAX_SUMMARY_TOKENS
    max_prompt_tokens: int = 4096  # per request, instruction and chat template included
    params: SamplingParams = DEFAULT_SUMMARY_PARAMS
    max_levels: int = 8
    # Past this share of its budget, a request's answer ends at its first sentence end, and one that
    # uses its whole budget loses its unfinished last sentence (pipeline/decoding/stopping.py): map
    # summaries too, since the reduce step reads them. None: answers end at EOS or the budget.
    end_on_sentence: float | None = DEFAULT_END_ON_SENTENCE
    max_document_bytes: int | None = DEFAULT_MAX_DOCUMENT_BYTES  # a longer text is its row's error; None: no limit
    # Requests one document keeps at the replicas at once: a document of hundreds of chunks sends
    # them in waves of this many, so that other documents' requests interleave. None: all at once.
    max_requests_in_flight: int | None = None
    # The instruction of each request kind (chunking.SummaryRequest.kind), "{document}" in each.
    instructions: Mapping[str, str] = field(default_factory=lambda: dict(INSTRUCTIONS))

    def __post_init__(self) -> None:
        check_chunk_budget(self.max_prompt_tokens, self.max_new_tokens)
        if self.max_summary_tokens is not None and self.max_summary_tokens < 1:
            raise ConfigError(f"max_summary_tokens must be at least 1, got {self.max_summary_tokens}")
        for name in ("max_document_bytes", "max_requests_in_flight"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1 or None, got {getattr(self, name)}")
        if self.end_on_sentence is not None and not 0 < self.end_on_sentence <= 1:
            raise ConfigError(f"end_on_sentence must be a share of the budget in (0, 1], got {self.end_on_sentence}")
        if set(self.instructions) != set(INSTRUCTIONS):
            raise ConfigError(f"instructions must be given for exactly {', '.join(INSTRUCTIONS)}")
        for kind, instruction in self.instructions.items():
            if "{document}" not in instruction:
                raise ConfigError(f"the {kind!r} instruction must contain '{{document}}'")


class DocumentSummarizer:
    """Map-reduce summarization of one document over `generate_many` (pure of Ray)."""

    def __init__(self, tokenizer, generate_many: GenerateMany, settings: SummarizeSettings) -> None:
        self.tokenizer = tokenizer
        self.generate_many = generate_many
        self.settings = settings
        # Documents are summarized on several threads at once; a fast tokenizer must not be
        # used by two of them at a time ("Already borrowed").
        self._tokenizing = threading.RLock()
        overhead = max(self._template_tokens(kind) for kind in settings.instructions)
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
        with self._tokenizing:
            return len(self.tokenizer.encode(text, add_special_tokens=False))

    def summarize(self, doc_id: str, text: str, reference: str | None = None) -> dict:
        """The output row of one document; raises RowError when it cannot be summarized."""
        limit = self.settings.max_document_bytes
        # A character is at most 4 bytes: a short text needs no count.
        if (
            limit is not None
            and isinstance(text, str)
            and len(text) > limit // 4
            and (size := len(text.encode())) > limit
        ):
            raise RowError(f"the text is {size:,} bytes, more than the limit of {limit:,} (--max-document-bytes)")
        answered: list[dict] = []
        final_finish: list[str | None] = [None]

        def summarize_requests(requests: list[SummaryRequest]) -> list[str]:
            calls = [(self._prompt_ids(r), self._max_new_tokens(r), self._params(doc_id, r)) for r in requests]
            wave = self.settings.max_requests_in_flight or len(calls)
            results = [
                result for at in range(0, len(calls), wave) for result in self.generate_many(calls[at : at + wave])
            ]
            answered.extend(results)
            if requests[-1].kind in FINAL_KINDS:
                final_finish[0] = results[-1].get("finish_reason")
            with self._tokenizing:
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
            "finish_reason": final_finish[0],
            "status": STATUS_OK,
            "error": None,
            "error_kind": None,
            "model": self.settings.model,
            "strategy": self.settings.strategy,
            "num_chunks": outcome.num_chunks,
            **decoding_columns(answered),
            **rouge(outcome.summary, reference),
            "finished_at": now(),
        }
        return row

    def _prompt_ids(self, request: SummaryRequest) -> list[int]:
        with self._tokenizing:
            prompt = build_prompt(
                self.tokenizer,
                request.text,
                self.settings.max_prompt_tokens,
                instruction=self.settings.instructions[request.kind],
            )
        if prompt.truncated:
            # Chunks are sized to fit; a cut here means the token arithmetic is off.
            logger.warning(
                "A %s request of %d tokens was cut to fit the prompt budget", request.kind, prompt.document_tokens
            )
        return prompt.token_ids.tolist()

    def _max_new_tokens(self, request: SummaryRequest) -> int:
        final = request.kind in FINAL_KINDS
        if final and self.settings.max_summary_tokens is not None:
            return self.settings.max_summary_tokens
        return self.settings.max_new_tokens

    def _params(self, doc_id: str, request: SummaryRequest) -> SamplingParams:
        """The request's sentence rule, from its budget. Seeded sampling gives each request its own
        seed, derived from the document and its place, so that a rerun (or a retried request) draws
        the same tokens wherever it runs."""
        params = self.settings.params
        if self.settings.end_on_sentence is not None:
            after = max(1, math.ceil(self.settings.end_on_sentence * self._max_new_tokens(request)))
            params = replace(params, end_on_sentence_after=after)
        if params.greedy or params.seed is None:
            return params
        key = f"{params.seed}:{doc_id}:{request.level}:{request.index}".encode()
        return replace(params, seed=int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)

    def _template_tokens(self, kind: str) -> int:
        return len(build_prompt(self.tokenizer, ".", None, instruction=self.settings.instructions[kind]).token_ids)


def decoding_columns(results: Sequence[dict]) -> dict:
    """The output row's decoding columns, summed over the replica results of one document."""
    stats = GenerationStats.total(GenerationStats.from_dict(result["stats"]) for result in results)
    extras = [result.get("extra") or {} for result in results]
    skipped = [extra for extra in extras if extra.get("mean_skipped_attn") is not None]
    return {
        "prompt_tokens": stats.prompt_tokens,
        "output_tokens": stats.output_tokens,
        "steps": stats.steps,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        # Null rather than 0.0 where the rate has nothing to measure: no forward after the prefill,
        # or no token decoded in measurable time.
        "mean_accepted_len": stats.mean_accepted_len if stats.steps else None,
        "mean_skipped_attn": _mean([float(extra["mean_skipped_attn"]) for extra in skipped]),
        "mean_skipped_mlp": _mean([float(extra["mean_skipped_mlp"]) for extra in skipped]),
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "tokens_per_s": stats.tokens_per_s if stats.decode_s > 0 and stats.decoded_tokens else None,
    }


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
