"""How much context a request may use, and how a prompt is fed: the model's position limit
(or its sliding window), and chunked prefill — shared by the whole model and the pipelined one."""

from __future__ import annotations

import torch

from pipeline.errors import ConfigError
from pipeline.model.spec import ModelSpec, sliding_window_of

# Prefill chunks are as long as this many floats of MLP activations allow: long chunks
# waste less attention work on masked-out blocks and run larger matmuls.
PREFILL_ACTIVATION_BUDGET = 16 * 2**20
MIN_PREFILL_CHUNK, MAX_PREFILL_CHUNK = 512, 4096


def check_context(capacity: int, max_context: int) -> None:
    if capacity > max_context:
        raise ConfigError(
            f"a context of {capacity} tokens exceeds this model's limit of {max_context}; "
            "lower --max-context or --max-new-tokens"
        )


def prefill_in_chunks(model, cache, token_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """A prompt through `model.forward` in chunks from `cache.length`, logits of the last position
    only; then the prompt is committed. Shared by the whole model and the pipelined one."""
    start = cache.length
    cache.check_room(start + token_ids.shape[0])
    last = None
    for offset in range(0, token_ids.shape[0], chunk_size):
        chunk = token_ids[offset : offset + chunk_size]
        is_last = offset + chunk_size >= token_ids.shape[0]
        last = model.forward(cache, chunk, start + offset, logits="last" if is_last else "none").logits
    cache.commit(start + token_ids.shape[0])
    return last[0]


def max_context_of(config, spec: ModelSpec) -> int:
    """Most positions a request may use: the trained length, or the sliding window if shorter."""
    window = sliding_window_of(config)
    return spec.max_position_embeddings if window is None else min(window, spec.max_position_embeddings)


def prefill_chunk_for(spec: ModelSpec) -> int:
    """Prompt rows per prefill forward: as many as the activation budget allows (a power of two)."""
    rows = PREFILL_ACTIVATION_BUDGET // (2 * spec.intermediate_size)
    return max(MIN_PREFILL_CHUNK, min(MAX_PREFILL_CHUNK, 1 << max(rows, 1).bit_length() - 1))
