"""One forward over the rows of several requests: each request's logits and cache as if it
ran alone. A batch of one is the single forward bit for bit. Inside a larger batch the
linears see more rows, and what that does is the mode's promise (pipeline/model/precision.py):
a row-exact model (fp16w, bf16 with the kernel build) gives every request its bits alone; an
fp32 model's kernels round a row differently with the row count, so its logits agree to float
tolerance and greedy tokens are equal unless its top-2 logits are within the mode's tie gap."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import ConfigError, KnapSpecError
from pipeline.model.linear import fp16w_available
from pipeline.model.packing import RequestRows
from tests.builders import load_tiny, sample_documents

pytestmark = pytest.mark.exactness

MODES = ["fp32", *(["fp16w", "fp16w-bf16"] if fp16w_available() else []), "bf16"]


def ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed))


def prefilled(model, prompt: torch.Tensor, room: int = 40):
    cache = model.new_cache(prompt.numel() + room)
    model.prefill(cache, prompt)
    return cache


def assert_as_promised(model, batched: torch.Tensor, alone: torch.Tensor, logits: bool = True) -> None:
    """Bit for bit where the model is row-exact; else within the mode's drift of the largest
    value, and (logits) equal top-1 tokens per row or, where they differ, a near-tie alone."""
    promise = model.exactness
    if promise.row_exact:
        assert torch.equal(batched, alone)
        return
    assert float((batched - alone).abs().max()) <= promise.drift * float(alone.abs().max())
    if not logits:
        return
    for row, (b, a) in enumerate(zip(batched, alone)):
        if int(b.argmax()) != int(a.argmax()):
            top2 = a.topk(2).values
            assert float(top2[0] - top2[1]) < promise.tie_gap(a), f"row {row}: a different token without a near-tie"


@pytest.mark.parametrize("num_rows", [1, 4, 20])  # decode, verify, a prefill chunk (fused attention)
def test_a_batch_of_one_is_the_single_forward_bit_for_bit(tiny_checkpoint, num_rows):
    _, model = load_tiny(tiny_checkpoint)
    alone, batched = prefilled(model, ids(1, 60)), prefilled(model, ids(1, 60))
    new = ids(2, num_rows)
    expected = model.forward(alone, new, alone.length, logits="all").logits
    (got,) = model.forward_batch([RequestRows(batched, new, batched.length)])
    assert torch.equal(got, expected)
    assert torch.equal(batched.keys, alone.keys) and torch.equal(batched.values, alone.values)


@pytest.mark.parametrize("mode", MODES)
def test_each_request_in_a_batch_gets_its_own_logits_and_cache(tiny_checkpoint, mode):
    _, model = load_tiny(tiny_checkpoint, mode)
    prompts = [ids(10, 37), ids(11, 90), ids(12, 150), ids(13, 1)]
    rows = [ids(20, 1), ids(21, 4), ids(22, 3), ids(23, 24)]  # decode, two verifies, a prefill chunk
    alone = [prefilled(model, p) for p in prompts]
    together = [prefilled(model, p) for p in prompts]
    expected = [model.forward(c, r, c.length, logits="all").logits for c, r in zip(alone, rows)]
    got = model.forward_batch([RequestRows(c, r, c.length) for c, r in zip(together, rows)])
    for g, e, a, t in zip(got, expected, alone, together):
        assert_as_promised(model, g, e)
        assert_as_promised(model, t.keys, a.keys, logits=False)
        assert_as_promised(model, t.values, a.values, logits=False)


@pytest.mark.parametrize("mode", MODES)
def test_requests_in_one_kv_pool_attend_together(tiny_checkpoint, mode):
    """Caches that are slots of one pool: their decode and verify rows go through one pooled
    attention (slots apart, a free slot between them, different lengths), a prefill chunk and a
    request with a cache of its own through their own; all as if each ran alone."""
    _, model = load_tiny(tiny_checkpoint, mode)
    prompts = [ids(10, 37), ids(11, 90), ids(12, 150), ids(13, 5), ids(14, 20)]
    rows = [ids(20, 1), ids(21, 4), ids(22, 3), ids(23, 24), ids(24, 2)]
    alone = [prefilled(model, p) for p in prompts]
    pool = model.new_pool(6, 192)
    placeholder = pool.acquire(10)
    together = [pool.adopt(prefilled(model, p)) for p in prompts[:4]] + [prefilled(model, prompts[4])]
    pool.release(placeholder)  # slot 0 is free: the pooled attention spans it anyway
    assert [c.slot for c in together[:4]] == [1, 2, 3, 4]
    expected = [model.forward(c, r, c.length, logits="all").logits for c, r in zip(alone, rows)]
    got = model.forward_batch([RequestRows(c, r, c.length) for c, r in zip(together, rows)])
    # 34 rows in all: in a row-exact mode each request's rows still take the kernel they take alone.
    for g, e, a, t, r in zip(got, expected, alone, together, rows):
        assert_as_promised(model, g, e)
        end = t.length + r.numel()
        assert_as_promised(model, t.keys[:, :, :end], a.keys[:, :, :end], logits=False)
        assert_as_promised(model, t.values[:, :, :end], a.values[:, :, :end], logits=False)


def test_keys_read_in_bucket_widths_are_masked(tiny_checkpoint):
    """Short blocks read their keys rounded up to a bucket (layers.KEY_BUCKET), alone and pooled;
    the keys past each query's position (stale ones here: large junk) are masked, so the logits
    are those of exactly the keys it sees."""
    import pipeline.model.layers as layers

    _, model = load_tiny(tiny_checkpoint)
    prompts = [ids(10, 37), ids(11, 90), ids(12, 45)]
    rows = [ids(20, 1), ids(21, 4), ids(22, 3)]
    alone = [prefilled(model, p) for p in prompts]
    expected = [model.forward(c, r, c.length, logits="all").logits for c, r in zip(alone, rows)]
    pool = model.new_pool(3, 136)
    together = [pool.adopt(prefilled(model, p)) for p in prompts]
    single = prefilled(model, prompts[1])
    for cache in [*together, single]:
        end = cache.length + 4
        cache.keys[:, :, end:] = 1e4  # junk past what any query sees
        cache.values[:, :, end:] = -1e4
    assert layers.KEY_BUCKET == 32 and layers.aligned_keys(94, 136) == 96 and layers.aligned_keys(130, 136) == 136
    got = model.forward_batch([RequestRows(c, r, c.length) for c, r in zip(together, rows)])
    got_single = model.forward(single, rows[1], single.length, logits="all").logits
    for g, e in zip([*got, got_single], [*expected, expected[1]]):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_idle_slots_far_apart_split_the_pooled_attention(tiny_llama):
    """Requests in slots 0, 1, 5 and 7 of a pool: the three idle slots between 1 and 5 would read
    ~300 keys each, so the attention is two calls, slots 0-1 and 5-7 (the one idle slot 6 kept:
    cheaper than a third call), each over its own longest context; all as if each ran alone,
    in whatever order the batch has them."""
    from pipeline.model.packing import slot_runs
    from tests.builders import pooled_rows

    assert slot_runs([(0, 300), (1, 40), (5, 280), (7, 30)], 512) == [(0, 2, 300), (5, 8, 280)]
    assert slot_runs([(2, 10), (9, 10)], 512) == [(2, 10, 10)]  # 7 idle slots of 10 keys: one call
    _, model = load_tiny(tiny_llama)
    lengths = {0: 300, 1: 40, 5: 280, 7: 30}
    rows = {0: ids(30, 1), 1: ids(31, 4), 5: ids(35, 1), 7: ids(37, 3)}
    pool = model.new_pool(8, 320)
    together, placeholders = {}, []
    for slot in range(8):
        if slot in lengths:
            together[slot] = pool.adopt(prefilled(model, ids(slot, lengths[slot]), room=8))
        else:
            placeholders.append(pool.acquire(10))
    for placeholder in placeholders:
        pool.release(placeholder)
    assert [c.slot for c in together.values()] == list(lengths)
    order = [7, 1, 5, 0]  # the batch's rows in another order than their slots
    blocks = [RequestRows(together[slot], rows[slot], together[slot].length) for slot in order]
    layout, own = pooled_rows([(b.cache, b.start, b.token_ids.numel()) for b in blocks], 16)
    # Each run reads its longest context's keys, in a bucket of 32 (301 -> 320, 281 -> 288).
    assert not own and [(r.first, r.end, r.num_keys) for r in layout.runs] == [(0, 2, 320), (5, 8, 288)]
    got = model.forward_batch(blocks)
    for g, slot in zip(got, order):
        alone = prefilled(model, ids(slot, lengths[slot]), room=8)
        expected = model.forward(alone, rows[slot], alone.length, logits="all").logits
        assert_as_promised(model, g, expected)


def test_each_block_takes_the_kernel_it_takes_alone():
    from pipeline.model.packing import kernel_ranges

    assert kernel_ranges([1, 4, 3], 32) == [(0, 8, True)]
    assert kernel_ranges([5, 40, 2, 3, 33], 32) == [(0, 5, True), (5, 45, False), (45, 50, True), (50, 83, False)]


@pytest.mark.skipif(not fp16w_available(), reason="needs FBGEMM")
def test_many_verify_rows_keep_the_fp16w_kernel(tiny_llama):
    """Twelve requests verifying four tokens each: 48 rows, more than fp16w runs through its fp16
    kernel at once, yet each request's rows are computed as they are alone."""
    _, model = load_tiny(tiny_llama, "fp16w")
    prompts = [ids(50 + i, 20 + 7 * i) for i in range(12)]
    rows = [ids(70 + i, 4) for i in range(12)]
    alone = [prefilled(model, p) for p in prompts]
    pool = model.new_pool(12, 144)
    together = [pool.adopt(prefilled(model, p)) for p in prompts]
    expected = [model.forward(c, r, c.length).logits for c, r in zip(alone, rows)]
    got = model.forward_batch([RequestRows(c, r, c.length) for c, r in zip(together, rows)])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(not fp16w_available(), reason="needs FBGEMM")
