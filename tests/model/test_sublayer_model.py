"""The sublayer runner against Hugging Face: logits, hidden states, KV cache rollback."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import ConfigError, KnapSpecError
from tests.builders import load_tiny

ATOL = 1e-4


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long)).logits[0]


@pytest.fixture
def prompt():
    return torch.randint(3, 96, (150,), generator=torch.Generator().manual_seed(1))


def test_prefill_decode_verify_match_hf(tiny_checkpoint, prompt):
    hf, model = load_tiny(tiny_checkpoint)
    extra = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(2))
    full = torch.cat([prompt, extra])
    reference = hf_logits(hf, full)  # [T, V]

    cache = model.new_cache(200)
    # Chunks of 64 put the second and third chunks on the offset-causal path.
    last = model.prefill(cache, prompt, chunk_size=64)
    torch.testing.assert_close(last, reference[prompt.numel() - 1], atol=ATOL, rtol=0)

    decoded = model.forward(cache, extra[:1], cache.length).logits  # one token
    torch.testing.assert_close(decoded[0], reference[prompt.numel()], atol=ATOL, rtol=0)

    verified = model.forward(cache, extra, cache.length, logits="all").logits  # six tokens at once
    torch.testing.assert_close(verified, reference[prompt.numel() :], atol=ATOL, rtol=0)


def test_hidden_states_match_hf(tiny_checkpoint, prompt):
    hf, model = load_tiny(tiny_checkpoint)
    cache = model.new_cache(200)
    model.prefill(cache, prompt[:-4])
    out = model.forward(cache, prompt[-4:], cache.length, return_hidden=True)
    num_layers = model.spec.num_layers
    assert out.hidden_states.shape == (2 * num_layers + 1, 4, model.spec.hidden_size)
    with torch.no_grad():
        ref = hf(prompt[None], output_hidden_states=True).hidden_states  # embeddings + after each layer
    for layer in range(num_layers - 1):  # HF's last entry is after the final norm
        torch.testing.assert_close(out.hidden_states[2 * layer + 2], ref[layer + 1][0, -4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden_states[0], ref[0][0, -4:])


def test_skipped_items_are_identity(tiny_llama, prompt):
    _, model = load_tiny(tiny_llama)
    cache = model.new_cache(200)
    model.prefill(cache, prompt)
    skip = {1, 2, 5}
    out = model.forward(cache, prompt[:3], cache.length, skip=skip, return_hidden=True)
    for item in skip:
        torch.testing.assert_close(out.hidden_states[item + 1], out.hidden_states[item], atol=0, rtol=0)
    for item in set(range(model.spec.num_items)) - skip:
        assert not torch.equal(out.hidden_states[item + 1], out.hidden_states[item])


def test_crop_and_rollback_are_exact(tiny_llama, prompt):
    _, model = load_tiny(tiny_llama)
    cache = model.new_cache(200)
    model.prefill(cache, prompt[:100])
    committed = cache.length
    # A rejected draft writes garbage past the committed length...
    model.forward(cache, prompt[100:108], committed, skip={2, 3})
    cache.crop(committed)
    rolled_back = model.forward(cache, prompt[100:104], committed).logits

    fresh = model.new_cache(200)
    model.prefill(fresh, prompt[:100])
    reference = model.forward(fresh, prompt[100:104], committed).logits
    torch.testing.assert_close(rolled_back, reference, atol=0, rtol=0)

    # ...and cropping into committed tokens re-derives them exactly too.
    cache.crop(60)
    model.prefill(cache, prompt[60:100])
    again = model.forward(cache, prompt[100:104], cache.length).logits
    torch.testing.assert_close(again, reference, atol=ATOL, rtol=0)


def test_cache_limits(tiny_llama):
    _, model = load_tiny(tiny_llama)
    cache = model.new_cache(8)
    with pytest.raises(KnapSpecError, match="overflow"):
        model.prefill(cache, torch.arange(3, 12))
    with pytest.raises(ConfigError, match="exceeds this model's limit"):
        model.new_cache(model.max_context + 1)
    with pytest.raises(ValueError):
        cache.crop(5)  # nothing committed yet


@pytest.mark.parametrize("mode", ["fp16w", "bf16"])
def test_compute_modes_stay_close_to_fp32(tiny_llama, prompt, mode):
    _, exact = load_tiny(tiny_llama, "fp32")
    _, fast = load_tiny(tiny_llama, mode)
    caches = exact.new_cache(200), fast.new_cache(200)
    a = exact.prefill(caches[0], prompt)
    b = fast.prefill(caches[1], prompt)
    tolerance = 0.05 if mode == "fp16w" else 0.5
    assert (a - b).abs().max() < tolerance * a.abs().max()
    assert b.dtype == torch.float32
