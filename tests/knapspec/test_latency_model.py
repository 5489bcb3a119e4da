"""pipeline/knapspec/latency.py: the paper's latency arithmetic and integer weights."""

from __future__ import annotations

import json

import pytest

from pipeline.knapspec.latency import LatencyModel

MS = 1e-3


def make_model(**overrides) -> LatencyModel:
    values = dict(
        attn_slope=0.36e-6,
        attn_base=0.52 * MS,
        t_mlp=1.2 * MS,
        t_fixed=8 * MS,
        verify_ratios=(1.0, 1.1, 1.2, 1.5),
        num_layers=4,
    )
    values.update(overrides)
    return LatencyModel(**values)


def test_t_attn_is_linear_in_context():
    model = make_model()
    assert model.t_attn(0) == pytest.approx(0.52 * MS)
    assert model.t_attn(2000) == pytest.approx(0.52 * MS + 2000 * 0.36e-6)


def test_t_item_alternates_attention_and_mlp():
    model = make_model()
    assert model.t_item(0, 1000) == model.t_attn(1000)
    assert model.t_item(1, 1000) == model.t_mlp
    assert model.t_item(7, 1000) == model.t_mlp
    with pytest.raises(ValueError):
        model.t_item(8, 1000)
    with pytest.raises(ValueError):
        model.t_item(-1, 1000)


def test_t_forward_sums_every_item_and_the_fixed_cost():
    model = make_model()
    expected = sum(model.t_item(i, 700) for i in range(model.num_items)) + model.t_fixed
    assert model.t_forward(700) == pytest.approx(expected)


def test_t_draft_of_no_skip_is_t_forward():
    model = make_model()
    for n in (0, 512, 4096):
        assert model.t_draft((), n) == model.t_forward(n)
        assert model.t_draft(set(), n) == model.t_forward(n)


@pytest.mark.parametrize("skip", [{0}, {1}, {2, 5}, {0, 1, 2, 3, 4, 5, 6, 7}])
def test_skipping_items_saves_exactly_their_cost(skip):
    model = make_model()
    n = 3000
    saved = sum(model.t_item(i, n) for i in skip)
    assert model.t_draft(skip, n) == pytest.approx(model.t_forward(n) - saved, rel=1e-12)


def test_skipping_everything_leaves_the_fixed_cost():
    model = make_model()
    assert model.t_draft(range(model.num_items), 100) == pytest.approx(model.t_fixed)


def test_t_draft_rejects_unknown_items():
    with pytest.raises(ValueError, match="item 8"):
        make_model().t_draft({8}, 100)


def test_t_verify_scales_the_forward_by_the_measured_ratio():
    model = make_model()
    assert model.t_verify(1, 900) == model.t_forward(900)
    assert model.t_verify(3, 900) == pytest.approx(1.2 * model.t_forward(900))
    assert model.max_verify == 4
    for k in (0, 5):
        with pytest.raises(ValueError, match="verify of"):
            model.t_verify(k, 900)


def test_equal_costs_give_unit_weights():
    model = make_model(attn_slope=0.0, attn_base=1.2 * MS, t_mlp=1.2 * MS)
    assert model.item_weights(0) == [1] * 8
    assert model.item_weights(10_000) == [1] * 8


def test_attention_at_2_6_times_the_mlp_weighs_3():
    # The design's measurement: attention is 2.6x the MLP at 7k tokens.
    model = make_model(attn_slope=0.0, attn_base=2.6 * MS, t_mlp=1.0 * MS)
    assert model.item_weights(7000) == [3, 1] * 4


def test_mlp_heavier_than_attention_weighs_more():
    # Short contexts: attention is the cheaper kind and sets the unit.
    model = make_model(attn_slope=0.0, attn_base=0.5 * MS, t_mlp=1.2 * MS)
    assert model.item_weights(0) == [1, 2] * 4


def test_weights_grow_with_context_and_stop_at_the_cap():
    model = make_model(attn_slope=1e-6, attn_base=0.0, t_mlp=1 * MS)
    assert model.item_weights(1000) == [1, 1] * 4
    assert model.item_weights(3000) == [3, 1] * 4
    assert model.item_weights(100_000) == [5, 1] * 4
    assert model.item_weights(100_000, cap=8) == [8, 1] * 4
    with pytest.raises(ValueError):
        model.item_weights(100, cap=0)


def test_weights_round_half_up():
    model = make_model(attn_slope=0.0, attn_base=2.5 * MS, t_mlp=1.0 * MS)
    assert model.item_weights(0)[0] == 3


def test_zero_cost_items_keep_a_positive_weight():
    model = make_model(attn_slope=0.0, attn_base=0.0, t_mlp=1 * MS)
    assert model.item_weights(0) == [1, 5] * 4


def test_dict_round_trip_through_json():
    model = make_model(t_hop=0.25 * MS)
    again = LatencyModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model
    assert isinstance(again.verify_ratios, tuple)


def test_t_hop_defaults_to_zero_in_old_dicts():
    data = make_model().to_dict()
    del data["t_hop"]
    assert LatencyModel.from_dict(data).t_hop == 0.0


def test_from_dict_rejects_unknown_fields():
    data = dict(make_model().to_dict(), surprise=1)
    with pytest.raises(ValueError, match="surprise"):
        LatencyModel.from_dict(data)


def test_from_dict_rejects_missing_fields():
    data = make_model().to_dict()
    del data["t_mlp"]
    with pytest.raises(ValueError, match="t_mlp"):
        LatencyModel.from_dict(data)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_layers": 0},
        {"t_mlp": -1.0},
        {"attn_slope": float("nan")},
        {"verify_ratios": ()},
        {"verify_ratios": (1.1, 1.2)},
        {"verify_ratios": (1.0, 0.0)},
    ],
)
def test_invalid_models_are_refused(overrides):
    with pytest.raises(ValueError):
        make_model(**overrides)
