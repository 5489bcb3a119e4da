"""A step's forward runs from device-side data: its metadata reaches the device in one copy,
and from there nothing in it waits on the host (tests/host_sync.py); two consecutive steps of
one bucket run the same operations on the same shapes (what a captured or compiled step
needs); and the step compiles whole, giving the eager step's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pipeline.model import short_attention
from pipeline.model.linear import fp16w_available
from tests.builders import load_tiny
from tests.host_sync import HostSyncCheck, HostSyncError

MODES = ["fp32", "bf16", pytest.param("fp16w", marks=pytest.mark.skipif(not fp16w_available(), reason="FBGEMM"))]


def ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed))


def mixed_batch(model):
    """Three requests in slots of one pool and one with a cache of its own, at lengths whose next
    two steps stay inside one key bucket (layers.KEY_BUCKET)."""
    pool = model.new_pool(4, 160)
    caches = [pool.acquire(160) for _ in range(3)] + [model.new_cache(160)]
    for seed, (cache, length) in enumerate(zip(caches, [40, 70, 100, 55])):
        model.prefill(cache, ids(seed, length))
        cache.commit(length)
    return caches


# The forwards of a step: decode (one row each), verify (1 + γ rows, mixed), a draft position
# (one row each, a sub-network, the last row's logits).
STEPS = {
    "decode": ([1, 1, 1, 1], (), "all"),
    "verify": ([1, 4, 3, 4], (), "all"),
    "draft": ([1, 1, 1, 1], (1, 2), "last"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(STEPS))
def test_a_steps_forward_never_waits_on_the_host_and_repeats_its_trace(tiny_llama, mode, kind, monkeypatch):
    _, model = load_tiny(tiny_llama, mode)
    caches = mixed_batch(model)
    rows_per_request, skip, logits = STEPS[kind]
    copies = []
    send = model.staging.send
    monkeypatch.setattr(model.staging, "send", lambda parts: copies.append(len(parts)) or send(parts))
    traces = []
    for step in range(2):
        token_ids = [ids(10 * step + i, n).tolist() for i, n in enumerate(rows_per_request)]
        spans = [(cache, cache.length, n) for cache, n in zip(caches, rows_per_request)]
        rows = model.rows(spans, token_ids, [logits] * len(caches))
        check = HostSyncCheck()
        with torch.inference_mode(), check:
            out, _ = model.run_step(rows, skip)
        traces.append(check.trace)
        # The same forward as the batch's usual entry point, which also packs its rows.
        expected = model.forward_batch(
            [_rows(cache, ids_, cache.length) for cache, ids_ in zip(caches, token_ids)], skip, logits
        )
        for got, want in zip(out, expected):
            assert torch.equal(got, want)
        for cache in caches:
            cache.advance(1)
    assert copies[0] == copies[2] and len(copies) == 4  # one copy per forward, whatever it carries
    assert len(traces[0]) > 50 and traces[0] == traces[1]


def _rows(cache, token_ids, start):
    from pipeline.model.packing import RequestRows

    return RequestRows(cache, torch.tensor(token_ids), start)


def test_the_check_catches_what_would_stall_a_gpu():
    x = torch.arange(6.0)
    for stall in (lambda: x.sum().item(), lambda: x[x > 2], lambda: torch.tensor([1, 2]), lambda: x.nonzero()):
        with pytest.raises(HostSyncError), HostSyncCheck():
            stall()
    with HostSyncCheck() as check:
        x[x.long()[:2]] = x[3:5] * 2  # an index made on the device: fine
    assert check.trace


# Tracing alone (aot_eager: the graph as AOTAutograd functionalizes it, cache writes included)
# in both modes; and Inductor's code in bf16, a GPU's mode (a few minutes of compiling on 2 cores).
@pytest.mark.parametrize("mode, backend", [("fp32", "aot_eager"), ("bf16", "aot_eager"), ("bf16", "inductor")])
def test_the_step_compiles_whole_and_decodes_as_eager(tiny_llama, mode, backend, monkeypatch):
    """As a GPU runs it (no CPU kernels: PyTorch's linears, norms and attention), the forward of
    a decode step over pooled and unpooled requests compiles with fullgraph=True — a graph break
    would raise — and gives the eager step's greedy tokens."""
    monkeypatch.setattr(short_attention, "_enabled", False)
    monkeypatch.setattr(short_attention, "linear_kernel", lambda: None)
    _, model = load_tiny(tiny_llama, mode)
    assert not model.lm_head.packed and model.attention_route == short_attention.MATMUL_ROUTE

    def decode(step) -> list[list[int]]:
        caches = mixed_batch(model)
        tokens = [[5], [6], [7], [8]]
        for _ in range(3):
            spans = [(cache, cache.length, 1) for cache in caches]
            rows = model.rows(spans, [[t[-1]] for t in tokens], ["all"] * len(caches))
            with torch.no_grad():
                out = step(rows)
            for t, cache, logits in zip(tokens, caches, out):
                t.append(int(logits[0].argmax()))
                cache.advance(1)
        return tokens

    def step(rows):
        return model.run_step(rows)[0]

    eager = decode(step)
    torch._dynamo.reset()
    compiled = decode(torch.compile(step, fullgraph=True, dynamic=True, backend=backend))
    torch._dynamo.reset()
    assert compiled == eager