@pytest.mark.parametrize("mode", ["fp16w", "fp16w-bf16"])
def test_a_prefill_chunk_beside_decode_rows_is_computed_bit_for_bit_as_alone(tiny_llama, mode):
    """A mixed step: decode and verify rows (fp16w's fp16 kernel) around a prefill chunk of 40
    rows (its fp32 copy; bf16 products and attention in fp16w-bf16), which wants its last row's
    logits as in a batcher's step. Each range's linears write into one output tensor; every
    request's logits and keys are its own alone, bit for bit."""
    _, model = load_tiny(tiny_llama, mode)
    prompts = [ids(80, 30), ids(81, 1), ids(82, 45)]
    rows = [ids(90, 1), ids(91, 40), ids(92, 4)]
    wanted = ["all", "last", "all"]
    alone = [prefilled(model, p, room=48) for p in prompts]
    together = [prefilled(model, p, room=48) for p in prompts]
    expected = [model.forward(c, r, c.length, logits=w).logits for c, r, w in zip(alone, rows, wanted)]
    got = model.forward_batch([RequestRows(c, r, c.length, logits=w) for c, r, w in zip(together, rows, wanted)])
    for g, e, a, t in zip(got, expected, alone, together):
        assert torch.equal(g, e)
        assert torch.equal(t.keys, a.keys) and torch.equal(t.values, a.values)


