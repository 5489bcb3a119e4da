"""A model cut into pipeline stages, and the view of it that the draft/verify loop drives.

`StageModel` is one stage: decoder layers [first, end) of a checkpoint — stage 0 also the
embeddings, the last stage also the final norm and LM head (pipeline/parallel/layout.py)
— built from only those tensors, holding the KV caches of the requests it serves. It is plain PyTorch; a Ray
actor (actors/shard.py) places it on a device.

`PipelineModel` presents a list of stages as a `DecoderModel` (pipeline/model/decoder.py),
the interface the decoding loop, the drafters and the KnapSpec search use, so every
strategy runs over a pipeline unchanged and produces the same tokens. Only token ids and hidden states cross stages.
A stage whose items a draft skips entirely (and that holds neither the embeddings nor
the head) is bypassed: no hop.

Stages are reached through links (pipeline/parallel/links.py). A forward sends the packed
rows of its requests from stage to stage as one tensor; a stage has one forward, and the
pipeline one loop over its stages (`PipelineModel._run_stages`), which `forward` (one
request) and `forward_batch` share.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import ConfigError
from pipeline.knapspec.knapsack import Frontier, KnapsackProblem, advance, branch_runner
from pipeline.knapspec.latency import LatencyModel, PipelineLatency
from pipeline.model import checkpoint
from pipeline.model.context import check_context, prefill_in_chunks
from pipeline.model.kv_cache import CachePositions, KVCache
from pipeline.model.kv_pool import KVPool
from pipeline.model.linear import ComputeMode
from pipeline.model.loading import model_from_tensors
from pipeline.model.packing import RequestRows, check_logit_choices
from pipeline.model.spec import ModelSpec
from pipeline.model.sublayer_model import ForwardOutput
from pipeline.parallel.layout import LAYER_PREFIX, StageLayout, partition_layers, stage_layouts, stage_tensor_filter
from pipeline.parallel.links import LocalLink, StageLink
from pipeline.parallel.tensor_parallel import shard_config, shard_reader

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------- stage


class StageModel:
    """Layers [first, end) of a model, their KV caches per request, and (first/last stage)
    the embeddings and head. Items and layers are numbered as in the whole model."""

    def __init__(
        self,
        path: Path,
        layout: StageLayout,
        mode: ComputeMode,
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """With `tp_size` > 1 this is rank `tp_rank` of the stage's tensor-parallel group: it
        reads and holds only its share of the heads and MLP columns, and sums partial results
        through `local.reduce` (set once the group is joined)."""
        config = checkpoint.load_config(path)
        spec = ModelSpec.from_hf_config(config)
        if layout.end_layer > spec.num_layers:
            raise ConfigError(f"stage layers [{layout.first_layer}, {layout.end_layer}) exceed the model's {spec.num_layers}")
        self.layout = layout
        self.full_spec = spec
        self.tp_rank, self.tp_size = tp_rank, tp_size
        tensors = checkpoint.read_tensors(
            path,
            keep=stage_tensor_filter(layout, spec.tie_word_embeddings),
            read=shard_reader(tp_rank, tp_size) if tp_size > 1 else None,
        )
        self.loaded_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        local_config = shard_config(config, tp_size)
        self.local = model_from_tensors(*_local_view(local_config, spec, layout, tensors), mode, device)
        self.caches: dict[str, KVCache] = {}
        self.model_name = path.name

    # Requests' caches. Positions are the request's; a cache holds only this stage's layers.

    def new_cache(self, request_id: str, capacity: int) -> None:
        self.caches[request_id] = self.local.new_cache(capacity)

    def free(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    def copy_cache(self, source: str, target: str) -> None:
        self.caches[target] = self.caches[source].copy()

    def forward(
        self,
        request_ids: Sequence[str],
        inputs: torch.Tensor,
        starts: Sequence[int],
        sizes: Sequence[int],
        skip: Collection[int],
        logits: Sequence[str] | None,
        return_hidden: bool = False,
    ) -> tuple[torch.Tensor | list[torch.Tensor | None], torch.Tensor | None]:
        """The packed rows of one or more requests: token ids (stage 0) or the residual stream
        [M, d] in; out the residual stream, or on the last stage each request's logits (`logits`:
        each one's choice; None on the other stages); and, when asked, the residual stream after
        each of this stage's items [2 * layers, M, d]."""
        local_skip = {self.layout.local_item(item) for item in skip if item in self.layout.items}
        spans = [(self.caches[r], start, n) for r, start, n in zip(request_ids, starts, sizes)]
        head = self.layout.has_head and logits is not None
        rows = self.local.rows(spans, logits=logits if head else None)
        h = self.local.embed_tokens(inputs) if self.layout.has_embeddings else inputs
        h, hidden = self.local.run_layers(rows, h, local_skip, return_hidden)
        return (self.local.batch_logits(h, rows) if head else h), hidden

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.local.embed_tokens(token_ids)

    def echo(self, value):
        """Returns its argument: the cost of a hop without the work."""
        return value

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.local.logits(h)

    def run_item_branches(self, item: int, h: torch.Tensor, request_id: str, prefix_len: int) -> torch.Tensor:
        return self.local.run_item_branches(self.layout.local_item(item), h, self.caches[request_id], prefix_len)

    @torch.inference_mode()
    def knapsack_rows(
        self,
        request_id: str,
        frontier: Frontier | torch.Tensor,
        problem: KnapsackProblem,
        prefix_len: int,
        layer_rows: bool = False,
    ) -> Frontier:
        """This stage's rows of the knapsack DP: the frontier from the previous stage in (stage 0:
        the reference tokens' ids), the frontier after this stage's last row out."""
        layout, cache = self.layout, self.caches[request_id]
        if layout.has_embeddings:
            frontier = Frontier.start(self.local.embed_tokens(frontier))
        rows = range(layout.first_layer, layout.end_layer) if layer_rows else layout.items
        run_local = branch_runner(lambda item, h: self.local.run_item_branches(item, h, cache, prefix_len), layer_rows)
        for row in rows:
            frontier = advance(frontier, row, problem, lambda row, h: run_local(row - rows.start, h))
        return frontier


