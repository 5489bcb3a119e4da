"""Hugging Face `generate()` as the outside reference for speed and greedy output."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.decoding.loop import DecodeConfig, GenerationResult
from pipeline.decoding.prompt_lookup import DEFAULT_MAX_NGRAM
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.stats import GenerationStats
from pipeline.decoding.stopping import end_on_sentence
from pipeline.errors import ConfigError
from pipeline.model.checkpoint import load_hf_model
from pipeline.model.linear import ComputeMode


def prepare_hf_model(model, mode: ComputeMode):
    """Put a float32 transformers model into `mode`, so it compares like with like."""
    if mode is ComputeMode.BF16:
        return model.to(torch.bfloat16)
    if mode.fp16_weights:
        # Same FBGEMM fp16-weight kernels as our fp16w linears (also for prefill, where ours keep
        # fp32, or bf16 in fp16w-bf16).
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.float16)
    return model


@dataclass
class HFRun:
    token_ids: list[int]  # the new tokens
    prefill_s: float
    decode_s: float
    num_forwards: int  # full-model forwards after the prefill one


class _FirstTokenClock:
    """A streamer that notes when the first new token arrives (the end of prefill).

    generate() streams once per forward (a whole accepted run in assisted decoding), so
    its calls also count the forwards.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf_generate(
    model,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    params: SamplingParams,
    pad_token_id: int | None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
) -> HFRun:
    """Run `generate()`, with transformers' own prompt lookup when `prompt_lookup_num_tokens` is set.

    Transformers' lookup differs from ours: it takes the earliest match, not the most
    recent, and falls back to single-token matches; `max_matching_ngram_size` is its
    longest n-gram (default 2). In assisted decoding the prefill forward also verifies
    the first draft, so `prefill_s` then includes up to that many extra positions.
    """
    generation_config = _generation_config(
        max_new_tokens,
        eos_token_ids,
        params,
        pad_token_id,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        max_matching_ngram_size=max_matching_ngram_size,
    )
    return _generate(model, [prompt_ids], generation_config, params)[0]


def run_hf_generate_batch(
    model,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    params: SamplingParams,
    pad_token_id: int | None,
) -> list[HFRun]:
    """`generate()` over a left-padded batch, as a transformers user batches: one run per prompt,
    its tokens up to its first EOS; the batch's prefill and decode seconds are each run's."""
    # Left padding needs a pad id; a model without one pads with an EOS id (masked out).
    pad = pad_token_id if pad_token_id is not None else min(eos_token_ids, default=0)
    return _generate(model, prompts, _generation_config(max_new_tokens, eos_token_ids, params, pad), params)


def _generation_config(
    max_new_tokens: int, eos_token_ids: Collection[int], params: SamplingParams, pad_token_id: int | None, **extra
):
    from transformers import GenerationConfig

    everywhere = params.repetition_scope == "all"
    if params.no_repeat_ngram_size and not everywhere:
        raise ConfigError(
            "transformers' generate() bans repeated n-grams over the prompt too: it has no answer-only "
            "no_repeat_ngram_size (use repetition_scope 'all' to compare with it)"
        )
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not params.greedy,
        temperature=params.temperature if not params.greedy else None,
        top_p=params.top_p if not params.greedy else None,
        top_k=params.top_k if not params.greedy else None,
        # An answer-only penalty is a processor of its own (_logits_processors).
        repetition_penalty=params.repetition_penalty if everywhere and params.repetition_penalty != 1.0 else None,
        no_repeat_ngram_size=params.no_repeat_ngram_size or None,
        eos_token_id=sorted(eos_token_ids),
        pad_token_id=pad_token_id,
        num_beams=1,
        **extra,
    )


