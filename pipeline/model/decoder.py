"""What the decoding loop, the drafters and the KnapSpec search ask of a model, and of a
request's cache: one interface that the whole model (`SublayerModel`) and the pipelined one
(`pipeline.parallel.staged_model.PipelineModel`) both give, so that every strategy runs over
either unchanged (tests/model/test_decoder_protocol.py checks both against it).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

import torch

from pipeline.model.kv_pool import KVPool
from pipeline.model.packing import RequestRows
from pipeline.model.spec import ModelSpec


@runtime_checkable
class Cache(Protocol):
    """A request's KV cache, wherever its tensors live (kv_cache.CachePositions): positions below
    `length` are committed; a forward or commit past `capacity` raises kv_cache.CacheOverflow."""

    length: int

    @property
    def capacity(self) -> int: ...

    def check_room(self, end: int) -> None: ...

    def advance(self, num_tokens: int) -> None: ...

    def commit(self, length: int) -> None: ...

    def crop(self, length: int) -> None: ...

    def copy(self) -> Cache: ...


@runtime_checkable
class DecoderModel(Protocol):
    """A decoder run as 2L items, any subset of them, over its requests' caches."""

    spec: ModelSpec
    max_context: int
    device: torch.device
    dtype: torch.dtype  # of its activations, as its caches hold them
    pooled_caches: bool  # whether a batch's caches can be slots of one pool (new_pool)

    @property
    def prefill_chunk(self) -> int: ...

    def new_cache(self, capacity: int) -> Cache: ...

    def new_pool(self, num_slots: int, slot_capacity: int) -> KVPool:
        """Caches for a batch as slots of one pool (where `pooled_caches`)."""
        ...

    def release(self, cache: Cache, scrub: bool = False) -> None:
        """Give a request's cache back as it leaves a batch (`scrub`: zero what it held, after a fault)."""
        ...

    def forward(
        self,
        cache: Cache,
        token_ids: torch.Tensor,
        start: int,
        skip: Collection[int] = (),
        logits: str = "all",
        return_hidden: bool = False,
    ): ...

    def forward_batch(
        self, blocks: Sequence[RequestRows], skip: Collection[int] = (), logits: str = "all"
    ) -> list[torch.Tensor | None]: ...

    def prefill(self, cache: Cache, token_ids: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def run_item_branches(self, item: int, h: torch.Tensor, cache: Cache, prefix_len: int) -> torch.Tensor: ...
