"""The draft/verify loop: prefill once, then propose, verify in one forward, accept.

Plain autoregressive decoding is the same loop with a drafter that proposes
nothing, so every strategy shares one verification and acceptance path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pipeline.decoding.drafters import Drafter, DraftRequest, NoDraft
from pipeline.decoding.sampling import SamplingParams, accept_greedy, accept_sampled, probabilities, sample
from pipeline.decoding.stats import GenerationStats
from pipeline.errors import ConfigError
from pipeline.model.kv_cache import KVCache
from pipeline.model.sublayer_model import SublayerModel


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "eos" or "length"
    extra: dict = field(default_factory=dict)


@dataclass
class Prefilled:
    """A prompt's KV cache and the logits after its last token."""

    cache: KVCache
    logits: torch.Tensor  # [V]
    prompt_tokens: int
    seconds: float

    def copy(self) -> Prefilled:
        return Prefilled(self.cache.copy(), self.logits.clone(), self.prompt_tokens, self.seconds)


def prefill(model: SublayerModel, prompt_ids: torch.Tensor, max_new_tokens: int) -> Prefilled:
    """Run the prompt into a cache with room for the answer.

    Drafts never need more: `decode` drafts at most up to the token limit, so the last
    position a draft or verify writes is that of the last answer token.
    """
    if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
        raise ConfigError("prompt_ids must be a non-empty 1-D tensor of token ids")
    t0 = time.perf_counter()
    cache = model.new_cache(prompt_ids.numel() + max_new_tokens)
    logits = model.prefill(cache, prompt_ids.to(model.device))
    return Prefilled(cache, logits, prompt_ids.numel(), time.perf_counter() - t0)


def decode(
    model: SublayerModel,
    prefilled: Prefilled,
    config: DecodeConfig,
    params: SamplingParams,
    drafter: Drafter | None = None,
    prompt_ids: list[int] | None = None,
) -> GenerationResult:
    """Generate after a prefilled prompt. Consumes `prefilled.cache`.

    `prompt_ids` is what drafters that copy from the context (prompt lookup) read.
    """
    drafter = drafter or NoDraft()
    generator = params.generator()
    cache = prefilled.cache
    stats = GenerationStats(prompt_tokens=prefilled.prompt_tokens, prefill_s=prefilled.seconds)
    t0 = time.perf_counter()

    pending = _choose(prefilled.logits, params, generator)  # its KV is not in the cache yet
    output = [pending]
    history = list(prompt_ids or []) + output  # prompt + emitted, kept in step with `output`
    while len(output) < config.max_new_tokens and pending not in config.eos_token_ids:
        # Drafting past the token limit is wasted: the verify step emits one token more than it drafts.
        room = config.max_new_tokens - len(output) - 1
        draft = drafter.propose(
            DraftRequest(model, cache, history, room, params, generator, config.eos_token_ids)
        )
        inputs = torch.tensor([pending, *draft.token_ids], device=model.device)
        logits = model.forward(cache, inputs, cache.length, logits="all").logits  # [1 + n, V]
        if params.greedy:
            emitted = accept_greedy(draft.token_ids, logits)
        else:
            emitted = accept_sampled(draft.token_ids, draft.probs, probabilities(logits, params), generator)
        num_accepted = len(emitted) - 1
        drafter.observe(len(draft.token_ids), num_accepted)
        # The verify forward wrote exact K/V for pending + the accepted drafts.
        cache.advance(1 + num_accepted)
        stats.steps += 1
        stats.drafted_tokens += len(draft.token_ids)
        stats.accepted_tokens += num_accepted
        for token in emitted:
            output.append(token)
            history.append(token)
            if token in config.eos_token_ids or len(output) >= config.max_new_tokens:
                break
        pending = output[-1]

    stats.decode_s = time.perf_counter() - t0
    stats.output_tokens = len(output)
    finish = "eos" if output[-1] in config.eos_token_ids else "length"
    # Searching drafters report their own numbers (search time, plans chosen).
    extra = drafter.summary() if hasattr(drafter, "summary") else {}
    return GenerationResult(token_ids=output, stats=stats, finish_reason=finish, extra=extra)


def _choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(logits.argmax())
    return sample(probabilities(logits, params), generator)
