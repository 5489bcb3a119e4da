"""The layer math of a Llama-style decoder: RMSNorm, rotary embedding, the masks a block
of queries needs, and attention — pure functions over tensors, as Hugging Face computes
them, so that fp32 outputs match transformers token for token.

Attention has two forms. A long block of queries (a prefill chunk) goes through PyTorch's
fused `scaled_dot_product_attention`. A short one — a decode step, a verification, the
knapsack DP's branches — goes through `grouped_attention`: each KV head's query group is
folded into the rows of batched matmuls over the keys as they lie in memory, so K/V heads
are never repeated, and one function serves the committed cache alone (decode, verify)
and the cache plus each branch's own tokens (the DP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.model.short_attention import long_attention, long_attention_applies, short_attention, silu_mul_rows

# Longer query blocks (prefill chunks) go through PyTorch's fused attention; short
# ones (decode, verify) through the grouped product that never repeats K/V heads.
FUSED_ATTENTION_MIN_TOKENS = 16

# A short block's attention through the matmuls reads its keys in buckets of this many (the
# extra ones masked): consecutive steps of a request then have the same shapes, so one compiled
# or captured step serves a whole bucket, and on CUDA the scores' rows stay multiples of 16
# bytes, without which cuBLAS takes a much slower half-precision kernel (with one key more every
# decode step, every other step would: docs/results/gpu_check-h200.md). The fused CPU kernel
# reads each row's keys to its own limit, whatever width it is handed.
KEY_BUCKET = 32


def aligned_keys(num_keys: int, capacity: int) -> int:
    """How many keys a short block that sees `num_keys` reads: rounded up to `KEY_BUCKET`, within `capacity`."""
    return min(-(-num_keys // KEY_BUCKET) * KEY_BUCKET, capacity)


def unseen_keys(positions: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width], True where a query at `positions` [T] (a device tensor) must not look: keys
    past its own position, its block's later ones and what a bucket reads past them alike."""
    return torch.arange(width, device=positions.device) > positions[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As Hugging Face's LlamaRMSNorm: normalize in fp32, scale in the compute dtype.
    if x.dtype == torch.float32:
        # The same operations in the same order, dispatched once from C++: a decode step runs
        # 61 norms of one row, where each Python-level operation costs as much as its math.
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_mul(gate_up: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of an MLP's fused [rows, 2 * I] gate and up -> [rows, I]. `kernel`: through
    the CPU kernel build (silu_mul_rows), where a row's bits are its own whatever shares the call."""
    if kernel:
        return silu_mul_rows(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sine table [..., head_dim] with its first half negated, the form apply_rotary takes."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., T, heads, head_dim], bit for bit as Hugging Face applies it.

    cos and `signed_sin(sin)` come as [T, 1, head_dim]. Hugging Face adds rotate_half(x) * sin,
    where rotate_half(x) = (-x2, x1); rolling x by half a head gives (x2, x1), and negating
    the sine's first half instead of x2 rounds the same (negation is exact), in four operations
    instead of nine.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


def block_mask(num_tokens: int, start: int, device: torch.device) -> torch.Tensor | None:
    """The mask a long block of queries at [start, start + T) needs for fused attention, built
    once per forward: None for the first block (is_causal does it), else [T, start + T], True
    where attending is allowed."""
    if start == 0:
        return None
    positions = torch.arange(start + num_tokens, device=device)
    return positions[None, :] <= (start + torch.arange(num_tokens, device=device))[:, None]


def later_in_block(num_tokens: int, device: torch.device) -> torch.Tensor | None:
    """[T, T], True where a query must not see a later token of its own block; None when T = 1."""
    if num_tokens == 1:
        return None
    return torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).triu(1)


def fused_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: torch.Tensor | None,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, head_dim] at positions [start, start + T) over keys/values [kv_heads, start + T, head_dim]
    -> [T, H * head_dim], into `out` where given (a batch's rows: one copy instead of two)."""
    num_tokens = q.shape[0]
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=start == 0,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, T, head_dim]
    if out is None:
        return attended[0].transpose(0, 1).reshape(num_tokens, -1)
    out.view(num_tokens, *q.shape[1:]).copy_(attended[0].transpose(0, 1))
    return out


# PyTorch's flash kernels that return their log-sum-exp, by device (split_attention).
_FLASH_WITH_LSE = {"cpu": "_scaled_dot_product_flash_attention_for_cpu", "cuda": "_scaled_dot_product_flash_attention"}


def split_attention_available(device: torch.device | str = "cpu") -> bool:
    """Whether PyTorch has the flash kernel split_attention needs on `device`'s type."""
    name = _FLASH_WITH_LSE.get(torch.device(device).type)
    return name is not None and hasattr(torch.ops.aten, name)


def _flash(q, k, v, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, L, E], log-sum-exp [B, H, L]) of PyTorch's flash kernel on q's device."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=is_causal, scale=scale)
        return out, lse
    result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return result[0], result[1]


