"""Captured steps (pipeline/model/graphs) on a CPU, where they run eagerly over the same
static buffers and pieces a GPU captures: the buckets and their padding, the pieces a skip
set replays and in what order, a step's results against the eager forward's, padding that
leaves the requests' slots alone, a later step that only rewrites the buffers, and a batch
decoded through them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.model import short_attention
from pipeline.model.flex import flex_available
from pipeline.model.graphs import Granularity, GraphSettings
from pipeline.model.graphs.buckets import Bucket, BucketGrid, chunk_ladder, key_ladder, request_ladder
from pipeline.model.graphs.pieces import PieceCache, item_runs, pieces_of
from pipeline.model.linear import fp16w_available
from pipeline.model.packing import RequestRows
from tests.builders import batch_through_captured_steps, load_tiny, repeating_prompt
from tests.host_sync import HostSyncCheck

MODES = ["fp32", "bf16", pytest.param("fp16w", marks=pytest.mark.skipif(not fp16w_available(), reason="FBGEMM"))]


def test_ladders():
    assert request_ladder(1) == (1,)
    assert request_ladder(3) == (1, 2, 3)
    assert request_ladder(5) == (1, 2, 4, 5)
    assert request_ladder(6) == (1, 2, 4, 6)
    assert request_ladder(32) == (1, 2, 4, 8, 16, 24, 32)
    assert request_ladder(20) == (1, 2, 4, 8, 16, 20)
    assert key_ladder(200) == (200,)
    assert key_ladder(4104) == (512, 1024, 2048, 4096, 4104)
    assert key_ladder(1024) == (512, 1024)
    with pytest.raises(ConfigError):
        request_ladder(0)


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    grid = BucketGrid.for_pool(32, [1, 3, 5], 4104)
    assert grid.bucket_for(1, 1, 10) == Bucket(1, 1, 512)
    assert grid.bucket_for(3, 2, 513) == Bucket(4, 3, 1024)
    assert grid.bucket_for(9, 5, 4100) == Bucket(16, 5, 4104)
    assert grid.bucket_for(32, 1, 4104) == Bucket(32, 1, 4104)
    assert grid.bucket_for(33, 1, 10) is None  # more requests than the pool has slots
    assert grid.bucket_for(1, 6, 10) is None  # a wider verification than any bucket
    assert grid.bucket_for(1, 1, 4105) is None
    assert len(grid) == 7 * 3 * 5
    with pytest.raises(ConfigError, match="ascending"):
        BucketGrid((1, 2), (3, 1), (8,))


def test_a_prompt_chunk_takes_the_smallest_chunk_bucket_that_holds_it():
    assert chunk_ladder(4096) == (128, 256, 512, 1024, 2048, 4096)
    assert chunk_ladder(100) == ()
    grid = BucketGrid.for_pool(4, [1, 3], 1000, prefill_chunk=512)
    assert grid.chunks == (128, 256, 512) and grid.chunk_keys == (512, 1000)
    assert grid.chunk_for(10, 20) == Bucket(1, 128, 512, gathered=True, chunk=True)
    assert grid.chunk_for(300, 700) == Bucket(1, 512, 1000, gathered=True, chunk=True)
    assert grid.chunk_for(513, 600) is None  # longer than the prefill chunk
    assert grid.chunk_for(100, 1001) is None
    assert grid.largest_chunk == Bucket(1, 512, 1000, True, True)
    assert len(grid) == 3 * 2 * 2 + 3 * 2
    one_key = BucketGrid.for_pool(4, [1, 3], 1000, one_key_bucket=True, prefill_chunk=512)
    assert one_key.keys == (1000,) and one_key.chunk_keys == (512, 1000)  # a chunk's slot is gathered: its ladder
    assert BucketGrid.for_pool(4, [1], 1000).chunks == ()  # no prefill chunk given: no chunk buckets


def test_a_skip_set_replays_its_runs_of_items():
    assert item_runs(8, ()) == [(0, 8)]
    assert item_runs(8, {2, 3}) == [(0, 2), (4, 8)]
    assert item_runs(8, {0, 7}) == [(1, 7)]
    assert item_runs(4, {0, 1, 2, 3}) == []
    assert pieces_of(6, {2}, Granularity.RUNS) == [((0, 2),), ((3, 6),)]
    assert pieces_of(6, {2}, Granularity.ITEMS) == [((0, 1),), ((1, 2),), ((3, 4),), ((4, 5),), ((5, 6),)]
    assert pieces_of(6, {2}, Granularity.PLANS) == [((0, 2), (3, 6))]
    assert pieces_of(2, {0, 1}, Granularity.PLANS) == []


def test_pieces_are_captured_once_and_replayed_in_plan_order():
    ran, captured = [], []

    def capture(piece):  # as a CUDA graph's capture: the step's own run, then replays
        captured.append(piece)
        piece()
        return piece

    cache = PieceCache(capture, max_pieces=3)
    for plan in ([(0, 4)], [(0, 1), (2, 4)], [(0, 4)], [(0, 1), (2, 4)]):
        for first, end in plan:
            cache.run((first, end), lambda f=first, e=end: lambda: ran.append((f, e)))
    assert ran == [(0, 4), (0, 1), (2, 4), (0, 4), (0, 1), (2, 4)]
    assert cache.captures == len(captured) == 3
    cache.run("other", lambda: lambda: ran.append("other"))  # past max_pieces: the least recently used goes
    assert len(cache) == 3 and (0, 4) not in cache and (0, 1) in cache


def pooled_caches(model, lengths=(40, 70, 100), capacity=200, slots=(0, 1, 2), num_slots=4):
    """Requests prefilled in the given slots of a new pool, in that order."""
    pool = model.new_pool(num_slots, capacity)
    held = [pool.acquire(capacity) for _ in range(num_slots)]
    caches = [held[slot] for slot in slots]
    for cache in held:
        if cache.slot not in slots:
            pool.release(cache)
    for seed, (cache, n) in enumerate(zip(caches, lengths)):
        model.prefill(cache, repeating_prompt(n, seed))
        cache.commit(n)
    return caches


def blocks_of(caches, rows):
    return [RequestRows(c, list(range(5, 5 + n)), c.length) for c, n in zip(caches, rows)]


# Requests in slots below the bucket's request count are read in place; one past it (slot 5 of
# three requests) makes the step gather its slots.
LAYOUTS = {"in place": (0, 1, 2), "out of order": (2, 0, 1), "gathered": (5, 0, 2)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_captured_step_gives_the_eager_forwards_logits(tiny_checkpoint, mode, layout):
    """Decode and verify steps (padded: three requests in a bucket of four, rows to three), the
    full model and drafts' sub-networks, against the same forward run eagerly."""
    _, model = load_tiny(tiny_checkpoint, mode)
    slots = LAYOUTS[layout]
    eager = pooled_caches(model, slots=slots, num_slots=6)  # a pool without a scratch position: the eager route
    model.use_graphs(GraphSettings(capture="eager"))
    captured = pooled_caches(model, slots=slots, num_slots=6)
    graphs = None
    for skip in [(), (2, 3), (1,), (0, 1, 2)]:
        for rows in ([1, 1, 1], [3, 1, 2]):
            expected = model.run_blocks(blocks_of(eager, rows), skip, "all")[0]
            got = model.forward_batch(blocks_of(captured, rows), skip, "all")
            graphs = captured[0].pool.graphs
            tolerance = 1e-5 if mode == "fp32" else 5e-2
            for e, g in zip(expected, got):
                assert g.shape == e.shape
                torch.testing.assert_close(g, e, atol=tolerance * float(e.abs().max()), rtol=0)
    assert sum(graphs.steps_run.values()) == 8
    gathered = layout == "gathered"
    assert set(graphs.steps_run) == {Bucket(4, 1, 200, gathered), Bucket(4, 3, 200, gathered)}