def _logits_processors(params: SamplingParams, prompt_width: int):
    """transformers' own penalty told to ignore the (padded) prompt, for an answer-only scope."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    if params.repetition_scope == "all" or params.repetition_penalty == 1.0:
        return None
    return LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty), prompt_ignore_length=prompt_width)]
    )


def _generate(model, prompts: Sequence[torch.Tensor], generation_config, params: SamplingParams) -> list[HFRun]:
    if not params.greedy and params.seed is not None:
        torch.manual_seed(params.seed)
    width = max(p.numel() for p in prompts)
    pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    # The prompt's own <|im_end|> tokens equal the pad id in chat models: an explicit mask
    # (ones over each prompt, zeros over its left padding) stops generate() from masking them out.
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - prompt.numel() :] = prompt
        attention_mask[row, width - prompt.numel() :] = 1
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            logits_processor=_logits_processors(params, width),
            streamer=clock,
        )
    t1 = time.perf_counter()
    first = clock.first_token_at or t1
    # Calls: the prompt, then one per forward; the first forward is the prefill.
    num_forwards = max(clock.calls - 2, 0)
    eos = set(generation_config.eos_token_id or ())
    runs = []
    for row in out[:, width:].tolist():
        # A finished row is padded to the batch's length: its tokens end at its first EOS.
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        runs.append(HFRun(row[:end], first - t0, t1 - first, num_forwards))
    return runs


class HFReference:
    """transformers' `generate()` over a checkpoint, as the engine's outside reference: the
    model loaded on first use, its answers cut by the same sentence rule, with statistics in
    our terms."""

    def __init__(self, path: Path, device: torch.device, mode: ComputeMode, pad_token_id: int | None) -> None:
        self.path, self.device, self.mode, self.pad_token_id = path, device, mode, pad_token_id
        self._model = None

    @property
    def model(self):
        if self._model is None:
            self._model = prepare_hf_model(load_hf_model(self.path).to(self.device), self.mode)
        return self._model

    def generate(
        self, prompt_ids: torch.Tensor, config: DecodeConfig, params: SamplingParams, lookup_tokens: int | None = None
    ) -> GenerationResult:
        """One prompt; `lookup_tokens`: transformers' own prompt lookup, with drafts of that many tokens."""
        run = run_hf_generate(
            self.model,
            prompt_ids,
            config.max_new_tokens,
            config.eos_token_ids,
            params,
            self.pad_token_id,
            prompt_lookup_num_tokens=lookup_tokens,
            max_matching_ngram_size=None if lookup_tokens is None else DEFAULT_MAX_NGRAM,
        )
        return self._result(prompt_ids, run, config)

    def generate_batches(
        self, prompts: Sequence[torch.Tensor], config: DecodeConfig, params: Sequence[SamplingParams], max_batch: int
    ) -> list[GenerationResult]:
        """Left-padded generate() batches of up to `max_batch` prompts; a batch samples with one
        setting for all its prompts, so every prompt must have the same."""
        if any(q != params[0] for q in params):
            raise ConfigError("a generate() batch samples with one setting for all its prompts")
        results = []
        for at in range(0, len(prompts), max_batch):
            batch = prompts[at : at + max_batch]
            runs = run_hf_generate_batch(
                self.model, batch, config.max_new_tokens, config.eos_token_ids, params[0], self.pad_token_id
            )
            results += [self._result(prompt, run, config) for prompt, run in zip(batch, runs)]
        return results

    @staticmethod
    def _result(prompt_ids: torch.Tensor, run: HFRun, config: DecodeConfig) -> GenerationResult:
        # generate() stops at EOS and the budget only: the sentence rule applies to its stream after.
        token_ids, finish = end_on_sentence(run.token_ids, config.max_new_tokens, config.eos_token_ids, config.stop)
        # generate() does not say how many tokens it drafted, only how many forwards it
        # ran; tokens beyond one per forward were accepted drafts. In a batch the forwards
        # are the batch's: a request that ended early ran fewer.
        stats = GenerationStats(
            prompt_tokens=prompt_ids.numel(),
            output_tokens=len(token_ids),
            steps=min(run.num_forwards, max(len(token_ids) - 1, 0)),
            accepted_tokens=max(len(token_ids) - 1 - run.num_forwards, 0),
            prefill_s=run.prefill_s,
            decode_s=run.decode_s,
        )
        return GenerationResult(token_ids=token_ids, stats=stats, finish_reason=finish)
