"""What verifying costs: one forward of k tokens against one token's, and the parts of it (every
linear alone, every layer's attention alone); and one batched forward in which every request
verifies r rows, with the accepted tokens that would repay a batch its drafts."""

from __future__ import annotations

import statistics
import time

import torch

from pipeline.decoding.loop import prefill
from pipeline.engine import Engine
from pipeline.model.packing import RequestRows

VERIFY_SIZES = (1, 2, 4, 8, 11)
# Rows each request of a batch verifies (1 + its drafted tokens) in the batch's verify cost.
BATCH_VERIFY_ROWS = (1, 2, 3, 5)
TARGET_BATCH_SPEEDUP = 1.3  # what the batch verify table asks of a draft


def batch_verify_costs(engine: Engine, prompts: list[torch.Tensor], prefilled: list, rounds: int = 7) -> dict:
    """Median seconds of one batched forward in which every request verifies r rows (r - 1 drafted
    tokens), for each r in BATCH_VERIFY_ROWS, over copies of the prefilled caches in one KV pool as
    a replica holds them: what drafting costs a batch, which its accepted tokens must repay. Row
    counts alternate their order from round to round so that noise hits them alike."""
    model = engine.model
    pool = model.new_pool(len(prefilled), max(f.cache.capacity for f in prefilled))
    caches = [pool.adopt(f.cache) for f in prefilled]
    seconds: dict[int, list[float]] = {r: [] for r in BATCH_VERIFY_ROWS}
    for round_ in range(rounds + 1):  # the first round warms up
        for r in BATCH_VERIFY_ROWS if round_ % 2 else BATCH_VERIFY_ROWS[::-1]:
            blocks = [RequestRows(c, p[-r:].clone(), c.length) for c, p in zip(caches, prompts)]
            started = time.perf_counter()
            model.forward_batch(blocks, logits="all")
            if round_:
                seconds[r].append(time.perf_counter() - started)
    for cache in caches:
        pool.release(cache)
    return {r: statistics.median(v) for r, v in seconds.items()}


def batch_verify_row(doc_id: str, context_tokens: int, size: int, costs: dict[int, float]) -> dict:
    """One row of the batch verify table. With d drafted tokens a request must add a(d) accepted
    tokens per step for the batch to gain TARGET_BATCH_SPEEDUP: (1 + a) / (cost(1 + d) / cost(1)) >= it."""
    ratios = {r: costs[r] / costs[1] for r in BATCH_VERIFY_ROWS}
    return {
        "doc_id": doc_id,
        "context_tokens": context_tokens,
        "batch_size": size,
        "step_1_s": costs[1],
        **{f"rows_{r}_over_1": ratios[r] for r in BATCH_VERIFY_ROWS[1:]},
        **{f"accepted_needed_{r - 1}": TARGET_BATCH_SPEEDUP * ratios[r] - 1 for r in BATCH_VERIFY_ROWS[1:]},
    }


def verify_costs(engine: Engine, prompt_ids: torch.Tensor, rounds: int = 9) -> dict:
    """Median seconds of one full forward of k tokens after the prompt (a verify of k - 1
    drafts), for each k in VERIFY_SIZES, and of its parts for k = 1 and 4: every linear with
    the LM head alone, and every layer's attention alone over the prompt's cache. Sizes and
    parts alternate within each round so that noise hits them alike."""
    model = engine.model
    cache = prefill(model, prompt_ids, max(VERIFY_SIZES)).cache
    s = model.spec
    jobs = {
        ("forward", k): lambda k=k: model.forward(cache, prompt_ids[-k:].clone(), cache.length) for k in VERIFY_SIZES
    }
    for k in (1, 4):
        x = torch.randn(k, s.hidden_size, dtype=model.dtype)
        heads = torch.randn(k, s.num_heads * s.head_dim, dtype=model.dtype)
        inner = torch.randn(k, s.intermediate_size, dtype=model.dtype)
        q = torch.randn(k, s.num_heads, s.head_dim, dtype=model.dtype)
        kv = torch.randn(k, s.num_kv_heads, s.head_dim, dtype=model.dtype)

        def linears(x=x, heads=heads, inner=inner) -> None:
            with torch.inference_mode():
                for layer in model.layers:
                    layer.qkv(x), layer.o(heads), layer.gate_up(x), layer.down(inner)
                model.lm_head(x)

        def attention(q=q[None], kv=kv[None], k=k) -> None:
            with torch.inference_mode():
                rows = model.rows([(cache, cache.length, k)]).attention
                for i in range(s.num_layers):
                    model.attention(i, q, kv, kv, rows)

        jobs[("linears", k)], jobs[("attention", k)] = linears, attention
    times: dict = {key: [] for key in jobs}
    for round_ in range(rounds + 1):
        for key, job in jobs.items():
            t0 = time.perf_counter()
            job()
            if round_:  # the first round warms up
                times[key].append(time.perf_counter() - t0)
    median = {key: statistics.median(v) for key, v in times.items()}
    costs: dict = {k: median[("forward", k)] for k in VERIFY_SIZES}
    costs["parts"] = {f"{part}_{k}_s": median[(part, k)] for part in ("linears", "attention") for k in (1, 4)}
    return costs


def verify_row(doc_id: str, context_tokens: int, dtype: str, costs: dict) -> dict:
    """One row of the verify cost table, from `verify_costs`: k tokens against one, and one
    token's step against its linears and attention alone."""
    parts = costs["parts"]
    floor = parts["linears_1_s"] + parts["attention_1_s"]
    return (
        {
            "doc_id": doc_id,
            "context_tokens": context_tokens,
            "dtype": dtype,
            "t_forward_1_s": costs[1],
        }
        | {f"verify_{k}_over_1": costs[k] / costs[1] for k in VERIFY_SIZES[1:]}
        | parts
        | {
            "linears_4_over_1": parts["linears_4_s"] / parts["linears_1_s"],
            "attention_4_over_1": parts["attention_4_s"] / parts["attention_1_s"],
            # The step against what its linears and attention alone cost; the rest is the
            # elementwise work and the Python per item.
            "step_over_linears_and_attention": costs[1] / floor,
            "other_1_s": costs[1] - floor,
        }
    )
