"""Continuous batching (ContinuousBatcher, BatchingThread): requests join after a prefill fed
in chunks between decode steps, leave at EOS or their limit, wait for KV room, and each
request's greedy tokens are those it decodes alone with `ar` (or differ at a near-tie)."""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import LayerSkipDrafter, NoDraft
from pipeline.decoding.kv_room import kv_bytes_per_position
from pipeline.decoding.loop import DecodeConfig, Prefilled
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.decoding.serving import BatchingThread
from pipeline.errors import ConfigError
from pipeline.model.linear import fp16w_available
from tests.builders import assert_same_or_near_tie, load_tiny, mixed_drafters, repeating_prompt

EOS = frozenset({2})


def alone(model, prompt: torch.Tensor, limit: int, prefill_chunk: int | None = None) -> list[int]:
    """The request decoded by itself, its prompt read in the batcher's chunks: a chunk's rows go
    through the kernels a chunk of that size takes, so equal tokens need equal chunks."""
    cache = model.new_cache(prompt.numel() + limit)
    prefilled = Prefilled(cache, model.prefill(cache, prompt, prefill_chunk), prompt.numel(), 0.0)
    return decode(model, prefilled, DecodeConfig(limit, EOS), SamplingParams()).token_ids


def results_by_ticket(finished) -> dict:
    out = {}
    for done in finished:
        assert done.error is None, done.error
        out[done.ticket] = done.result
    return out


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["fp32", *(["fp16w", "fp16w-bf16"] if fp16w_available() else []), "bf16"])
def test_staggered_requests_keep_their_tokens(tiny_checkpoint, mode):
    """Five requests, three at a time, prompts fed 16 rows per step: they join as their prefill
    ends (between others' decode steps), some stop early, drafts are mixed."""
    _, model = load_tiny(tiny_checkpoint, mode)
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((5, 70, 33, 2, 50))]
    limits = [30, 12, 25, 1, 18]
    batcher = ContinuousBatcher(model, max_batch=3, prefill_chunk=16)
    tickets = [
        batcher.submit(GenerationRequest(p, DecodeConfig(m, EOS), SamplingParams(), d))
        for p, m, d in zip(prompts, limits, mixed_drafters(model))
    ]
    in_batch = []
    finished = []
    while batcher.num_requests:
        finished += batcher.step()
        in_batch.append(len(batcher.running) + len(batcher.prefilling))
    results = results_by_ticket(finished)
    assert max(in_batch) == 3, "never more than max_batch at once, and it fills up"
    for ticket, prompt, limit in zip(tickets, prompts, limits):
        assert_same_or_near_tie(model, prompt, results[ticket].token_ids, alone(model, prompt, limit, 16))
        assert results[ticket].stats.prompt_tokens == prompt.numel()
    assert sum(r.stats.drafted_tokens for r in results.values()) > 0
    assert batcher.reserved_bytes == 0


def test_a_prefill_joining_mid_run_does_not_change_running_requests(tiny_llama):
    _, model = load_tiny(tiny_llama)
    running_prompt, joining_prompt = repeating_prompt(20, 1), repeating_prompt(150, 2)

    def decode_with(join_at: int | None) -> list[int]:
        batcher = ContinuousBatcher(model, max_batch=4, prefill_chunk=32)
        ticket = batcher.submit(GenerationRequest(running_prompt, DecodeConfig(40), drafter=PromptLookupDrafter()))
        finished = []
        for step in range(1000):
            if step == join_at:
                batcher.submit(GenerationRequest(joining_prompt, DecodeConfig(10)))
            finished += batcher.step()
            if not batcher.num_requests:
                break
        return results_by_ticket(finished)[ticket].token_ids

    # The joiner's 150 prompt tokens take five steps of 32 rows, each beside a decode step.
    assert_same_or_near_tie(model, running_prompt, decode_with(join_at=5), decode_with(join_at=None))


