"""The draft/verify loop: greedy equality with Hugging Face, and exact speculative sampling."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import LayerSkipDrafter, NoDraft, default_static_skip
from pipeline.decoding.hf_reference import run_hf_generate
from pipeline.decoding.loop import DecodeConfig, prefill
from pipeline.decoding.sampling import SamplingParams, accept_greedy, probabilities
from pipeline.errors import ConfigError
from pipeline.model import short_attention
from tests.builders import SampleTally, assert_same_or_near_tie, exact_joint_law, load_tiny

EOS = frozenset({2})


def prompt_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def run(model, prompt, drafter, max_new=30, params=SamplingParams(), eos=EOS):
    config = DecodeConfig(max_new_tokens=max_new, eos_token_ids=eos)
    return decode(model, prefill(model, prompt, max_new), config, params, drafter)


@pytest.mark.exactness
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_ar_and_static_equal_hf_generate(tiny_checkpoint, seed):
    """fp32 promises equal tokens up to near-ties (pipeline/model/precision.py); these prompts
    have none, so every token is equal, but the check is the promise."""
    hf, model = load_tiny(tiny_checkpoint)
    prompt = prompt_ids(40, seed)
    reference = run_hf_generate(hf, prompt, 30, EOS, SamplingParams(), pad_token_id=0).token_ids
    ar = run(model, prompt, NoDraft())
    assert_same_or_near_tie(model, prompt, ar.token_ids, reference)
    # Threshold 0 drafts every step, so rejections and partial acceptance are exercised.
    for skip in ([1, 3], default_static_skip(model.spec.num_layers), [2, 3, 4, 5]):
        drafter = LayerSkipDrafter(skip, model.spec.num_items, max_draft=3, confidence_threshold=0.0)
        spec = run(model, prompt, drafter)
        assert_same_or_near_tie(model, prompt, spec.token_ids, reference)
        assert spec.stats.drafted_tokens > 0
        assert spec.stats.steps < len(reference)  # some drafts were accepted


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["fp16w", "fp16w-bf16", "bf16"])
def test_greedy_static_equals_ar_in_every_mode(tiny_llama, mode):
    """Row-exact with the kernel build: equal token for token (else up to near-ties)."""
    _, model = load_tiny(tiny_llama, mode)
    assert model.exactness.row_exact or short_attention.linear_kernel() is None
    for seed in range(3):
        prompt = prompt_ids(60, seed)
        ar = run(model, prompt, NoDraft())
        drafter = LayerSkipDrafter([1, 2, 5], model.spec.num_items, max_draft=4, confidence_threshold=0.0)
        assert_same_or_near_tie(model, prompt, run(model, prompt, drafter).token_ids, ar.token_ids)


def test_limits_and_eos(tiny_llama):
    _, model = load_tiny(tiny_llama)
    prompt = prompt_ids(20)
    drafter = LayerSkipDrafter([1], model.spec.num_items, max_draft=4, confidence_threshold=0.0)
    for max_new in (1, 2, 5, 17):
        result = run(model, prompt, drafter, max_new=max_new, eos=frozenset())
        assert len(result.token_ids) == max_new
        assert result.finish_reason == "length"
    full = run(model, prompt, NoDraft(), max_new=30, eos=frozenset())
    eos = full.token_ids[7]
    stopped = run(model, prompt, drafter, max_new=30, eos=frozenset({eos}))
    first = full.token_ids.index(eos)
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.finish_reason == "eos"
    with pytest.raises(ConfigError):
        DecodeConfig(max_new_tokens=0)


def test_stats_are_consistent(tiny_llama):
    _, model = load_tiny(tiny_llama)
    drafter = LayerSkipDrafter([1, 2], model.spec.num_items, max_draft=3, confidence_threshold=0.0)
    stats = run(model, prompt_ids(30), drafter, max_new=40, eos=frozenset()).stats
    assert stats.output_tokens == 40
    assert 0 < stats.accepted_tokens <= stats.drafted_tokens <= 3 * stats.steps
    # Every step emits accepted + 1 tokens; the first token came from prefill, the last step may be cut.
    assert stats.accepted_tokens + stats.steps >= stats.output_tokens - 1
    assert stats.mean_accepted_len == pytest.approx((stats.accepted_tokens + stats.steps) / stats.steps)
    assert stats.to_dict()["acceptance_rate"] == pytest.approx(stats.accepted_tokens / stats.drafted_tokens)
    ar = run(model, prompt_ids(30), NoDraft(), max_new=10, eos=frozenset()).stats
    assert (ar.steps, ar.drafted_tokens, ar.mean_accepted_len) == (9, 0, 1.0)


def test_accept_greedy():
    logits = torch.full((4, 10), -1.0)
    for row, token in enumerate([5, 6, 7, 8]):
        logits[row, token] = 1.0
    assert accept_greedy([5, 6, 7], logits) == [5, 6, 7, 8]
    assert accept_greedy([5, 9, 7], logits) == [5, 6]
    assert accept_greedy([], logits[:1]) == [5]


def test_sampling_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[2:] == 0).all() and probs[:2].sum() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.9))
    kept = int((probs > 0).sum())
    assert full[: kept - 1].sum() < 0.9 <= full[:kept].sum()
    with pytest.raises(ConfigError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=4), dict(temperature=0.8, top_k=6, top_p=0.7)])
def test_speculative_sampling_matches_the_model_distribution(tiny_llama, params):
    """χ² goodness of fit of (t1, t2, t3) from speculative sampling against the exact
    joint law of plain sampling; t2 and t3 pass through draft rejection."""
    _, model = load_tiny(tiny_llama)
    prompt = prompt_ids(12, seed=5)
    base = SamplingParams(**params)

    exact = exact_joint_law(model, prompt, base)

    drafter = LayerSkipDrafter([1, 2, 5], model.spec.num_items, max_draft=2, confidence_threshold=0.0)
    config = DecodeConfig(max_new_tokens=3)
    prefilled = prefill(model, prompt, 3)
    tally = SampleTally()
    for seed in range(3000):
        tally.add(decode(model, prefilled.copy(), config, SamplingParams(**params, seed=seed), drafter))
    tally.assert_follows(exact)


def test_speculative_sampling_is_reproducible(tiny_llama):
    _, model = load_tiny(tiny_llama)
    drafter = LayerSkipDrafter([1, 2], model.spec.num_items, max_draft=3, confidence_threshold=0.0)
    params = SamplingParams(temperature=1.0, seed=7)
    a = run(model, prompt_ids(20), drafter, params=params, eos=frozenset())
    b = run(model, prompt_ids(20), drafter, params=params, eos=frozenset())
    c = run(model, prompt_ids(20), drafter, params=SamplingParams(temperature=1.0, seed=8), eos=frozenset())
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert list(itertools.chain(a.token_ids))  # non-empty


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_speculative_sampling_runs_on_cuda_with_the_requests_own_generator(tiny_llama):
    """A request's random stream lives on its logits' device: on CUDA, sampling and rejection
    draw from a CUDA generator (a CPU one raises there), reproducibly per seed."""
    from pipeline.model import checkpoint
    from pipeline.model.linear import ComputeMode
    from pipeline.model.loading import model_from_tensors

    config = checkpoint.load_config(tiny_llama)
    model = model_from_tensors(config, checkpoint.read_tensors(tiny_llama), ComputeMode.FP32, "cuda")
    drafter = LayerSkipDrafter([1, 2], model.spec.num_items, max_draft=3, confidence_threshold=0.0)
    params = SamplingParams(temperature=1.0, seed=7)
    assert params.generator(torch.device("cuda")).device.type == "cuda"
    prompt = prompt_ids(20).to("cuda")
    runs = [decode(model, prefill(model, prompt, 12), DecodeConfig(12), params, drafter).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12