def split_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    scale: float,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """fused_attention's long block in `dtype` (bf16; on a GPU, bf16 or fp16) without a mask:
    q [T, H, head_dim] at positions [start, start + T) over keys/values [kv_heads, start + T, head_dim].

    A chunk after the first sees every key before it and its own causally. With a boolean mask
    PyTorch's flash kernel computes all start + T columns of every row; here the keys before the
    block go in one call, each KV head's query groups folded into its rows (no mask, K/V never
    repeated), the block's own keys in a causal one, and the two are merged by their
    log-sum-exps (0.5x the masked call's time at 4k + 4k). Returns [T, H * head_dim] in q's
    dtype, into `out` where given.

    On a CPU with AVX512-BF16 and no AMX, bf16 blocks take our kernel instead (one causal call,
    short_attention.long_attention: PyTorch's flash kernel runs bf16 at its fp32 speed there);
    `use_kernel` forces the choice (None: short_attention.long_attention_applies).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[0]
    groups = num_heads // num_kv_heads
    heads_first = q.transpose(0, 1).to(dtype)  # [H, T, head_dim]
    if use_kernel is None:
        use_kernel = q.device.type == "cpu" and dtype == torch.bfloat16 and long_attention_applies(head_dim)
    if use_kernel:
        kv = (x.to(dtype) for x in (keys, values))
        result = long_attention(heads_first, *kv, start, scale, out)
        return result if out is not None else result.to(q.dtype)
    own_k, own_v = (x[None, :, start:].to(dtype).repeat_interleave(groups, 1) for x in (keys, values))
    if start == 0:
        attended = _flash(heads_first[None], own_k, own_v, True, scale)[0][0]
    else:
        folded = heads_first.reshape(1, num_kv_heads, groups * num_tokens, head_dim)
        earlier = (x[None, :, :start].to(dtype) for x in (keys, values))
        before, lse_before = _flash(folded, *earlier, False, scale)
        own, lse_own = _flash(heads_first[None], own_k, own_v, True, scale)
        # softmax over both key sets = each part's softmax weighted by its share of the total mass
        share = torch.sigmoid(lse_before.reshape(num_heads, num_tokens) - lse_own[0])[..., None]
        own = own[0].float()
        attended = own + (before.reshape(num_heads, num_tokens, head_dim).float() - own) * share
    if out is None:
        out = q.new_empty(num_tokens, num_heads * head_dim)
    out.view(num_tokens, num_heads, head_dim).copy_(attended.transpose(0, 1))  # one pass: layout and dtype
    return out


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Queries [B, T, H, head_dim] -> [kv_heads, B, groups, T, head_dim]: query head h reads KV head h // groups."""
    num_branches, num_tokens, num_heads, head_dim = q.shape
    groups = num_heads // num_kv_heads
    return q.view(num_branches, num_tokens, num_kv_heads, groups, head_dim).permute(2, 0, 3, 1, 4)


