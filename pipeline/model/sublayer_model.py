"""A decoder run as 2L items (sublayers), any subset of them, over its own KV cache.

Item 2i is layer i's attention (input norm -> self-attention -> residual add) and
item 2i+1 its MLP (post-attention norm -> MLP -> residual add). A skipped item is
the identity on the residual stream (KnapSpec, Sec. 3), so a draft model is just
the set of items to skip. One sequence per call: offline summarization runs one
request per forward, and its KV cache has no batch dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError
from pipeline.knapspec.knapsack import Frontier, KnapsackProblem, branch_runner, run_dp
from pipeline.model.kv_cache import KVCache
from pipeline.model.linear import ComputeMode, Linear
from pipeline.model.spec import ModelSpec, sliding_window_of

# Longer query blocks (prefill chunks) go through PyTorch's fused attention; short
# ones (decode, verify) through a GQA-aware product that never repeats K/V heads.
FUSED_ATTENTION_MIN_TOKENS = 16
# Prefill chunks are as long as this many floats of MLP activations allow: long chunks
# waste less attention work on masked-out blocks and run larger matmuls.
PREFILL_ACTIVATION_BUDGET = 16 * 2**20
MIN_PREFILL_CHUNK, MAX_PREFILL_CHUNK = 512, 4096


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    qkv: Linear  # d -> (H + 2 * kv_heads) * head_dim
    o: Linear  # H * head_dim -> d
    q_norm: torch.Tensor | None  # [head_dim], Qwen3 only
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # [d]
    gate_up: Linear  # d -> 2 * intermediate
    down: Linear  # intermediate -> d


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
        self._cos = torch.empty(0, spec.head_dim, device=device)
        self._sin = torch.empty(0, spec.head_dim, device=device)
        self._scale = spec.head_dim**-0.5
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

        def get(name: str) -> torch.Tensor:
            try:
                return tensors[name].to(device=device, dtype=torch.float32)
            except KeyError:
                raise ConfigError(f"checkpoint is missing tensor {name!r}") from None

        def norm(name: str) -> torch.Tensor:
            return get(name).to(mode.activation_dtype)

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if spec.attention_bias else None
            o_name = p + "self_attn.o_proj.bias"
            o_b = get(o_name) if o_name in tensors else None
            layers.append(
                LayerWeights(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=Linear(qkv_w, qkv_b, mode),
                    o=Linear(get(p + "self_attn.o_proj.weight"), o_b, mode),
                    q_norm=norm(p + "self_attn.q_norm.weight") if spec.qk_norm else None,
                    k_norm=norm(p + "self_attn.k_norm.weight") if spec.qk_norm else None,
                    post_norm=norm(p + "post_attention_layernorm.weight"),
                    gate_up=Linear(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]), None, mode),
                    down=Linear(get(p + "mlp.down_proj.weight"), None, mode),
                )
            )
        embed = get("model.embed_tokens.weight")
        if spec.tie_word_embeddings:
            lm_head = Linear(embed, None, mode)
        elif "lm_head.weight" in tensors:
            lm_head = Linear(get("lm_head.weight"), None, mode)
        else:
            raise ConfigError("checkpoint has no lm_head.weight and does not tie it to the embeddings")
        return cls(
            spec=spec,
            layers=layers,
            embed=embed.to(mode.activation_dtype),
            final_norm=norm("model.norm.weight"),
            lm_head=lm_head,
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

    def _rotary_tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if end > self._cos.shape[0]:
            size = min(max(end, 2 * self._cos.shape[0], 1024), max(end, self.max_context))
            positions = torch.arange(size, device=self.device)[None]
            probe = torch.empty(0, dtype=torch.float32, device=self.device)
            cos, sin = self.rotary(probe, positions)
            self._cos, self._sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [size, head_dim]
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
        mask = _attention_mask(num_tokens, start, self.device)
        hidden = [] if return_hidden else None
        for i, layer in enumerate(self.layers):
            if 2 * i not in skip:
                h = h + self._attention(layer, i, h, cache, start, cos, sin, mask)
            if return_hidden:
                hidden.append(h)
            if 2 * i + 1 not in skip:
                h = h + self._mlp(layer, h)
            if return_hidden:
                hidden.append(h)
        return h, torch.stack(hidden) if return_hidden else None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: residual stream [rows, d] -> float32 logits [rows, V]."""
        return self.lm_head(self._rms_norm(h, self.final_norm)).float()

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[token_ids]

    @torch.inference_mode()
    def run_item(self, item: int, h: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """The residual stream [T, d] after one item, for tokens at [start, start + T).

        An attention item writes its keys/values into `cache` (profiling times items one at a time with it).
        """
        layer_index, is_mlp = divmod(item, 2)
        layer = self.layers[layer_index]
        if is_mlp:
            return h + self._mlp(layer, h)
        end = start + h.shape[0]
        cache.check_room(end)
        cos, sin = self._rotary_tables(end)
        mask = _attention_mask(h.shape[0], start, self.device)
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
        layer_index, is_mlp = divmod(item, 2)
        layer = self.layers[layer_index]
        flat = h.reshape(num_branches * num_tokens, d)
        if is_mlp:
            return (flat + self._mlp(layer, flat)).view_as(h)
        s = self.spec
        end = prefix_len + num_tokens
        cos, sin = self._rotary_tables(end)
        qkv = layer.qkv(self._rms_norm(flat, layer.input_norm))
        q, k, v = qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim], -1)
        q = q.reshape(num_branches, num_tokens, s.num_heads, s.head_dim)
        k = k.reshape(num_branches, num_tokens, s.num_kv_heads, s.head_dim)
        v = v.reshape(num_branches, num_tokens, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q = self._rms_norm(q, layer.q_norm)
            k = self._rms_norm(k, layer.k_norm)
        cos, sin = cos[prefix_len:end], sin[prefix_len:end]  # [r, head_dim], broadcast over branches
        q = _apply_rotary(q, cos, sin) * self._scale
        k = _apply_rotary(k, cos, sin)
        groups = s.num_query_groups
        # As in _grouped_attention, query head h reads KV head h // groups.
        qg = q.view(num_branches, num_tokens, s.num_kv_heads, groups, s.head_dim).permute(2, 0, 3, 1, 4)
        # qg: [kv_heads, B, groups, r, head_dim]
        prefix_k, prefix_v = cache.view(layer_index, prefix_len)  # [kv_heads, p, head_dim]
        scores_prefix = torch.matmul(
            qg.reshape(s.num_kv_heads, -1, s.head_dim), prefix_k.transpose(1, 2)
        ).view(s.num_kv_heads, num_branches, groups, num_tokens, prefix_len)
        own_k = k.permute(2, 0, 3, 1)  # [kv_heads, B, head_dim, r]
        own_v = v.permute(2, 0, 1, 3)  # [kv_heads, B, r, head_dim]
        scores_own = torch.matmul(qg, own_k[:, :, None])  # [kv_heads, B, groups, r, r]
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=h.device).triu(1)
        scores_own = scores_own.masked_fill(causal, float("-inf"))
        probs = torch.softmax(torch.cat([scores_prefix, scores_own], dim=-1).float(), dim=-1).to(h.dtype)
        out = torch.matmul(
            probs[..., :prefix_len].reshape(s.num_kv_heads, -1, prefix_len), prefix_v
        ).view(s.num_kv_heads, num_branches, groups, num_tokens, s.head_dim)
        out = out + torch.matmul(probs[..., prefix_len:], own_v[:, :, None])
        # -> [B, r, heads * head_dim] with heads ordered (kv_head, group)
        out = out.permute(1, 3, 0, 2, 4).reshape(num_branches * num_tokens, s.num_heads * s.head_dim)
        return (flat + self._reduced(layer.o(out))).view_as(h)

    @torch.inference_mode()
    def run_knapsack(
        self, cache: KVCache, token_ids: torch.Tensor, problem: KnapsackProblem, prefix_len: int, layer_rows: bool = False
    ) -> Frontier:
        """The knapsack DP on reference tokens [r] at positions [prefix_len, prefix_len + r) (the
        cache is only read); rows are items, or layers when `layer_rows`. Returns the last row."""
        run = branch_runner(lambda item, h: self.run_item_branches(item, h, cache, prefix_len), layer_rows)
        return run_dp(self.embed_tokens(token_ids), problem, run)

    @property
    def prefill_chunk(self) -> int:
        return prefill_chunk_for(self.spec)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, token_ids: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        """Fill the cache with a prompt from position `cache.length`; returns the last position's logits [V]."""
        return prefill_in_chunks(self, cache, token_ids, chunk_size or self.prefill_chunk)

    # -------------------------------------------------------------- sublayers

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As Hugging Face's LlamaRMSNorm: normalize in fp32, scale in the compute dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _mlp(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(self._rms_norm(h, layer.post_norm)).chunk(2, dim=-1)
        return self._reduced(layer.down(F.silu(gate) * up))

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)

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
        s = self.spec
        num_tokens = h.shape[0]
        qkv = layer.qkv(self._rms_norm(h, layer.input_norm))
        q, k, v = qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim], -1)
        q = q.view(num_tokens, s.num_heads, s.head_dim)
        k = k.view(num_tokens, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q = self._rms_norm(q, layer.q_norm)
            k = self._rms_norm(k, layer.k_norm)
        q = _apply_rotary(q, cos, sin)
        k = _apply_rotary(k, cos, sin)
        v = v.view(num_tokens, s.num_kv_heads, s.head_dim)
        cache.write(index, start, k.transpose(0, 1), v.transpose(0, 1))
        keys, values = cache.view(index, start + num_tokens)  # [kv_heads, n, head_dim]
        if num_tokens >= FUSED_ATTENTION_MIN_TOKENS:
            out = self._fused_attention(q, keys, values, start, mask)
        else:
            out = self._grouped_attention(q, keys, values, start, mask)
        return self._reduced(layer.o(out))

    def _fused_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=start == 0,
            scale=self._scale,
            enable_gqa=True,
        )  # [1, H, T, head_dim]
        return out[0].transpose(0, 1).reshape(num_tokens, -1)

    def _grouped_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # Query head h reads KV head h // groups; folding the groups into the query rows
        # turns attention into two batched matmuls over the cache as it lies in memory.
        s = self.spec
        num_tokens = q.shape[0]
        groups = s.num_query_groups
        qg = (q * self._scale).view(num_tokens, s.num_kv_heads, groups, s.head_dim)
        qg = qg.permute(1, 2, 0, 3).reshape(s.num_kv_heads, groups * num_tokens, s.head_dim)
        scores = torch.bmm(qg, keys.transpose(1, 2))  # [kv_heads, groups * T, n]
        if mask is not None:
            scores.view(s.num_kv_heads, groups, num_tokens, -1)[..., start:].masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.bmm(probs, values)  # [kv_heads, groups * T, head_dim]
        return out.view(s.num_kv_heads, groups, num_tokens, s.head_dim).permute(2, 0, 1, 3).reshape(num_tokens, -1)


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


def _attention_mask(num_tokens: int, start: int, device: torch.device) -> torch.Tensor | None:
    """The mask a block of queries at [start, start + T) needs, built once per forward.

    Fused attention (long blocks): None for the first block (is_causal does it), else
    [T, start + T] True where attending is allowed. Grouped attention (short blocks):
    [T, T] True where a query must not see a later token of its own block.
    """
    if num_tokens >= FUSED_ATTENTION_MIN_TOKENS:
        if start == 0:
            return None
        positions = torch.arange(start + num_tokens, device=device)
        return positions[None, :] <= (start + torch.arange(num_tokens, device=device))[:, None]
    if num_tokens == 1:
        return None
    return torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).triu(1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, head_dim] as Hugging Face applies it (rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