def test_a_linear_writes_into_a_given_tensor_with_the_same_bits():
    from pipeline.model.linear import ComputeMode, Linear

    generator = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(48, 32, generator=generator), torch.randn(48, generator=generator)
    for mode in MODES:
        x = torch.randn(45, 32, generator=generator).to(ComputeMode(mode).activation_dtype)
        for b in (None, bias):
            linear = Linear(weight, b, ComputeMode(mode))
            for packed in (True, False) if linear.packed else (None,):
                out = torch.full((50, 48), float("nan"), dtype=x.dtype)
                linear(x[5:], packed, out[3:43])
                assert torch.equal(out[3:43], linear(x[5:].clone(), packed))
                assert out[:3].isnan().all() and out[43:].isnan().all()


def test_a_pooled_slot_is_a_cache(tiny_llama):
    _, model = load_tiny(tiny_llama)
    pool = model.new_pool(2, 16)
    addresses = pool.keys.data_ptr(), pool.values.data_ptr()
    with pytest.raises(ConfigError, match="does not fit the pool's slots of 16"):
        pool.acquire(17)  # a pool never grows
    first, second = pool.acquire(16), pool.acquire(12)
    assert (first.slot, second.slot, second.capacity) == (0, 1, 12)
    with pytest.raises(ConfigError, match="slots"):
        pool.acquire(4)
    with pytest.raises(KnapSpecError, match="overflow"):
        second.check_room(13)
    model.prefill(second, ids(3, 10))
    copy = second.copy()
    assert copy.length == 10 and torch.equal(copy.keys[:, :, :10], second.keys[:, :, :10])
    pool.release(first)
    assert pool.acquire(8).slot == 0
    assert (pool.keys.data_ptr(), pool.values.data_ptr()) == addresses