def ungroup(out: torch.Tensor) -> torch.Tensor:
    """[kv_heads, B, groups, T, head_dim] -> [B * T, H * head_dim], heads ordered (kv_head, group)."""
    num_kv_heads, num_branches, groups, num_tokens, head_dim = out.shape
    return out.permute(1, 3, 0, 2, 4).reshape(num_branches * num_tokens, num_kv_heads * groups * head_dim)


def grouped_attention(
    qg: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    own_keys: torch.Tensor | None = None,
    own_values: torch.Tensor | None = None,
    later: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of T query rows per branch, causal within the block.

    qg: [kv_heads, B, groups, T, head_dim], already scaled. keys/values [kv_heads, n, head_dim]
    are read by every branch. Without `own_*` the block's own keys are the last T of `keys`
    (decode and verify: the block was written into the cache first); with them
    ([kv_heads, B, T, head_dim]) each branch attends to the shared keys and causally to its
    own (the DP: the cache is only read). `later` (later_in_block) hides each query's later
    tokens of its block; the caller builds it once per forward. `hidden` ([T, n], unseen_keys)
    instead masks the whole width, for keys read past the block (aligned_keys). Returns
    [kv_heads, B, groups, T, head_dim].
    """
    num_kv_heads, num_branches, groups, num_tokens, head_dim = qg.shape
    rows = qg.reshape(num_kv_heads, num_branches * groups * num_tokens, head_dim)
    num_shared = keys.shape[1]
    scores = torch.bmm(rows, keys.transpose(1, 2)).view(num_kv_heads, num_branches, groups, num_tokens, num_shared)
    if own_keys is not None:
        own_scores = torch.matmul(qg, own_keys.transpose(-1, -2)[:, :, None])  # [kv_heads, B, groups, T, T]
        scores = torch.cat([scores, own_scores], dim=-1)
    if later is not None:
        scores[..., -num_tokens:].masked_fill_(later, float("-inf"))
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    probs = softmax(scores, values.dtype)
    if own_values is None:
        out = torch.bmm(probs.view(num_kv_heads, -1, num_shared), values)
        return out.view(num_kv_heads, num_branches, groups, num_tokens, head_dim)
    shared_probs = probs[..., :num_shared].reshape(num_kv_heads, -1, num_shared)
    out = torch.bmm(shared_probs, values).view(num_kv_heads, num_branches, groups, num_tokens, head_dim)
    return out + torch.matmul(probs[..., num_shared:], own_values[:, :, None])


def matmul_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, num_kv_heads: int
) -> torch.Tensor:
    """grouped_attention's decode and verify case: q [T, H, head_dim], already scaled, over
    keys/values [kv_heads, n, head_dim] (the block's own written first; n a bucket's width,
    aligned_keys), `hidden` [T, n] (unseen_keys) masked -> [T, H * head_dim]."""
    return ungroup(grouped_attention(group_queries(q[None], num_kv_heads), keys, values, hidden=hidden))


def softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dimension in fp32, returned in `dtype` (as Hugging Face's eager attention)."""
    if scores.dtype == torch.float32 and dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.float(), dim=-1).to(dtype)