def test_kv_budget_admits_what_fits_and_refuses_what_never_can(tiny_llama):
    _, model = load_tiny(tiny_llama)
    per_position = kv_bytes_per_position(model)
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((30, 40, 20, 35))]
    # Room for two slots of 80 positions: one request waits for a free slot, nothing hangs.
    batcher = ContinuousBatcher(model, max_batch=3, kv_budget_bytes=170 * per_position, slot_positions=80)
    tickets = [batcher.submit(GenerationRequest(p, DecodeConfig(12, EOS))) for p in prompts]
    finished, at_once, pools = [], 0, set()
    while batcher.num_requests:
        finished += batcher.step()
        at_once = max(at_once, len(batcher.running) + len(batcher.prefilling))
        pools.add((id(batcher.pool), batcher.pool.keys.data_ptr(), batcher.pool.values.data_ptr()))
        assert batcher.reserved_bytes <= batcher.room.budget_bytes
    assert at_once == 2
    # One pool for the batch's life, its slots as long as the longest request it serves: never
    # reallocated, so a captured step could keep its addresses.
    assert len(pools) == 1 and (batcher.pool.num_slots, batcher.pool.slot_capacity) == (2, 80)
    results = results_by_ticket(finished)
    for ticket, prompt in zip(tickets, prompts):
        assert results[ticket].token_ids == alone(model, prompt, 12)

    # A prompt of 100 tokens and 12 new do not fit a slot of 80: refused at once, with both sizes and the budget.
    too_long = GenerationRequest(repeating_prompt(100, 3), DecodeConfig(12))
    with pytest.raises(
        ConfigError, match=rf"{too_long.positions} positions .* slots of 80 positions \(2 slots, .* budget\)"
    ):
        batcher.submit(too_long)
    with pytest.raises(ConfigError, match="context"):
        ContinuousBatcher(model, 2).submit(GenerationRequest(repeating_prompt(600, 3), DecodeConfig(12)))
    with pytest.raises(ConfigError, match=r"holds not one slot of 80 positions"):
        ContinuousBatcher(model, 2, kv_budget_bytes=63 * per_position, slot_positions=80).submit(
            GenerationRequest(prompts[0], DecodeConfig(12))
        )
    assert batcher.num_requests == 0


class _BrokenDrafter(NoDraft):
    def propose_steps(self, request):
        raise RuntimeError("drafter broke")
        yield


def test_a_failing_request_leaves_the_others_running(tiny_llama):
    _, model = load_tiny(tiny_llama)
    prompts = [repeating_prompt(10, seed) for seed in range(3)]
    batcher = ContinuousBatcher(model, max_batch=3)
    drafters = [NoDraft(), _BrokenDrafter(), LayerSkipDrafter([2, 3], model.spec.num_items, max_draft=2)]
    tickets = [
        batcher.submit(GenerationRequest(p, DecodeConfig(10, EOS), drafter=d)) for p, d in zip(prompts, drafters)
    ]
    finished = {done.ticket: done for done in batcher.run()}
    assert "drafter broke" in str(finished[tickets[1]].error)
    for i in (0, 2):
        assert finished[tickets[i]].result.token_ids == alone(model, prompts[i], 10)


def test_requests_from_many_threads_share_one_decode_thread(tiny_llama):
    _, model = load_tiny(tiny_llama)
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((12, 40, 25, 7, 31, 18))]
    server = BatchingThread(ContinuousBatcher(model, max_batch=4, prefill_chunk=16))
    got: dict[int, list[int]] = {}

    def call(i: int) -> None:
        got[i] = server.generate(GenerationRequest(prompts[i], DecodeConfig(15, EOS))).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # One that can never run fails at once, on its caller's future.
    with pytest.raises(ConfigError, match="context"):
        server.generate(GenerationRequest(repeating_prompt(600, 9), DecodeConfig(4)))
    server.close()
    for i, prompt in enumerate(prompts):
        assert_same_or_near_tie(model, prompt, got[i], alone(model, prompt, 15))
    with pytest.raises(RuntimeError, match="closed"):
        server.submit(GenerationRequest(prompts[0], DecodeConfig(4)))


def test_engine_batches_like_one_at_a_time(tiny_chat_checkpoint):
    """Engine.generate_batch: our batcher, and transformers' generate() on a left-padded batch."""
    from pipeline.engine import Engine, EngineConfig, StrategyConfig

    engine = Engine(EngineConfig(model=str(tiny_chat_checkpoint), dtype="fp32"))
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((12, 40, 25))]
    for name in ("ar", "lookup", "hf"):
        strategy = StrategyConfig(name=name)
        single = [engine.generate(p, strategy, 14).token_ids for p in prompts]
        batched = engine.generate_batch(prompts, strategy, 14, max_batch=2)
        for prompt, got, expected in zip(prompts, batched, single):
            assert_same_or_near_tie(engine.model, prompt, got.token_ids, expected)
    with pytest.raises(ConfigError, match="context"):
        engine.generate_batch([repeating_prompt(5000, 1)], StrategyConfig(), 8)
