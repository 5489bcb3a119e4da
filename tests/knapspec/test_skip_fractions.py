"""Skip sets by size and kind, α from tokens per step, and the projection onto another
model's step times (pipeline/knapspec/skip_fractions.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.decoding.decode import decode
from pipeline.decoding.loop import DecodeConfig, prefill
from pipeline.decoding.sampling import SamplingParams
from pipeline.knapspec.skip_fractions import (
    alpha_from_tokens,
    best_skip_sets,
    fractions,
    project,
    skippable,
    spread_skip,
)
from pipeline.knapspec.tpt import expected_tokens
from pipeline.model import items
from tests.builders import load_tiny, make_tiny_checkpoint, random_prompt


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("gamma", [1, 4])
def test_alpha_from_tokens_inverts_expected_tokens(alpha, gamma):
    assert alpha_from_tokens(expected_tokens(alpha, gamma), gamma) == pytest.approx(alpha, abs=1e-9)


def test_alpha_from_tokens_at_the_ends():
    assert alpha_from_tokens(1.0, 4) == 0.0 and alpha_from_tokens(5.0, 4) == 1.0
    with pytest.raises(ValueError):
        alpha_from_tokens(2.0, 0)


def test_spread_skip_counts_kinds_and_keeps_the_first_and_last_layers():
    for attention, mlp in [(0, 0), (3, 0), (0, 5), (12, 7), (30, 30)]:
        skip = spread_skip(32, attention, mlp)
        assert items.count_kinds(skip) == (attention, mlp)
        assert not skip & items.items_of_layers({0, 31})
        assert fractions(skip, 32) == (attention / 32, mlp / 32)
    layers = sorted(items.split_item(i)[0] for i in spread_skip(32, 3, 0))
    assert layers == [6, 16, 26]  # spread over the middle layers, not bunched at one end
    with pytest.raises(ValueError):
        spread_skip(32, 31, 0)


def test_skippable_items_by_kind():
    assert skippable(4, "attention") == frozenset(items.layer_items(layer)[0] for layer in (1, 2))
    assert skippable(4, "mlp") == frozenset(items.layer_items(layer)[1] for layer in (1, 2))
    assert skippable(4, "both") == skippable(4, "attention") | skippable(4, "mlp")
    with pytest.raises(ValueError):
        skippable(4, "heads")


def test_project_takes_the_best_gamma_or_ar():
    verify = {1: 1.0, 2: 1.05, 4: 1.2}
    plan = project(0.8, 1.0, 0.3, verify)
    assert plan.gamma == 3
    assert plan.speedup == pytest.approx(expected_tokens(0.8, 3) / (3 * 0.3 + 1.2))
    assert project(0.1, 1.0, 1.0, verify).gamma == 0 and project(0.1, 1.0, 1.0, verify).speedup == 1.0


def test_best_skip_sets_find_the_quiet_layers_by_kind(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "six", "llama", num_hidden_layers=6, quiet_layers=(2, 3))
    _, model = load_tiny(path)
    prompt = random_prompt(3, 40)
    answer = decode(model, prefill(model, prompt, 12), DecodeConfig(12), SamplingParams()).token_ids
    scored = torch.cat([prompt, torch.tensor(answer, dtype=prompt.dtype)])
    cache = prefill(model, scored, 1).cache
    r = len(answer)
    for kind, which in (("attention", 0), ("mlp", 1)):
        sets = best_skip_sets(model, cache, scored[-r:], scored.numel() - r, kind, 2, threshold=0.0)
        assert sorted(sets) == [1, 2]
        assert all(skip <= skippable(6, kind) for skip in sets.values())
        assert sets[2] == frozenset(items.layer_items(layer)[which] for layer in (2, 3))
    both = best_skip_sets(model, cache, scored[-r:], scored.numel() - r, "both", 4, threshold=0.0)
    assert both[4] == items.items_of_layers({2, 3})