def _local_view(config, spec: ModelSpec, layout: StageLayout, tensors: dict[str, torch.Tensor]):
    """The stage as a small model of its own: its layers renumbered from 0; the embeddings,
    final norm and head replaced by one-row placeholders where the stage does not run them
    (they are never used there, and cost nothing)."""
    local = {}
    for name, tensor in tensors.items():
        if name.startswith(LAYER_PREFIX):
            layer, rest = name[len(LAYER_PREFIX) :].split(".", 1)
            name = f"{LAYER_PREFIX}{int(layer) - layout.first_layer}.{rest}"
        local[name] = tensor
    local_config = copy.deepcopy(config)
    local_config.num_hidden_layers = layout.end_layer - layout.first_layer
    if not layout.has_embeddings and not (layout.has_head and spec.tie_word_embeddings):
        local_config.vocab_size = 1  # the one-row placeholder embeddings: token 0 only
    if not layout.has_head:
        local["model.norm.weight"] = torch.ones(spec.hidden_size)
        local_config.tie_word_embeddings = True
    local.setdefault("model.embed_tokens.weight", torch.zeros(1, spec.hidden_size))
    if layout.has_head and not spec.tie_word_embeddings and "lm_head.weight" not in local:
        raise ConfigError("checkpoint has no lm_head.weight and does not tie it to the embeddings")
    return local_config, local


# ---------------------------------------------------------------------------- pipeline