@pytest.mark.parametrize(
    ("granularity", "pieces"),
    # One bucket: the embedding and the head, then the pieces of the skip sets (), (2, 3), (1,) of
    # the 8 items — runs [0, 8), [0, 2), [4, 8), [0, 1), [2, 8); each of the 8 items; one per plan.
    [(Granularity.RUNS, 2 + 5), (Granularity.ITEMS, 2 + 8), (Granularity.PLANS, 2 + 3)],
)
def test_every_granularity_replays_the_same_step(tiny_llama, granularity, pieces):
    _, model = load_tiny(tiny_llama)
    eager = pooled_caches(model)
    model.use_graphs(GraphSettings(capture="eager", granularity=granularity))
    captured = pooled_caches(model)
    for _ in range(2):  # the second time, every piece replays
        for skip in [(), (2, 3), (1,)]:
            expected = model.run_blocks(blocks_of(eager, [2, 1, 2]), skip, "all")[0]
            got = model.forward_batch(blocks_of(captured, [2, 1, 2]), skip, "all")
            for e, g in zip(expected, got):
                torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
    graphs = captured[0].pool.graphs
    assert graphs.pieces.captures == len(graphs.pieces) == pieces


def test_padding_writes_only_the_scratch_position(tiny_llama):
    _, model = load_tiny(tiny_llama)
    model.use_graphs(GraphSettings(capture="eager"))
    caches = pooled_caches(model)
    pool = caches[0].pool
    assert pool.slot_capacity == 200 and pool.keys.shape[3] == 201 and pool.scratch_position == 200
    before_keys, before_values = pool.keys.clone(), pool.values.clone()
    rows = [3, 1, 2]  # in a bucket of 4 requests of 3 rows: 6 padding rows
    model.forward_batch(blocks_of(caches, rows), (), "last")
    changed = (pool.keys != before_keys).any(-1) | (pool.values != before_values).any(-1)  # [L, slots, kv, pos]
    touched = changed.any(0).any(1)  # [slots, positions]
    for cache, n in zip(caches, rows):
        expected = set(range(cache.length, cache.length + n)) | ({pool.scratch_position} if cache.slot == 0 else set())
        assert set(touched[cache.slot].nonzero().flatten().tolist()) == expected
    assert touched[0, pool.scratch_position] and not touched[3].any()  # slot 3 is free


