"""A decoder run as 2L items (sublayers), any subset of them, over its own KV cache.

An attention item is input norm -> self-attention -> residual add, an MLP item
post-attention norm -> MLP -> residual add (numbering: `pipeline.model.items`). A skipped
item is the identity on the residual stream (KnapSpec, Sec. 3), so a draft model is just
the set of items to skip. A forward runs one request over its own KV cache (which has
no batch dimension); `forward_batch` packs the rows of several requests, each with its
own cache. The layer math itself is in `pipeline.model.layers`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from pipeline.model import items
from pipeline.model.context import check_context, max_context_of, prefill_chunk_for, prefill_in_chunks
from pipeline.model.kv_cache import KVCache
from pipeline.model.kv_pool import KVPool
from pipeline.model.layers import (
    FUSED_ATTENTION_MIN_TOKENS,
    aligned_keys,
    apply_rotary,
    block_mask,
    fused_attention,
    group_queries,
    grouped_attention,
    kernel_attention,
    later_in_block,
    matmul_attention,
    pooled_attention,
    rms_norm,
    signed_sin,
    silu_mul,
    ungroup,
)
from pipeline.model.linear import KERNEL_MAX_ROWS, ComputeMode, Linear
from pipeline.model.packing import (
    PooledRows,
    RequestRows,
    check_logit_choices,
    kernel_ranges,
    packed_logits,
    pooled_rows,
)
from pipeline.model.precision import Exactness, exactness
from pipeline.model.short_attention import KERNEL_ROUTE, MATMUL_ROUTE, kernel_applies, rms_norm_rows
from pipeline.model.spec import ModelSpec
from pipeline.model.weights import LayerWeights, read_weights


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
        self.rotary = rotary
        self.mode = mode
        self.max_context = max_context
        self.device = device
        self.dtype = mode.activation_dtype
        self._cos = torch.empty(0, 1, spec.head_dim, device=device)
        self._sin = torch.empty(0, 1, spec.head_dim, device=device)
        self._scale = spec.head_dim**-0.5
        # Decode and verify attention through the fused CPU kernel (fp16w, bf16; fp32 stays transformers' math).
        self._kernel = kernel_applies(mode is not ComputeMode.FP32, torch.device(device), spec.head_dim)
        self.attention_route = KERNEL_ROUTE if self._kernel else MATMUL_ROUTE  # latency tables are per route
        self.exactness: Exactness = exactness(mode, row_kernels=self._kernel and lm_head.packed)  # (precision.py)
        # Sums the residual updates of a tensor-parallel group (pipeline/parallel/tensor_parallel.py):
        # with a shard of the heads and MLP columns, o_proj and down_proj give partial sums.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    # ----------------------------------------------------------------- loading

    @classmethod
    def from_tensors(
        cls,
        config,
        tensors: Mapping[str, torch.Tensor],
        mode: ComputeMode,
        device: torch.device | str = "cpu",
    ) -> SublayerModel:
        """Build from a Hugging Face config and its state dict (names as in the checkpoint)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        spec = ModelSpec.from_hf_config(config)
        device = torch.device(device)
        weights = read_weights(spec, tensors, mode, device)
        return cls(
            spec=spec,
            layers=weights.layers,
            embed=weights.embed,
            final_norm=weights.final_norm,
            lm_head=weights.lm_head,
            rotary=LlamaRotaryEmbedding(config).to(device),
            mode=mode,
            max_context=max_context_of(config, spec),
            device=device,
        )

    # ------------------------------------------------------------------ caches

    def new_cache(self, capacity: int) -> KVCache:
        check_context(capacity, self.max_context)
        s = self.spec
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, self.dtype, self.device)

    def new_pool(self, num_slots: int, slot_capacity: int) -> KVPool:
        """Caches for a batch: `num_slots` slots of `slot_capacity` positions (kv_pool.py)."""
        check_context(slot_capacity, self.max_context)
        s = self.spec
        return KVPool(s.num_layers, s.num_kv_heads, s.head_dim, num_slots, slot_capacity, self.dtype, self.device)

    def _rotary_tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if end > self._cos.shape[0]:
            size = min(max(end, 2 * self._cos.shape[0], 1024), max(end, self.max_context))
            positions = torch.arange(size, device=self.device)[None]
            probe = torch.empty(0, dtype=torch.float32, device=self.device)
            cos, sin = self.rotary(probe, positions)
            # [size, 1, head_dim]: rows broadcast over heads, the sine signed as apply_rotary takes it.
            self._cos, self._sin = cos[0, :, None].to(self.dtype), signed_sin(sin[0, :, None].to(self.dtype))
        return self._cos, self._sin

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
        """Run tokens at positions [start, start + T) through every item not in `skip`.

        Writes their keys/values into `cache` for the attention items it executes.
        `logits` is "all" (one row per token), "last", or "none".
        """
        h = self.embed[token_ids]  # [T, d]
        out, hidden = self.run_layers(cache, h, start, skip, return_hidden)
        out_logits = None
        if logits != "none":
            out_logits = self.logits(out[-1:] if logits == "last" else out)
        return ForwardOutput(
            logits=out_logits,
            hidden_states=torch.cat([h[None], hidden]) if return_hidden else None,
        )

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
        wanted = check_logit_choices(blocks, logits)
        sizes = [block.token_ids.shape[0] for block in blocks]
        h = self.embed[torch.cat([block.token_ids for block in blocks]).to(self.device)]  # [M, d]
        h = self.run_layers_batch([(b.cache, b.start, n) for b, n in zip(blocks, sizes)], h, skip)
        return self.batch_logits(h, wanted, sizes)

    @torch.inference_mode()
    def run_layers_batch(
        self, spans: Sequence[tuple[KVCache, int, int]], h: torch.Tensor, skip: Collection[int] = ()
    ) -> torch.Tensor:
        """The packed residual stream [M, d] of several requests through every item not in `skip`;
        `spans` gives each request's (cache, start, rows) in the order of the rows."""
        offsets = [0, *itertools.accumulate(n for _, _, n in spans)]
        for cache, start, n in spans:
            cache.check_room(start + n)
        cos, sin = self._rotary_tables(max(start + n for _, start, n in spans))
        positions = torch.cat([torch.arange(start, start + n, device=self.device) for _, start, n in spans])
        cos, sin = cos[positions], sin[positions]  # [M, head_dim]: each row at its own request's position
        # Decode and verify rows of requests in one KV pool: one attention for all of them.
        pooled, own = pooled_rows(spans, FUSED_ATTENTION_MIN_TOKENS)
        every_row_pooled = pooled is not None and not own
        masks = {j: block_mask(spans[j][2], spans[j][1], self.device) for j in own}
        # Each request's rows through the kernel they would take alone (packed weights: by its own rows).
        ranges = kernel_ranges([n for _, _, n in spans], KERNEL_MAX_ROWS) if self.lm_head.packed else None
        for i, layer in enumerate(self.layers):
            attn_item, mlp_item = items.layer_items(i)
            if attn_item not in skip:
                q, k, v = (x[0] for x in self._qkv(layer, h, 1, h.shape[0], cos, sin, ranges))  # [M, heads, head_dim]
                if every_row_pooled:
                    out = self._attend_pooled(i, q, k, v, pooled, True)
                elif pooled is None and len(own) == 1:
                    out = self._attend_span(i, q, k, v, spans[0], 0, masks[0])
                else:  # every request's rows written into one tensor: no concatenation of a prefill chunk
                    out = q.new_empty(h.shape[0], q.shape[1] * q.shape[2])
                    if pooled is not None:
                        out[pooled.rows] = self._attend_pooled(i, q, k, v, pooled, False)
                    for j in own:
                        self._attend_span(i, q, k, v, spans[j], offsets[j], masks[j], out[offsets[j] : offsets[j + 1]])
                h = h + self._reduced(self._linear(layer.o, out, ranges))
            if mlp_item not in skip:
                h = h + self._mlp(layer, h, ranges)
        return h

    @torch.inference_mode()
    def attend(self, index: int, q, k, v, cache: KVCache, start: int) -> torch.Tensor:
        """Layer `index`'s attention alone for queries, keys, values [T, heads, head_dim] at
        [start, start + T) (the benchmark's step breakdown times it apart from the linears)."""
        return self._attend(index, q, k, v, cache, start, block_mask(q.shape[0], start, self.device))

    def _attend_span(
        self, index: int, q, k, v, span: tuple[KVCache, int, int], offset: int, mask, out=None
    ) -> torch.Tensor:
        cache, start, n = span
        rows = slice(offset, offset + n)
        return self._attend(index, q[rows], k[rows], v[rows], cache, start, mask, out)

    def _attend_pooled(self, index: int, q, k, v, pooled: PooledRows, every_row: bool) -> torch.Tensor:
        """The pooled rows' keys/values into their slots, then attention over runs of the slots."""
        if not every_row:
            q, k, v = q[pooled.rows], k[pooled.rows], v[pooled.rows]
        pool = pooled.pool
        pool.keys[index][pooled.slots, :, pooled.positions] = k
        pool.values[index][pooled.slots, :, pooled.positions] = v
        return pooled_attention(q * self._scale, pooled, index, self.spec.num_kv_heads, self._kernel)

    def batch_logits(self, h: torch.Tensor, wanted: Sequence[str], sizes: Sequence[int]) -> list[torch.Tensor | None]:
        """The LM head once over the packed rows [M, d] that need logits, split back per request."""
        rows = [n if choice == "all" else 1 for choice, n in zip(wanted, sizes) if choice != "none"]
        packed = all(n <= KERNEL_MAX_ROWS for n in rows)  # the kernel each request's rows get alone
        return packed_logits(lambda x: self.logits(x, packed), h, wanted, sizes)

    @torch.inference_mode()
    def run_layers(
        self,
        cache: KVCache,
        h: torch.Tensor,
        start: int,
        skip: Collection[int] = (),
        return_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream [T, d] of tokens at [start, start + T) through every item not in
        `skip`; with `return_hidden`, also the stream after each item [num_items, T, d]."""
        num_tokens = h.shape[0]
        end = start + num_tokens
        cache.check_room(end)
        cos, sin = self._rotary_tables(end)
        cos, sin = cos[start:end], sin[start:end]  # [T, head_dim]
        mask = block_mask(num_tokens, start, self.device)
        hidden = [] if return_hidden else None
        for i, layer in enumerate(self.layers):
            attn_item, mlp_item = items.layer_items(i)
            if attn_item not in skip:
                h = h + self._attention(layer, i, h, cache, start, cos, sin, mask)
            if return_hidden:
                hidden.append(h)
            if mlp_item not in skip:
                h = h + self._mlp(layer, h)
            if return_hidden:
                hidden.append(h)
        return h, torch.stack(hidden) if return_hidden else None

    def logits(self, h: torch.Tensor, packed: bool | None = None) -> torch.Tensor:
        """Final norm and LM head: residual stream [rows, d] -> float32 logits [rows, V]."""
        return self.lm_head(self._rms_norm(h, self.final_norm), packed).float()

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[token_ids]

    @torch.inference_mode()
    def run_item(self, item: int, h: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """The residual stream [T, d] after one item, for tokens at [start, start + T).

        An attention item writes its keys/values into `cache` (profiling times items one at a time with it).
        """
        layer_index, is_mlp = items.split_item(item)
        layer = self.layers[layer_index]
        if is_mlp:
            return h + self._mlp(layer, h)
        end = start + h.shape[0]
        cache.check_room(end)
        cos, sin = self._rotary_tables(end)
        mask = block_mask(h.shape[0], start, self.device)
        return h + self._attention(layer, layer_index, h, cache, start, cos[start:end], sin[start:end], mask)

    @torch.inference_mode()
    def run_item_branches(self, item: int, h: torch.Tensor, cache: KVCache, prefix_len: int) -> torch.Tensor:
        """One item on B branches of the same r tokens at positions [prefix_len, prefix_len + r).

        h: [B, r, d]. Each branch's tokens attend to the committed cache below
        `prefix_len` (shared) and causally to their own keys/values, computed from
        that branch's hidden states. The cache is only read: the DP explores draft
        models without disturbing the request.
        """
        num_branches, num_tokens, d = h.shape
        layer_index, is_mlp = items.split_item(item)
        layer = self.layers[layer_index]
        flat = h.reshape(num_branches * num_tokens, d)
        if is_mlp:
            return (flat + self._mlp(layer, flat)).view_as(h)
        end = prefix_len + num_tokens
        cos, sin = self._rotary_tables(end)
        q, k, v = self._qkv(layer, flat, num_branches, num_tokens, cos[prefix_len:end], sin[prefix_len:end])
        prefix_k, prefix_v = cache.view(layer_index, prefix_len)  # [kv_heads, p, head_dim]
        # [kv_heads, B, r, head_dim]: each branch's own keys and values
        own_k, own_v = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
        qg = group_queries(q * self._scale, self.spec.num_kv_heads)
        out = grouped_attention(qg, prefix_k, prefix_v, own_k, own_v, later_in_block(num_tokens, h.device))
        return (flat + self._reduced(layer.o(ungroup(out)))).view_as(h)

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
        return rms_norm(x, weight, self.spec.rms_norm_eps)

    def _mlp(self, layer: LayerWeights, h: torch.Tensor, ranges=None) -> torch.Tensor:
        gate_up = self._linear(layer.gate_up, self._rms_norm(h, layer.post_norm), ranges)
        return self._reduced(self._linear(layer.down, silu_mul(gate_up, self._kernel), ranges))

    @staticmethod
    def _linear(linear: Linear, x: torch.Tensor, ranges: list[tuple[int, int, bool]] | None) -> torch.Tensor:
        """`linear` over packed rows, each range with its kernel (packing.kernel_ranges)."""
        if ranges is None:
            return linear(x)
        if len(ranges) == 1:
            return linear(x, ranges[0][2])
        out = x.new_empty(x.shape[0], linear.out_features)
        for a, e, packed in ranges:
            linear(x[a:e], packed, out[a:e])
        return out

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)

    def _qkv(
        self,
        layer: LayerWeights,
        h: torch.Tensor,
        num_branches: int,
        num_tokens: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ranges: list[tuple[int, int, bool]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows h [B * T, d] -> rotated queries [B, T, H, head_dim], keys and values [B, T, kv_heads, head_dim]."""
        s = self.spec
        qkv = self._linear(layer.qkv, self._rms_norm(h, layer.input_norm), ranges)
        heads = s.num_heads + s.num_kv_heads
        v = qkv[:, heads * s.head_dim :].view(num_branches, num_tokens, s.num_kv_heads, s.head_dim)
        qk = qkv[:, : heads * s.head_dim].view(num_branches, num_tokens, heads, s.head_dim)
        if layer.q_norm is None:
            # Queries and keys lie side by side: one rotation for both.
            qk = apply_rotary(qk, cos, sin)
            return qk[:, :, : s.num_heads], qk[:, :, s.num_heads :], v
        q = apply_rotary(self._rms_norm(qk[:, :, : s.num_heads], layer.q_norm), cos, sin)
        return q, apply_rotary(self._rms_norm(qk[:, :, s.num_heads :], layer.k_norm), cos, sin), v

    def _attention(
        self,
        layer: LayerWeights,
        index: int,
        h: torch.Tensor,
        cache: KVCache,
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of tokens at [start, start + T) after writing their keys/values into the cache;
        `mask` is the block's (block_mask), built once per forward."""
        q, k, v = self._qkv(layer, h, 1, h.shape[0], cos, sin)
        return self._reduced(layer.o(self._attend(index, q[0], k[0], v[0], cache, start, mask)))

    def _attend(self, index: int, q, k, v, cache: KVCache, start: int, mask, out=None) -> torch.Tensor:
        """One request's queries, keys and values [T, heads, head_dim] at [start, start + T): the
        keys and values into its cache, then attention over it -> [T, H * head_dim] (into `out`);
        the kernel's up to the kernel linears' rows, so that a long verify stays row-exact."""
        num_tokens, end = q.shape[0], start + q.shape[0]
        cache.write(index, start, k.transpose(0, 1), v.transpose(0, 1))
        if num_tokens >= FUSED_ATTENTION_MIN_TOKENS and not (self._kernel and num_tokens <= KERNEL_MAX_ROWS):
            return fused_attention(q, *cache.view(index, end), start, mask, self._scale, out)
        if self._kernel:
            result = kernel_attention(q * self._scale, *cache.view(index, end), start, self.spec.num_kv_heads)
        else:
            keys, values = cache.view(index, aligned_keys(end, cache.capacity, q.device))  # [kv_heads, n, head_dim]
            result = matmul_attention(q * self._scale, keys, values, start, mask, self.spec.num_kv_heads)
        return result if out is None else out.copy_(result)