class PipelineCache(CachePositions):
    """A request's KV cache spread over the stages; the committed length is kept here.

    Stages write keys/values at the positions a forward names, so only the coordinator
    needs the length: accepting tokens and rolling back rejected drafts cost no hop."""

    _ids = itertools.count()

    def __init__(self, pipeline: PipelineModel, capacity: int, request_id: str | None = None) -> None:
        self.pipeline = pipeline
        self._capacity = capacity
        self.length = 0
        self.request_id = request_id or f"req-{next(self._ids)}"

    @property
    def capacity(self) -> int:
        return self._capacity

    def copy(self) -> PipelineCache:
        twin = PipelineCache(self.pipeline, self.capacity)
        for link in self.pipeline.links:
            link.call("copy_cache", self.request_id, twin.request_id)
        self.pipeline._track(twin.request_id)
        twin.length = self.length
        return twin


class PipelineModel:
    """Stages behind the interface the decoding loop and drafters use (model.decoder.DecoderModel)."""

    def __init__(
        self,
        links: Sequence[StageLink],
        layouts: Sequence[StageLayout],
        spec: ModelSpec,
        max_context: int,
        prefill_chunk: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`dtype`: the stages' activations, as their caches hold them (a batch's KV budget)."""
        if [(lay.first_layer, lay.end_layer) for lay in layouts] != partition_layers(spec.num_layers, len(layouts)):
            raise ConfigError("pipeline stages must cover the model's layers in order")
        self.links = list(links)
        self.layouts = list(layouts)
        self.spec = spec
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.dtype = dtype
        self.device = torch.device(device)
        self.hops = 0  # stage-to-stage transfers, for tests and statistics
        self.pooled_caches = False  # its caches live on the stages (new_pool)
        # Caches made on the stages, per calling thread: a coordinator serving several requests
        # at once (one thread each) frees only those of the request that ended.
        self._live = threading.local()

    @classmethod
    def local(cls, path: Path, num_stages: int, mode: ComputeMode, device: str = "cpu") -> PipelineModel:
        """All stages in this process (tests; a machine without Ray)."""
        spec = ModelSpec.from_hf_config(checkpoint.load_config(path))
        layouts = stage_layouts(spec.num_layers, num_stages)
        stages = [StageModel(path, layout, mode, device) for layout in layouts]
        last = stages[-1].local
        return cls([LocalLink(s) for s in stages], layouts, spec, last.max_context, last.prefill_chunk, device, last.dtype)

    def new_cache(self, capacity: int) -> PipelineCache:
        check_context(capacity, self.max_context)
        cache = PipelineCache(self, capacity)
        for link in self.links:
            link.call("new_cache", cache.request_id, capacity)
        self._track(cache.request_id)
        return cache

    def _track(self, request_id: str) -> None:
        if not hasattr(self._live, "ids"):
            self._live.ids = set()
        self._live.ids.add(request_id)

    def new_pool(self, num_slots: int, slot_capacity: int) -> KVPool:
        raise ConfigError("a pipeline's caches live on its stages, each request's its own: it has no pool")

    def release(self, cache: PipelineCache, scrub: bool = False) -> None:
        """Drop one request's caches on every stage (a batch frees each request as it leaves;
        a fresh cache is allocated zeroed, so there is nothing to scrub)."""
        for link in self.links:
            link.call("free", cache.request_id)
        getattr(self._live, "ids", set()).discard(cache.request_id)

    def free_all(self) -> None:
        """Drop the stage caches this thread made (a coordinator does so after each request)."""
        for request_id in getattr(self._live, "ids", ()):
            for link in self.links:
                link.call("free", request_id)
        self._live.ids = set()

    @torch.inference_mode()
    def forward(
        self,
        cache: PipelineCache,
        token_ids: torch.Tensor,
        start: int,
        skip: Collection[int] = (),
        logits: str = "all",
        return_hidden: bool = False,
    ) -> ForwardOutput:
        """SublayerModel.forward over the stages: `forward_batch` of one request."""
        out, hidden = self._run_stages([RequestRows(cache, token_ids, start)], skip, logits, return_hidden)
        return ForwardOutput(logits=out[0], hidden_states=hidden)

    @torch.inference_mode()
    def forward_batch(
        self, blocks: Sequence[RequestRows], skip: Collection[int] = (), logits: str = "all"
    ) -> list[torch.Tensor | None]:
        """SublayerModel.forward_batch over the stages: the packed rows of every request go from
        stage to stage as one tensor, each stage attending per request over its own caches."""
        return self._run_stages(blocks, skip, logits)[0]

    def _run_stages(
        self, blocks: Sequence[RequestRows], skip: Collection[int], logits: str, return_hidden: bool = False
    ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """The forward itself, stage after stage: a stage whose items the draft skips entirely
        (and that holds neither the embeddings nor the head) is bypassed, no hop, unless the
        residual stream after every item is asked for."""
        wanted = check_logit_choices(blocks, logits)
        sizes = [len(block.token_ids) for block in blocks]
        for block, size in zip(blocks, sizes):
            block.cache.check_room(block.start + size)
        ids = [block.cache.request_id for block in blocks]
        starts = [block.start for block in blocks]
        skip = frozenset(skip)
        token_ids = torch.cat([torch.as_tensor(block.token_ids) for block in blocks])
        x: Any = token_ids
        parts: list[Any] = []
        last = len(self.links) - 1
        for k, (link, layout) in enumerate(zip(self.links, self.layouts)):
            if 0 < k < last and not return_hidden and all(item in skip for item in layout.items):
                continue
            x, hidden = link.call(
                "forward", ids, x, starts, sizes, skip, wanted if k == last else None, return_hidden, num_returns=2
            )
            if k > 0:
                self.hops += 1
            parts.append(hidden)
        out = self.links[-1].get(x)
        if not return_hidden:
            return out, None
        hidden = [link.get(part) for link, part in zip(self.links, parts)]
        return out, torch.cat([self.embed_tokens(token_ids)[None], *hidden])

    @torch.inference_mode()
    def prefill(self, cache: PipelineCache, token_ids: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        return prefill_in_chunks(self, cache, token_ids, chunk_size or self.prefill_chunk)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.links[0].get(self.links[0].call("embed_tokens", token_ids))

    def calibrate(self, stage_tables: Sequence[LatencyModel], hop_rounds: int = 30) -> PipelineLatency:
        """The replica's latency model: stage k's table from its own device's profile, and the
        median hop from here to the last stage, measured now."""
        import statistics
        import time

        if len(stage_tables) != len(self.links):
            raise ValueError(f"{len(stage_tables)} stage tables for {len(self.links)} stages")
        probe = torch.zeros(1, self.spec.hidden_size)
        hops = []
        for _ in range(hop_rounds if len(self.links) > 1 else 0):
            started = time.perf_counter()
            self.links[-1].get(self.links[-1].call("echo", probe))
            hops.append(time.perf_counter() - started)
        return PipelineLatency.of(stage_tables, statistics.median(hops) if hops else 0.0)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.links[-1].get(self.links[-1].call("logits", h))

    def run_knapsack(
        self, cache: PipelineCache, token_ids: torch.Tensor, problem: KnapsackProblem, prefix_len: int, layer_rows: bool = False
    ) -> Frontier:
        """The DP across the stages: each runs its own rows on the frontier the previous stage
        hands it (stage to stage, not through here); only the last row's frontier comes back."""
        x: Any = token_ids
        for link in self.links:
            x = link.call("knapsack_rows", cache.request_id, x, problem, prefix_len, layer_rows)
        self.hops += len(self.links) - 1
        return self.links[-1].get(x)

    def run_item_branches(self, item: int, h: torch.Tensor, cache: PipelineCache, prefix_len: int) -> torch.Tensor:
        k = self._stage_of_item(item)
        return self.links[k].get(self.links[k].call("run_item_branches", item, h, cache.request_id, prefix_len))

    def _stage_of_item(self, item: int) -> int:
        for k, layout in enumerate(self.layouts):
            if item in layout.items:
                return k
        raise ConfigError(f"item {item} is outside the model's {self.spec.num_items} items")
