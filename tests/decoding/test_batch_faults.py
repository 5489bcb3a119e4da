"""A failure in a continuous batch costs only its own request: a forward that breaks on one
request is run again without it (bisected), an exception in one request's acceptance ends that
request, and non-finite logits end their request with an error, the others' tokens unchanged."""

from __future__ import annotations

import pytest
import torch

from pipeline.decoding.drafters import NoDraft
from pipeline.decoding.loop import DecodeConfig
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.errors import DeviceFault, NonFiniteLogits, is_device_fault
from tests.builders import assert_same_or_near_tie, load_tiny, repeating_prompt
from tests.decoding.test_scheduler import EOS, alone

POISON = 97  # a token id past repeating_prompt's range: the forward of any block that holds it breaks


class BreaksOnPoison:
    """A model whose batched forward raises when a block carries the poison token (a request
    whose input breaks a kernel), counting the forwards it was asked for."""

    def __init__(self, model) -> None:
        self.model = model
        self.forwards = 0
        self.always = False  # every forward breaks, as on a device gone bad

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_batch(self, blocks, **kwargs):
        self.forwards += 1
        if self.always or any(POISON in list(block.token_ids) for block in blocks):
            raise RuntimeError("a kernel broke on this request")
        return self.model.forward_batch(blocks, **kwargs)


def finished_by_ticket(batcher: ContinuousBatcher) -> dict:
    return {done.ticket: done for done in batcher.run()}


def test_a_forward_broken_by_one_request_is_run_again_without_it(tiny_llama):
    _, model = load_tiny(tiny_llama)
    broken = BreaksOnPoison(model)
    prompts = [repeating_prompt(10 + 7 * i, i) for i in range(6)]
    prompts[3] = torch.cat([prompts[3], torch.tensor([POISON])])
    batcher = ContinuousBatcher(broken, max_batch=6, prefill_chunk=8)
    tickets = [batcher.submit(GenerationRequest(p, DecodeConfig(12, EOS))) for p in prompts]
    finished = finished_by_ticket(batcher)
    assert "a kernel broke" in str(finished[tickets[3]].error)
    for i, ticket in enumerate(tickets):
        if i != 3:
            assert finished[ticket].error is None, finished[ticket].error
            assert_same_or_near_tie(
                model, prompts[i], finished[ticket].result.token_ids, alone(model, prompts[i], 12, 8)
            )
    # Bisecting one bad block of a forward costs a few forwards, not one per request.
    assert broken.forwards < batcher.steps + 2 * 3 + 2
    assert batcher.reserved_bytes == 0 and not batcher.running


def test_a_forward_that_fails_whatever_its_rows_fails_them_all_at_once(tiny_llama):
    """A device gone bad fails every forward: after the whole and its two halves, every request
    gets the error, rather than 2n forwards hunting a culprit that is not there."""
    _, model = load_tiny(tiny_llama)
    broken = BreaksOnPoison(model)
    batcher = ContinuousBatcher(broken, max_batch=4)
    tickets = [batcher.submit(GenerationRequest(repeating_prompt(12, i), DecodeConfig(30))) for i in range(4)]
    while len(batcher.running) < 4:
        assert not batcher.step()
    broken.always = True
    before = broken.forwards
    finished = {done.ticket: done for done in batcher.step()}
    assert broken.forwards - before == 3
    assert set(finished) == set(tickets) and all("a kernel broke" in str(d.error) for d in finished.values())
    assert batcher.reserved_bytes == 0 and not batcher.num_requests


class _ObserveBreaks(NoDraft):
    def observe(self, drafted: int, accepted: int) -> None:
        raise RuntimeError("bookkeeping broke")


def test_an_exception_in_one_requests_acceptance_ends_only_that_request(tiny_llama):
    _, model = load_tiny(tiny_llama)
    prompts = [repeating_prompt(10, seed) for seed in range(3)]
    batcher = ContinuousBatcher(model, max_batch=3)
    drafters = [NoDraft(), _ObserveBreaks(), NoDraft()]
    tickets = [
        batcher.submit(GenerationRequest(p, DecodeConfig(10, EOS), drafter=d)) for p, d in zip(prompts, drafters)
    ]
    finished = finished_by_ticket(batcher)
    assert "bookkeeping broke" in str(finished[tickets[1]].error)
    for i in (0, 2):
        assert_same_or_near_tie(model, prompts[i], finished[tickets[i]].result.token_ids, alone(model, prompts[i], 10))


