"""The rows of several requests packed into one batched forward: what each request brings,
and how the logits of its rows come back out."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError
from pipeline.model.kv_cache import KVCache


@dataclass(frozen=True)
class RequestRows:
    """One request's rows in a batched forward: `token_ids` [T] at positions [start, start + T)
    of its own cache (T = 1 to decode, 1 + γ to verify, a chunk to prefill). `logits`: which of
    its rows need logits ("all", "last", "none"); None takes the forward's choice."""

    cache: KVCache  # or any cache with the same interface (a pipeline's)
    token_ids: torch.Tensor
    start: int
    logits: str | None = None


def check_logit_choices(blocks: Sequence[RequestRows], default: str) -> list[str]:
    """Each block's logits choice ("all", "last", "none"), its own or the forward's."""
    if not blocks:
        raise ConfigError("a batched forward needs at least one request")
    wanted = [block.logits or default for block in blocks]
    for choice in wanted:
        if choice not in ("all", "last", "none"):
            raise ConfigError(f"logits must be 'all', 'last' or 'none', got {choice!r}")
    return wanted


def packed_logits(
    head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, wanted: Sequence[str], sizes: Sequence[int]
) -> list[torch.Tensor | None]:
    """`head` (final norm and LM head) once over the packed rows [M, d] that need logits, split
    back per request: all its rows, its last, or None (`wanted`); `sizes` are its row counts."""
    if all(choice == "all" for choice in wanted):
        return list(head(h).split(list(sizes)))
    offsets = [0, *itertools.accumulate(sizes)]
    rows = [
        range(a, e) if choice == "all" else range(e - 1, e) if choice == "last" else range(0)
        for choice, a, e in zip(wanted, offsets, offsets[1:])
    ]
    if not any(rows):
        return [None] * len(wanted)
    index = torch.tensor([row for block in rows for row in block], device=h.device)
    parts = iter(head(h[index]).split([len(block) for block in rows if block]))
    return [next(parts) if block else None for block in rows]