def test_a_dropped_pool_frees_its_memory_and_its_steps_without_a_garbage_collection(tiny_llama):
    """The pool owns its captured steps, which refer to it weakly: its last reference gone, the
    pool, its steps and their buffers go at once (a GPU check makes and drops pools of tens of
    GiB, and capturing a graph no longer collects cycles)."""
    _, model = load_tiny(tiny_llama)
    model.use_graphs(GraphSettings(capture="eager"))
    caches = pooled_caches(model)
    model.forward_batch(blocks_of(caches, [1, 3, 2]), {2}, "last")  # a draft's pieces and a verify's
    pool = caches[0].pool
    graphs = pool.graphs
    assert graphs is not None and graphs.pool is pool and len(graphs.pieces) > 0
    dropped = [weakref.ref(pool), weakref.ref(graphs), weakref.ref(pool.keys), weakref.ref(graphs.buffers.metadata)]
    del graphs
    gc.disable()
    try:
        for cache in caches:
            model.release(cache)
        del pool, caches, cache
        assert [ref() for ref in dropped] == [None] * len(dropped)
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_a_later_step_replays_over_the_rewritten_buffers_without_the_host(tiny_llama, mode, monkeypatch):
    """Once a bucket's pieces are captured, a step with other tokens, positions and skip set of
    the same bucket captures nothing new, and its pieces read nothing back from the host (as the
    GPU runs them: no CPU kernels)."""
    monkeypatch.setattr(short_attention, "_enabled", False)
    monkeypatch.setattr(short_attention, "linear_kernel", lambda: None)
    _, model = load_tiny(tiny_llama, mode)
    eager = pooled_caches(model)
    model.use_graphs(GraphSettings(capture="eager"))
    captured = pooled_caches(model)
    model.forward_batch(blocks_of(captured, [1, 1, 1]), (2,), "all")
    model.forward_batch(blocks_of(eager, [1, 1, 1]), (2,), "all")
    graphs = captured[0].pool.graphs
    captures = graphs.pieces.captures
    for cache in eager + captured:
        cache.advance(1)

    def replaying(piece_cache_run):
        def run(key, make):
            assert key in graphs.pieces, f"piece {key} was not captured"
            with HostSyncCheck():
                piece_cache_run(key, make)

        return run

    monkeypatch.setattr(graphs.pieces, "run", replaying(graphs.pieces.run))
    got = model.forward_batch([RequestRows(c, [9], c.length) for c in captured], (2,), "all")
    expected = model.forward_batch([RequestRows(c, [9], c.length) for c in eager], (2,), "all")
    assert graphs.pieces.captures == captures
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-5 if mode == "fp32" else 5e-2 * float(e.abs().max()), rtol=0)


@pytest.mark.exactness
@pytest.mark.parametrize("mode", MODES)
def test_a_batch_decoded_through_captured_steps_equals_each_request_alone(tiny_checkpoint, mode):
    """Mixed prompts, limits and drafters (copies, a fixed skip set, KnapSpec) in a continuous
    batch whose decode, verify and draft steps run as captured steps, against each request
    decoded alone eagerly: greedy tokens as the mode promises."""
    _, model = load_tiny(tiny_checkpoint, mode)
    graphs = batch_through_captured_steps(model, GraphSettings(capture="eager"))
    assert graphs is not None and sum(graphs.steps_run.values()) > 10
    assert any(bucket.rows > 1 for bucket in graphs.steps_run), "verification steps must run captured"
    assert any(bucket.chunk for bucket in graphs.steps_run), "prompt chunks must run captured"