def poison_cache(request) -> None:
    """NaN into a running request's cache: its next forward's logits are NaN, as an overflow makes them."""
    request.cache.values[:, :, : request.cache.length] = float("nan")


def test_nan_left_in_a_slot_does_not_reach_its_next_request(tiny_llama):
    """A pooled attention reads a run of slots up to its longest request and masks the rest: the
    stale values of a failed request's slot are read (weighted 0) by the slot's next, shorter one."""
    _, model = load_tiny(tiny_llama)  # fp32: the masked product, not the kernel that stops at each row's keys
    long_prompt, short_prompt = repeating_prompt(150, 1), repeating_prompt(6, 2)
    batcher = ContinuousBatcher(model, max_batch=2)
    keep = batcher.submit(GenerationRequest(long_prompt, DecodeConfig(40, EOS)))
    poisoned = batcher.submit(GenerationRequest(repeating_prompt(150, 3), DecodeConfig(40, EOS)))
    while poisoned not in batcher.running:
        batcher.step()
    poison_cache(batcher.running[poisoned])
    failed = batcher.step()
    assert [done.ticket for done in failed] == [poisoned]
    assert isinstance(failed[0].error, NonFiniteLogits) and "NaN" in str(failed[0].error)
    after = batcher.submit(GenerationRequest(short_prompt, DecodeConfig(12, EOS)))  # takes the freed slot
    finished = finished_by_ticket(batcher)
    assert finished[after].error is None, finished[after].error
    assert_same_or_near_tie(model, short_prompt, finished[after].result.token_ids, alone(model, short_prompt, 12))
    assert finished[keep].error is None


@pytest.fixture(scope="module")
def real_engine():
    from pipeline.engine import Engine, EngineConfig
    from pipeline.knapspec.latency import LatencyModel

    # Verification nearly free: KnapSpec's search then drafts, so the batch holds real drafts.
    latency = LatencyModel(
        attn_slope=2e-7, attn_base=4e-4, t_mlp=5e-4, t_fixed=1e-3, verify_ratios=(1.0,) * 11, num_layers=30
    )
    return Engine(EngineConfig(latency=latency))


@pytest.mark.slow
@pytest.mark.parametrize("greedy", [True, False])
def test_nan_logits_in_one_request_of_eight_end_it_alone(real_engine, greedy):
    """The real model in the CPU default mode, eight summaries of real documents in one batch
    with the job's strategy: one request's logits turn NaN mid-answer; it ends with an error,
    and the other seven finish. Greedy, their tokens are those of the batch undisturbed; sampled
    draws depend on the batch's drafts (its plan changes when a request leaves), so there the
    seven must only finish, where a NaN distribution used to fail inside torch.multinomial."""
    from pipeline.engine import StrategyConfig
    from pipeline.summarization.prompts import build_prompt
    from tests.builders import sample_documents

    engine = real_engine
    docs = sample_documents()[:8]
    prompts = [build_prompt(engine.tokenizer, d["text"], max_prompt_tokens=300).token_ids for d in docs]
    strategy = StrategyConfig("knapspec-lookup")
    params = [SamplingParams() if greedy else SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(8)]

    def run(poisoned: int | None) -> dict:
        batcher = engine.batcher(8)
        tickets = [batcher.submit(engine.request(p, strategy, 24, s)) for p, s in zip(prompts, params)]
        finished = []
        while batcher.num_requests:
            if poisoned is not None and tickets[poisoned] in batcher.running:
                request = batcher.running[tickets[poisoned]]
                if len(request.output) >= 4:
                    poison_cache(request)
                    poisoned = None
            finished += batcher.step()
        by_ticket = {done.ticket: done for done in finished}
        return {i: by_ticket[t] for i, t in enumerate(tickets)}

    clean, broken = run(None), run(5)
    assert isinstance(broken[5].error, NonFiniteLogits)
    for i in range(8):
        assert clean[i].error is None, clean[i].error
        if i != 5:
            assert broken[i].error is None, broken[i].error
            if greedy:
                assert broken[i].result.token_ids == clean[i].result.token_ids, i


def test_a_device_fault_is_told_from_a_requests_own_error():
    """What makes a replica exit to be restarted (actors/restart.py), and what fails only its request."""
    assert is_device_fault(DeviceFault("a tensor-parallel rank failed"))
    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_fault(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_device_fault(NonFiniteLogits("the model's logits are NaN"))
    assert not is_device_fault(ValueError("an illegal memory access, said a user's message"))
