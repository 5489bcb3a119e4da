"""A decoder run as 2L items (sublayers), any subset of them, over its own KV cache.

An attention item is input norm -> self-attention -> residual add, an MLP item
post-attention norm -> MLP -> residual add (numbering: `pipeline.model.items`). A skipped
item is the identity on the residual stream (KnapSpec, Sec. 3), so a draft model is just
the set of items to skip. A forward packs the rows of one or more requests, each over its
own KV cache (which has no batch dimension); `forward` is a forward of one request. Every
forward, the profiler's single items and the DP's branches go through one item function
and one attention entry point (`pipeline.model.attention`); the layer math itself is in
`pipeline.model.layers`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from pipeline.model import items
from pipeline.model.attention import Attention, Branches
from pipeline.model.context import check_context, prefill_chunk_for, prefill_in_chunks
from pipeline.model.fused import EAGER, ItemOps, fused_ops
from pipeline.model.graphs import GraphSettings, StepGraphs
from pipeline.model.kv_cache import KVCache
from pipeline.model.kv_pool import KVPool, PooledCache
from pipeline.model.layers import split_attention_available
from pipeline.model.linear import KERNEL_MAX_ROWS, ComputeMode, Linear
from pipeline.model.packing import RequestRows, check_logit_choices, packed_logits, ranged_linear
from pipeline.model.precision import Exactness, exactness
from pipeline.model.rotary import RotaryTables
from pipeline.model.short_attention import KERNEL_ROUTE, MATMUL_ROUTE, kernel_applies, rms_norm_rows, silu_mul_rows
from pipeline.model.spec import ModelSpec
from pipeline.model.staging import HostStaging
from pipeline.model.step_rows import Rows, step_rows
from pipeline.model.weights import LayerWeights


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [num_logit_positions, V], float32
    hidden_states: torch.Tensor | None  # [num_items + 1, T, d]: the residual stream before item 0 and after each item


class SublayerModel:
    def __init__(
        self,
        spec: ModelSpec,
        layers: Sequence[LayerWeights],
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: Linear,
        rotary: torch.nn.Module,
        mode: ComputeMode,
        max_context: int,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.layers = list(layers)
        self.embed = embed  # [V, d]
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.mode = mode
        self.max_context = max_context
        self.device = device
        self.dtype = mode.activation_dtype
        self.rotary = RotaryTables(rotary, spec.head_dim, max_context, self.dtype, device)
        # Decode and verify attention through the fused CPU kernel (not fp32: it stays transformers' math).
        self._kernel = kernel_applies(mode is not ComputeMode.FP32, torch.device(device), spec.head_dim)
        # Prefill chunks in bf16: split at their start, through the device's flash kernel, unmasked
        # (a boolean mask rules out SDPA's flash backend on a GPU, and costs 2x on a CPU).
        split = mode.prefill_dtype == torch.bfloat16 and torch.device(device).type in ("cpu", "cuda")
        split_dtype = mode.prefill_dtype if split and split_attention_available(device) else None
        self._long_masks = split_dtype is None  # (a split long block needs none: step_rows)
        # Every item's attention.
        self.attention = Attention(spec.num_kv_heads, spec.head_dim, self._kernel, split_dtype)
        self.attention_route = KERNEL_ROUTE if self._kernel else MATMUL_ROUTE  # latency tables are per route
        self.exactness: Exactness = exactness(mode, row_kernels=self._kernel and lm_head.packed)  # (precision.py)
        # Sums the residual updates of a tensor-parallel group (pipeline/parallel/tensor_parallel.py):
        # with a shard of the heads and MLP columns, o_proj and down_proj give partial sums.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.pooled_caches = True  # a batch's caches are slots of one KVPool
        self.staging = HostStaging(self.device)  # every forward's metadata, in one copy
        self.graphs: GraphSettings | None = None  # captured steps (graphs/), where use_graphs asked
        self.ops: ItemOps = EAGER  # an item's element-wise work (fused.py)

    def use_graphs(self, settings: GraphSettings | None) -> None:
        """Run the decode, verify and draft steps over pools made from now on as captured steps
        (pipeline/model/graphs); None: every forward eagerly. The latency tables follow: a
        captured step's items cost what their replays cost (profiling/microbench.py)."""
        self.graphs = settings
        self.ops = fused_ops() if settings is not None and settings.fuse_on(self.device) else EAGER
        route = KERNEL_ROUTE if self._kernel else MATMUL_ROUTE
        if settings is not None:
            route = f"captured {'flex' if settings.flex_on(self.device) else route}"
        self.attention_route = route

    # ------------------------------------------------------------------ caches

    def new_cache(self, capacity: int) -> KVCache:
        check_context(capacity, self.max_context)
        s = self.spec
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, self.dtype, self.device)

    def new_pool(self, num_slots: int, slot_capacity: int) -> KVPool:
        """Caches for a batch: `num_slots` slots of `slot_capacity` positions (kv_pool.py)."""
        check_context(slot_capacity, self.max_context)
        s = self.spec
        scratch = self.graphs is not None  # (where a captured step's padding rows write)
        return KVPool(
            s.num_layers, s.num_kv_heads, s.head_dim, num_slots, slot_capacity, self.dtype, self.device, scratch
        )

    def release(self, cache: KVCache, scrub: bool = False) -> None:
        """A pool's slot goes back to its pool (KVPool.release says why `scrub`); a cache of its
        own is freed with its last reference."""
        if isinstance(cache, PooledCache):
            cache.pool.release(cache, scrub=scrub)

    # ----------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        token_ids: torch.Tensor,
        start: int,
        skip: Collection[int] = (),
        logits: str = "all",
        return_hidden: bool = False,
    ) -> ForwardOutput:
        """`forward_batch` of one request: tokens at positions [start, start + T) through every item
        not in `skip`, their keys/values into `cache`. `logits`: "all" (one row per token), "last",
        or "none"; `return_hidden`: also the residual stream before item 0 and after each item."""
        out, hidden = self.run_blocks([RequestRows(cache, token_ids, start)], skip, logits, return_hidden)
        return ForwardOutput(logits=out[0], hidden_states=hidden)

    @torch.inference_mode()
    def forward_batch(
        self, blocks: Sequence[RequestRows], skip: Collection[int] = (), logits: str = "all"
    ) -> list[torch.Tensor | None]:
        """One forward over the rows of several requests: every linear runs once over all rows,
        attention per request over its own cache (into which its keys/values go), so a request's
        result does not depend on the others' values. `skip` is the batch's one sub-network.
        Per request: logits for each of its rows ("all"), its last row ("last"), or None ("none"),
        as its `RequestRows.logits` says, else as `logits` does (a prefill chunk rides along with
        decode rows and needs none but its last).
        """
        graphs = self._graphs_of(blocks)
        if graphs is not None:
            wanted = check_logit_choices(blocks, logits)
            parts = graphs.parts(blocks, wanted)
            if parts is not None:
                return graphs.run_parts(parts, blocks, skip, wanted)
        return self.run_blocks(blocks, skip, logits)[0]

    def _graphs_of(self, blocks: Sequence[RequestRows]) -> StepGraphs | None:
        """The captured steps over the pool of `blocks`' first cache, made at its first step."""
        cache = blocks[0].cache if blocks else None
        if self.graphs is None or not isinstance(cache, PooledCache) or cache.pool.scratch_position is None:
            return None
        if cache.pool.graphs is None:
            cache.pool.graphs = StepGraphs(self, cache.pool, self.graphs)
        return cache.pool.graphs

    def run_blocks(
        self, blocks: Sequence[RequestRows], skip: Collection[int], logits: str, return_hidden: bool = False
    ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """The forward itself: each block's logits, and with `return_hidden` the packed residual
        stream before item 0 and after each item [num_items + 1, M, d]."""
        wanted = check_logit_choices(blocks, logits)
        spans = [(block.cache, block.start, len(block.token_ids)) for block in blocks]
        return self.run_step(self.rows(spans, [block.token_ids for block in blocks], wanted), skip, return_hidden)

    def run_step(
        self, rows: Rows, skip: Collection[int] = (), return_hidden: bool = False
    ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """A forward over rows made by `rows` with their token ids and logit choices: from there
        on every index it reads is on the device, and nothing waits on the host
        (tests/model/test_step_on_device.py)."""
        h = self.embed[rows.token_ids]  # [M, d]
        out, hidden = self._run_items(rows, h, skip, return_hidden)
        return self.batch_logits(out, rows), torch.cat([h[None], hidden]) if return_hidden else None

    @torch.inference_mode()
    def run_layers(
        self, rows: Rows, h: torch.Tensor, skip: Collection[int] = (), return_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed residual stream [M, d] of requests through every item not in `skip`, over
        `rows` (SublayerModel.rows). With `return_hidden`, also the stream after each item
        [num_items, M, d]."""
        return self._run_items(rows, h, skip, return_hidden)

    def _run_items(
        self, rows: Rows, h: torch.Tensor, skip: Collection[int], return_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Not under inference_mode of its own: a compiled step (torch.compile) runs it under no_grad.
        hidden = [] if return_hidden else None
        for item in range(2 * len(self.layers)):
            if item not in skip:
                h = self._item(item, h, rows)
            if hidden is not None:
                hidden.append(h)
        return h, torch.stack(hidden) if hidden is not None else None

    def rows(
        self,
        spans: Sequence[tuple[KVCache, int, int]],
        token_ids: Sequence[torch.Tensor | Sequence[int]] | None = None,
        logits: Sequence[str] | None = None,
    ) -> Rows:
        """What every item of a forward over `spans` (cache, start, rows) needs of its rows, with
        each block's `token_ids` and `logits` choice where the embedding and the LM head run too
        (step_rows.py: the host's part moved to the device in one copy)."""
        kernel, packed, masks = self._kernel, self.lm_head.packed, self._long_masks
        return step_rows(spans, token_ids, logits, self.staging, self.rotary, kernel, packed, long_masks=masks)

    def batch_logits(self, h: torch.Tensor, rows: Rows) -> list[torch.Tensor | None]:
        """The LM head once over the packed rows [M, d] that need logits, split back per request."""
        wanted, sizes = rows.logits, rows.sizes
        needed = [n if choice == "all" else 1 for choice, n in zip(wanted, sizes) if choice != "none"]
        packed = all(n <= KERNEL_MAX_ROWS for n in needed)  # the kernel each request's rows get alone
        return packed_logits(lambda x: self.logits(x, packed), h, wanted, sizes, rows.logit_index)

    def logits(self, h: torch.Tensor, packed: bool | None = None) -> torch.Tensor:
        """Final norm and LM head: residual stream [rows, d] -> float32 logits [rows, V]."""
        return self.lm_head(self._rms_norm(h, self.final_norm), packed).float()

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[token_ids]

    @torch.inference_mode()
    def run_item(self, item: int, h: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The residual stream [M, d] after one item over `rows` (SublayerModel.rows), made once
        apart: profiling times items one at a time as a forward runs them. An attention item
        writes its keys/values into the rows' caches."""
        return self._item(item, h, rows)

    @torch.inference_mode()
    def run_item_branches(self, item: int, h: torch.Tensor, cache: KVCache, prefix_len: int) -> torch.Tensor:
        """One item on B branches [B, r, d] of the same r tokens at positions [prefix_len,
        prefix_len + r), which attend to the committed cache below `prefix_len` (only read) and
        causally to their own keys and values (attention.Branches)."""
        num_branches, num_tokens, d = h.shape
        end = prefix_len + num_tokens
        cos, sin = self.rotary.up_to(end)
        branches = Branches.of(cache, prefix_len, num_tokens, h.device)
        rows = Rows(branches, cos[prefix_len:end], sin[prefix_len:end], (num_branches, num_tokens), None)
        return self._item(item, h.reshape(num_branches * num_tokens, d), rows).view_as(h)

    @property
    def prefill_chunk(self) -> int:
        return prefill_chunk_for(self.spec)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, token_ids: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        """Fill the cache with a prompt from position `cache.length`; returns the last position's logits [V]."""
        return prefill_in_chunks(self, cache, token_ids, chunk_size or self.prefill_chunk)

    # -------------------------------------------------------------- sublayers

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._kernel and x.dtype == torch.float32:  # (fp16w; bf16 rows norm alike in PyTorch's ops)
            return rms_norm_rows(x, weight, self.spec.rms_norm_eps)
        return self.ops.norm(x, weight, self.spec.rms_norm_eps)

    def _mlp(self, layer: LayerWeights, h: torch.Tensor, ranges=None) -> torch.Tensor:
        gate_up = ranged_linear(layer.gate_up, self._rms_norm(h, layer.post_norm), ranges)
        gated = silu_mul_rows(gate_up) if self._kernel else self.ops.gate(gate_up)
        return self._reduced(ranged_linear(layer.down, gated, ranges))

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        # (A long block's bf16 products in fp16w-bf16 are summed over the ranks in fp32.)
        return partial if self.reduce is None else self.reduce(partial.to(self.dtype))

    def _item(self, item: int, h: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The packed residual stream [M, d] after one item; the only way through a layer."""
        index, is_mlp = items.split_item(item)
        layer = self.layers[index]
        if is_mlp:
            return h + self._mlp(layer, h, rows.ranges)
        q, k, v = self._qkv(layer, h, rows)
        return h + self._reduced(ranged_linear(layer.o, self.attention(index, q, k, v, rows.attention), rows.ranges))

    def _qkv(self, layer: LayerWeights, h: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows h [B * T, d] -> rotated queries [B, T, H, head_dim], keys and values [B, T, kv_heads, head_dim]."""
        s = self.spec
        qkv = ranged_linear(layer.qkv, self._rms_norm(h, layer.input_norm), rows.ranges)
        heads = s.num_heads + s.num_kv_heads
        # (A long block's products may come in bf16, fp16w-bf16's prefill: v widens here, q and k
        # in the rotation.)
        v = qkv[:, heads * s.head_dim :].to(self.dtype).view(*rows.shape, s.num_kv_heads, s.head_dim)
        qk = qkv[:, : heads * s.head_dim].view(*rows.shape, heads, s.head_dim)
        if layer.q_norm is None:
            # Queries and keys lie side by side: one rotation for both.
            qk = self.ops.rotary(qk, rows.cos, rows.sin)
            return qk[:, :, : s.num_heads], qk[:, :, s.num_heads :], v
        qk = qk.to(self.dtype)
        q = self.ops.rotary(self._rms_norm(qk[:, :, : s.num_heads], layer.q_norm), rows.cos, rows.sin)
        return q, self.ops.rotary(self._rms_norm(qk[:, :, s.num_heads :], layer.k_norm), rows.cos, rows.sin), v