CHUNK_ROUTES = [
    ("fp32", "matmul"),
    ("bf16", "matmul"),
    pytest.param("fp16w", "matmul", marks=pytest.mark.skipif(not fp16w_available(), reason="FBGEMM")),
    pytest.param("fp32", "flex", marks=pytest.mark.skipif(not flex_available(), reason="no FlexAttention")),
]


@pytest.mark.parametrize(("mode", "attention"), CHUNK_ROUTES)
def test_a_prompt_chunk_runs_as_its_buckets_step_alone_and_beside_decode_rows(tiny_checkpoint, mode, attention):
    """A prompt of 300 tokens after 20 already in slot 2, in chunks of 200, 56 and 44 rows (padded
    to buckets of 256 rows — two blocks of queries for FlexAttention — and 128), the second
    beside two requests' decode rows: the last chunk's logits, the decode rows' and the keys and
    values the chunks leave in the slot, against the eager forward's. Each chunk is a captured
    step of its own bucket."""
    _, model = load_tiny(tiny_checkpoint, mode)
    lengths, capacity = (40, 70, 20), 400
    eager = pooled_caches(model, lengths, capacity)
    model.use_graphs(GraphSettings(capture="eager", attention=attention))
    captured = pooled_caches(model, lengths, capacity)
    prompt = repeating_prompt(300, 7)[:300].tolist()

    def steps(caches):
        chunk = lambda a, e, logits: RequestRows(caches[2], prompt[a:e], 20 + a, logits)
        decode = [RequestRows(c, [9], c.length, "all") for c in caches[:2]]
        run = model.forward_batch if caches is captured else lambda blocks: model.run_blocks(blocks, (), "all")[0]
        out = [run([chunk(0, 200, "none")]), run([*decode, chunk(200, 256, "none")]), run([chunk(256, 300, "last")])]
        return out[1][:2] + out[2]

    expected, got = steps(eager), steps(captured)
    tolerance = 1e-5 if mode == "fp32" else 5e-2
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, atol=tolerance * float(e.abs().max()), rtol=0)
    for tensors in ("keys", "values"):
        e, g = (getattr(c[2].pool, tensors)[:, 2, :, : 20 + 300] for c in (eager, captured))
        torch.testing.assert_close(g, e, atol=tolerance * float(e.abs().max()), rtol=0)
    graphs = captured[0].pool.graphs
    chunks = [Bucket(1, rows, capacity, gathered=True, chunk=True) for rows in (256, 128)]
    assert graphs.steps_run == {chunks[0]: 1, chunks[1]: 2, Bucket(2, 1, capacity): 1}


@pytest.mark.skipif(not flex_available(), reason="PyTorch without FlexAttention")
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_flex_attention_reads_each_requests_own_keys_as_the_matmuls_do(tiny_llama, mode):
    """The GPU's route (FlexAttention, compiled here by Inductor for the CPU): requests in slots
    0 and 2 of a pool of four (the idle place 1 reads one block), one bucket of keys, against the
    eager forward; two steps of the same bucket at lengths 128 keys apart (one more block read)."""
    _, model = load_tiny(tiny_llama, mode)
    lengths, slots = (40, 170), (0, 2)
    eager = pooled_caches(model, lengths, capacity=400, slots=slots)
    model.use_graphs(GraphSettings(capture="eager", attention="flex"))
    captured = pooled_caches(model, lengths, capacity=400, slots=slots)
    for step in range(2):
        expected = model.run_blocks(blocks_of(eager, [2, 2]), (), "all")[0]
        got = model.forward_batch(blocks_of(captured, [2, 2]), (), "all")
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, atol=(1e-5 if mode == "fp32" else 5e-2) * float(e.abs().max()), rtol=0)
        for cache in eager + captured:
            cache.commit(cache.length + 128 * step + 2)
    graphs = captured[0].pool.graphs
    assert graphs.flex and set(graphs.steps_run) == {Bucket(4, 2, 400)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_decode_a_batch_as_each_request_alone(tiny_llama):
    """On a GPU: captured CUDA graphs (FlexAttention, fused element-wise work), a continuous batch
    with copies, skip sets and KnapSpec, against each request decoded alone eagerly, in fp32."""
    from pipeline.model import checkpoint
    from pipeline.model.linear import ComputeMode
    from pipeline.model.loading import model_from_tensors

    config = checkpoint.load_config(tiny_llama)
    model = model_from_tensors(config, checkpoint.read_tensors(tiny_llama), ComputeMode.FP32, "cuda")
    graphs = batch_through_captured_steps(model, GraphSettings(capture="cuda"))
    assert graphs.flex and graphs.pieces.captures > 0 and sum(graphs.steps_run.values()) > 10
