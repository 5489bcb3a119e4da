"""What must hold on the device, whatever it costs: greedy tokens batched and captured as each
request's alone, and speculative sampling's law.

Both run a tiny random Llama in fp32 on the device, its weights scaled as the test models'
(projections at 1/√fan-in, the head and embeddings five times that): a confident model, whose
greedy choices sit far from ties. In fp32 a differing token is allowed only at a top-2 logit
gap within the mode's tie gap (pipeline/model/precision.py).
"""

from __future__ import annotations

import dataclasses

import torch

from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import LayerSkipDrafter
from pipeline.decoding.loop import DecodeConfig, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams, probabilities
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.model.graphs import GraphSettings
from pipeline.model.linear import ComputeMode
from pipeline.model.loading import model_from_tensors
from pipeline.model.precision import MAX_DRIFT, row_drift
from pipeline.model.spec import ModelSpec
from profiling.device_profile import shaped_tensors


def tiny_tensors(config, device: torch.device) -> dict:
    tensors = shaped_tensors(ModelSpec.from_hf_config(config), config.num_hidden_layers, device, seed=1)
    for name, tensor in tensors.items():  # shaped_tensors draws N(0, 0.02²)
        if name.endswith("proj.weight"):
            tensor.mul_(1.0 / tensor.shape[-1] ** 0.5 / 0.02)
        elif name in ("lm_head.weight", "model.embed_tokens.weight"):
            tensor.mul_(5.0 / tensor.shape[-1] ** 0.5 / 0.02)
    return tensors


def capture_kind(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "eager"


def graph_settings(device: torch.device, settings: GraphSettings | None = None) -> GraphSettings:
    """`settings` (the check's --attention and --unfused), capturing as `device` does."""
    return dataclasses.replace(settings or GraphSettings(), capture=capture_kind(device))


def _first_difference(got: list[int], alone: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, alone)) if a != b), min(len(got), len(alone)))


def greedy_equality(config, device: torch.device, settings: GraphSettings | None = None) -> dict:
    """Mixed requests (prompt lengths, limits, prompt-lookup drafts) in one continuous batch,
    eager and with captured steps, against each request decoded alone eagerly; captured against
    eager; and how far the device's bf16 kernels move a row's logits as the rows beside it change."""
    tensors = tiny_tensors(config, device)
    model = model_from_tensors(config, tensors, ComputeMode.FP32, device)
    generator = torch.Generator().manual_seed(3)
    phrase = torch.randint(3, config.vocab_size, (8,), generator=generator)
    prompts = [torch.cat([torch.randint(3, config.vocab_size, (n,), generator=generator), phrase, phrase]) for n in
               (30, 200, 75, 500, 12, 140)]  # fmt: skip
    limits = [40, 25, 60, 30, 50, 20]
    longest = max(p.numel() + m for p, m in zip(prompts, limits)) + 8
    alone = [decode(model, prefill(model, p, m), DecodeConfig(m), SamplingParams()).token_ids for p, m in
             zip(prompts, limits)]  # fmt: skip
    result: dict = {"requests": len(prompts), "failures": []}
    tokens = {}
    for path in ("eager", "graphs"):
        model.use_graphs(graph_settings(device, settings) if path == "graphs" else None)
        batcher = ContinuousBatcher(model, max_batch=4, slot_positions=longest)
        tickets = [
            batcher.submit(
                GenerationRequest(p, DecodeConfig(m), SamplingParams(), PromptLookupDrafter() if i % 2 else None)
            )
            for i, (p, m) in enumerate(zip(prompts, limits))
        ]
        finished = {done.ticket: done for done in batcher.run()}
        equal = near_ties = 0
        tokens[path] = []
        for ticket, prompt, reference in zip(tickets, prompts, alone):
            done = finished[ticket]
            if done.error is not None:
                result["failures"].append(f"{path}: request {ticket}: {done.error}")
                tokens[path].append(None)
                continue
            got = done.result.token_ids
            tokens[path].append(got)
            if got == reference:
                equal += 1
                continue
            first = _first_difference(got, reference)
            cache = model.new_cache(prompt.numel() + first + 1)
            logits = model.prefill(cache, torch.cat([prompt, torch.tensor(reference[:first])]).to(device))
            top2 = logits.topk(2).values
            gap, bound = float(top2[0] - top2[1]), model.exactness.tie_gap(logits)
            if gap < bound:
                near_ties += 1
            else:
                result["failures"].append(
                    f"{path}: request {ticket}: token {first} differs at a top-2 gap of {gap:.2e} (tie gap {bound:.2e})"
                )
        result[f"{path}_equal"], result[f"{path}_near_ties"] = equal, near_ties
        if path == "graphs":
            result["captured_steps"] = sum(batcher.pool.graphs.steps_run.values()) if batcher.pool.graphs else 0
    result["graphs_equal_eager"] = sum(a == b for a, b in zip(tokens["eager"], tokens["graphs"]))
    if result.get("captured_steps", 0) == 0:
        result["failures"].append("no step of the batch ran captured")
    bf16 = model_from_tensors(config, tensors, ComputeMode.BF16, device)
    drift = row_drift(bf16, prompts[1][:120], prompts[1][120:140].tolist(), (2, 5, 11))
    if drift > bf16.exactness.drift:
        result["failures"].append(
            f"bf16 logits drift {drift:.3g} of their largest, over the bound {bf16.exactness.drift:g}"
        )
    result.update(
        bf16_drift=drift, bf16_row_exact=bf16.exactness.row_exact, bf16_drift_bound=MAX_DRIFT[ComputeMode.BF16]
    )
    return result