def kernel_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, num_kv_heads: int
) -> torch.Tensor:
    """grouped_attention's decode and verify case through the fused CPU kernel: q [T, H, head_dim],
    already scaled, over keys/values [kv_heads, n, head_dim] (the block's own written first),
    query t seeing keys [0, seen[0, t]) (int32 [1, T]) -> [T, H * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    groups = num_heads // num_kv_heads
    rows = q.view(num_tokens, num_kv_heads, groups, head_dim).transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)
    out = short_attention(rows, keys, values, seen)  # [1, kv_heads, T * groups, head_dim]
    return out.view(num_kv_heads, num_tokens, groups, head_dim).transpose(0, 1).reshape(num_tokens, -1)


def pooled_attention(q: torch.Tensor, layout, layer: int, num_kv_heads: int, kernel: bool = False) -> torch.Tensor:
    """Attention of the short blocks of many requests at once, over their slots of one pool.

    q: [R, H, head_dim], already scaled, the rows of `layout` (packing.PooledRows), whose keys
    and values are already written into layer `layer` of its pool. Each run of neighbouring
    slots is one call over its own keys (KVPool.layer); each slot's queries are padded to
    `layout.block` rows, and key positions a query must not see (past its own, or past its
    request's) are masked. `kernel`: through the fused CPU kernel (short_attention), which
    gives each row the bits it gets alone. Returns [R, H * head_dim].
    """
    _, num_heads, head_dim = q.shape
    groups = num_heads // num_kv_heads
    block = layout.block
    padded = q[layout.padded]
    outs = []
    at = 0
    for run in layout.runs:
        num_slots, num_keys = run.end - run.first, run.num_keys
        keys, values = layout.pool.layer(layer, run.first, run.end)  # [slots * kv_heads, capacity, head_dim]
        part = padded[at : at + num_slots * block].view(num_slots, block, num_kv_heads, groups, head_dim)
        at += num_slots * block
        if kernel:
            rows = part.transpose(1, 2).reshape(num_slots, num_kv_heads, block * groups, head_dim)
            out = short_attention(rows, keys, values, run.seen)
            out = out.view(num_slots, num_kv_heads, block, groups, head_dim).transpose(1, 2)
            outs.append(out.reshape(num_slots * block, num_heads * head_dim))
            continue
        rows = part.permute(0, 2, 3, 1, 4).reshape(num_slots * num_kv_heads, groups * block, head_dim)
        scores = torch.bmm(rows, keys[:, :num_keys].transpose(1, 2))
        scores = scores.view(num_slots, num_kv_heads, groups, block, num_keys).masked_fill_(run.hidden, float("-inf"))
        probs = softmax(scores, values.dtype)
        out = torch.bmm(probs.view(num_slots * num_kv_heads, groups * block, num_keys), values[:, :num_keys])
        out = out.view(num_slots, num_kv_heads, groups, block, head_dim).permute(0, 3, 1, 2, 4)
        outs.append(out.reshape(num_slots * block, num_heads * head_dim))
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[layout.back]


def slot_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hidden: torch.Tensor,
    num_kv_heads: int,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of R requests' blocks of T rows each at once, every one over its own slot's
    keys: q [R * T, H, head_dim], already scaled; keys/values [R, kv_heads, W, head_dim] (each
    request's slot, its block written first); `hidden` [R, 1, 1, T, W], True where a row must
    not look. Fixed shapes whatever the requests' lengths (graphs.static_step). `seen` (int32
    [R, T], the keys each row sees): through the fused CPU kernel instead, which gives each row
    the bits it gets alone. Returns [R * T, H * head_dim]."""
    num_requests, _, width, head_dim = keys.shape
    num_heads = q.shape[1]
    groups, num_tokens = num_heads // num_kv_heads, q.shape[0] // num_requests
    if seen is not None:
        rows = q.view(num_requests, num_tokens, num_kv_heads, groups, head_dim).transpose(1, 2)
        rows = rows.reshape(num_requests, num_kv_heads, num_tokens * groups, head_dim)
        flat = (num_requests * num_kv_heads, width, head_dim)
        out = short_attention(rows, keys.view(flat), values.view(flat), seen)
        out = out.view(num_requests, num_kv_heads, num_tokens, groups, head_dim).transpose(1, 2)
        return out.reshape(num_requests * num_tokens, num_heads * head_dim)
    qg = q.view(num_requests, num_tokens, num_kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
    rows = qg.reshape(num_requests, num_kv_heads, groups * num_tokens, head_dim)
    scores = torch.matmul(rows, keys.transpose(-1, -2)).view(num_requests, num_kv_heads, groups, num_tokens, width)
    probs = softmax(scores.masked_fill_(hidden, float("-inf")), values.dtype)
    out = torch.matmul(probs.view(num_requests, num_kv_heads, groups * num_tokens, width), values)
    out = out.view(num_requests, num_kv_heads, groups, num_tokens, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_requests * num_tokens, num_heads * head_dim)