def test_the_batch_drafts_with_one_sub_network_and_returns_last_rows(tiny_deep_llama):
    _, model = load_tiny(tiny_deep_llama)
    skip = {2, 5, 9}
    prompts, rows = [ids(30, 50), ids(31, 80)], [ids(40, 1), ids(41, 2)]
    alone = [prefilled(model, p) for p in prompts]
    together = [prefilled(model, p) for p in prompts]
    expected = [model.forward(c, r, c.length, skip=skip, logits="last").logits for c, r in zip(alone, rows)]
    got = model.forward_batch([RequestRows(c, r, c.length) for c, r in zip(together, rows)], skip=skip, logits="last")
    for g, e in zip(got, expected):
        assert g.shape == e.shape == (1, model.spec.vocab_size)
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert model.forward_batch([RequestRows(together[0], rows[0], together[0].length)], logits="none") == [None]


def test_bad_batches_are_refused(tiny_llama):
    _, model = load_tiny(tiny_llama)
    cache = model.new_cache(8)
    with pytest.raises(ConfigError, match="at least one request"):
        model.forward_batch([])
    with pytest.raises(ConfigError, match="logits"):
        model.forward_batch([RequestRows(cache, ids(1, 2), 0)], logits="first")
    with pytest.raises(KnapSpecError, match="overflow"):
        model.forward_batch([RequestRows(cache, ids(1, 2), 0), RequestRows(model.new_cache(4), ids(2, 6), 0)])


@pytest.mark.slow
def test_real_documents_decoded_in_a_batch_keep_their_greedy_tokens():
    """SmolLM2 in the CPU default mode: three documents' prompts, twelve greedy steps each,
    one batched forward per step against each request decoded alone."""
    from pipeline.engine import Engine, EngineConfig
    from pipeline.summarization.prompts import build_prompt

    engine = Engine(EngineConfig())
    model, steps = engine.model, 12
    docs = sample_documents()[:3]
    prompts = [
        build_prompt(engine.tokenizer, d["text"], max_prompt_tokens=n).token_ids for d, n in zip(docs, (300, 700, 500))
    ]

    def greedy_alone(prompt):
        cache = model.new_cache(prompt.numel() + steps)
        logits = [model.prefill(cache, prompt)]
        for _ in range(steps - 1):
            token = logits[-1].argmax().view(1)
            logits.append(model.forward(cache, token, cache.length, logits="last").logits[0])
            cache.advance(1)
        return torch.stack(logits)

    alone = [greedy_alone(p) for p in prompts]
    caches = [model.new_cache(p.numel() + steps) for p in prompts]
    batched = [[model.prefill(c, p)] for c, p in zip(caches, prompts)]
    for _ in range(steps - 1):
        # The next token of each request is its own run's, so the comparison stays row by row.
        blocks = [RequestRows(c, a[len(b) - 1].argmax().view(1), c.length) for c, a, b in zip(caches, alone, batched)]
        for out, history, cache in zip(model.forward_batch(blocks, logits="last"), batched, caches):
            history.append(out[0])
            cache.advance(1)
    for got, expected in zip(batched, alone):
        assert_as_promised(model, torch.stack(got), expected)