def exact_law(model, prompt: torch.Tensor, params: SamplingParams) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) of plain sampling after `prompt`, every sequence of nonzero probability
    (from the distributions `params`' repetition control processes, where it has one)."""

    def dist(prefix: list[int]) -> torch.Tensor:
        cache = model.new_cache(prompt.numel() + 3)
        logits = model.prefill(cache, torch.tensor(prompt.tolist() + prefix, device=model.device))
        repetition = params.repetition(prompt.tolist())
        if repetition is not None:
            repetition.extend(prefix)
            logits = repetition.process_row(logits)
        return probabilities(logits, params).cpu()

    law = {}
    p1 = dist([])
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist([t1])
        for t2 in p2.nonzero().flatten().tolist():
            p3 = dist([t1, t2])
            for t3 in p3.nonzero().flatten().tolist():
                law[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return law


def chi_square(counts: dict, law: dict, num_samples: int) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of sampled sequences against their exact law,
    rare cells merged so that every expected count is at least 5."""
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for cell in sorted(law, key=law.get, reverse=True):
        e = law[cell] * num_samples
        if e >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(e)
        else:
            rest_o += counts.get(cell, 0)
            rest_e += e
    if rest_e > 0:
        # Fold the remainder into the smallest kept cell, so it too has an expected count >= 5.
        observed[-1] += rest_o
        expected[-1] += rest_e
    scale = sum(observed) / sum(expected)  # (the law sums to 1 only up to rounding)
    statistic = sum((o - e * scale) ** 2 / (e * scale) for o, e in zip(observed, expected))
    dof = max(len(observed) - 1, 1)
    # The χ² survival function: the regularized upper incomplete gamma Q(dof / 2, statistic / 2).
    half = torch.tensor([dof / 2, statistic / 2], dtype=torch.float64)
    p_value = float(torch.special.gammaincc(half[0], half[1]))
    return statistic, dof, p_value


def sampling_law(config, device: torch.device, num_samples: int, settings: GraphSettings | None = None) -> dict:
    """(t1, t2, t3) of one prompt sampled by `num_samples` requests of a continuous batch with
    captured steps, each with its own seed and a draft skipping items, against the exact law of
    plain sampling (χ²)."""
    model = model_from_tensors(config, tiny_tensors(config, device), ComputeMode.FP32, device)
    model.use_graphs(graph_settings(device, settings))
    prompt = torch.randint(3, config.vocab_size, (4,), generator=torch.Generator().manual_seed(5))
    base = {"temperature": 1.0, "top_k": 4}
    law = exact_law(model, prompt, SamplingParams(**base))
    batcher = ContinuousBatcher(model, max_batch=8, slot_positions=prompt.numel() + 8)
    num_items = model.spec.num_items
    for seed in range(num_samples):
        # (one MLP item of the tiny model's eight: about half its drafts accepted, both paths exercised)
        drafter = LayerSkipDrafter([3], num_items, max_draft=1 + seed % 2, confidence_threshold=0.0)
        batcher.submit(GenerationRequest(prompt, DecodeConfig(3), SamplingParams(**base, seed=seed), drafter))
    counts: dict = {}
    drafted = accepted = 0
    failures = []
    for done in batcher.run():
        if done.error is not None:
            failures.append(str(done.error))
            continue
        key = tuple(done.result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted += done.result.stats.drafted_tokens
        accepted += done.result.stats.accepted_tokens
    statistic, dof, p_value = chi_square(counts, law, sum(counts.values()))
    if set(counts) - set(law):
        failures.append("sampled a sequence the model gives zero probability")
    if not 0.05 < accepted / max(drafted, 1) < 0.95:
        failures.append(f"drafts were {accepted} of {drafted} accepted: acceptance and rejection must both occur")
    if p_value <= 1e-3:
        failures.append(f"speculative samples do not follow the model (p = {p_value:.2e})")
    return {
        "samples": sum(counts.values()), "cells": len(law), "chi_square": statistic, "dof": dof, "p_value": p_value,
        "acceptance": accepted / max(drafted, 1), "failures": failures[:5],
    }  # fmt: skip


@torch.inference_mode()
def attention_agreement(device: torch.device) -> dict:
    """The device's attention routes against their masked reference in bf16, random inputs: a
    prefill chunk after the first split at its start (flash kernels, no mask: layers.split_attention)
    against SDPA with a boolean mask, and a captured step's FlexAttention over slots read in
    place (flex.py) against the masked matmuls. Largest error relative to the reference's largest."""
    from pipeline.model.flex import SlotBlocks, flex_available, flex_slot_attention
    from pipeline.model.layers import block_mask, fused_attention, slot_attention, split_attention

    generator = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, head_dim, scale = 8, 2, 64, 64**-0.5
    result: dict = {"failures": []}

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(torch.bfloat16)

    def relative(got, expected) -> float:
        return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())

    start, rows = 384, 128
    q, keys, values = (
        rand(rows, heads, head_dim),
        rand(kv_heads, start + rows, head_dim),
        rand(kv_heads, start + rows, head_dim),
    )
    masked = fused_attention(q, keys, values, start, block_mask(rows, start, device), scale)
    result["split_vs_masked"] = relative(split_attention(q, keys, values, start, scale, torch.bfloat16), masked)
    if flex_available():
        requests, per, capacity = 3, 4, 640
        seen = torch.tensor([[300 + t for t in range(1, per + 1)], [1] * per, [600 + t for t in range(1, per + 1)]],
                            dtype=torch.int32, device=device)  # fmt: skip
        pool_k, pool_v = rand(requests, kv_heads, capacity, head_dim), rand(requests, kv_heads, capacity, head_dim)
        qs = rand(requests * per, heads, head_dim)
        blocks = SlotBlocks(seen, capacity)
        blocks.update()
        hidden = torch.arange(capacity, device=device) >= seen.view(requests, 1, 1, per, 1)
        reference = slot_attention(qs * scale, pool_k, pool_v, hidden, kv_heads)
        result["flex_vs_matmul"] = relative(flex_slot_attention(qs, pool_k, pool_v, blocks, scale), reference)
    for name in ("split_vs_masked", "flex_vs_matmul"):
        if result.get(name, 0.0) > 2e-2:  # bf16: a few units in the last place of the largest
            result["failures"].append(f"{name}: off by {result[name]:.2e} of the largest")
    return result
