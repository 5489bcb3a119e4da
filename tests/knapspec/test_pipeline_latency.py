"""The pipelined replica's latency model: stage tables on one scale, hops, bypassed stages."""

from __future__ import annotations

import pytest

from pipeline.knapspec.latency import LatencyModel, PipelineLatency

MS = 1e-3


def stage(num_layers: int, speed: float = 1.0, t_fixed: float = 1 * MS) -> LatencyModel:
    """A stage whose device is `speed` times slower than the reference one."""
    return LatencyModel(
        attn_slope=0.2e-6 * speed, attn_base=0.5 * MS * speed, t_mlp=1.0 * MS * speed, t_fixed=t_fixed,
        verify_ratios=(1.0, 1.1, 1.3), num_layers=num_layers,
    )


def test_one_stage_is_the_single_device_model():
    single = stage(4)
    piped = PipelineLatency.of([single], t_hop=2 * MS)
    for n in (100, 3000):
        assert piped.item_weights(n) == single.item_weights(n)
        assert piped.t_forward(n) == pytest.approx(single.t_forward(n))
        assert piped.t_draft({0, 3}, n) == pytest.approx(single.t_draft({0, 3}, n))
        assert piped.t_verify(3, n) == pytest.approx(single.t_verify(3, n))
        assert piped.t_search(24, n) == pytest.approx(single.t_search(24, n))


def test_a_search_runs_every_stage_s_rows_and_hands_the_frontier_on():
    stages = [stage(2), stage(2, speed=3.0)]
    piped = PipelineLatency.of(stages, t_hop=2 * MS)
    expected = sum(s.t_forward(500) * (s.search_base + s.search_per_token * 48) for s in stages) + 2 * MS
    assert piped.t_search(48, 500) == pytest.approx(expected)


def test_a_slow_stage_weighs_more():
    piped = PipelineLatency.of([stage(2), stage(2, speed=3.0)], t_hop=0.0)
    weights = piped.item_weights(1000)
    assert weights[:4] == [1, 1, 1, 1] and weights[4:] == [3, 4, 3, 4]  # attention 0.7 ms, MLP 1 ms on the fast stage
    assert piped.t_item(5, 1000) == pytest.approx(3 * piped.t_item(1, 1000))


def test_hops_are_charged_and_a_skipped_middle_stage_is_bypassed():
    hop = 2 * MS
    stages = [stage(2, t_fixed=0.4 * MS), stage(2, t_fixed=0.0), stage(2, t_fixed=0.6 * MS)]
    piped = PipelineLatency.of(stages, t_hop=hop)
    n = 500
    full = sum(s.t_forward(n) for s in stages) + 2 * hop
    assert piped.t_forward(n) == pytest.approx(full)
    middle = {4, 5, 6, 7}
    assert piped.stages_run(middle) == [True, False, True]
    saved = stages[1].t_forward(n) + hop
    assert piped.t_draft(middle, n) == pytest.approx(full - saved)
    # Skipping all but one item of the middle stage keeps its hop.
    assert piped.t_draft({4, 5, 6}, n) == pytest.approx(full - 2 * stages[1].t_attn(n) - stages[1].t_mlp)
    # The first and last stages always run: they hold the embeddings and the head.
    assert piped.stages_run({0, 1, 2, 3, 8, 9, 10, 11}) == [True, True, True]
    assert piped.t_verify(2, n) == pytest.approx(sum(s.t_verify(2, n) for s in stages) + 2 * hop)


def test_items_map_to_their_stage():
    piped = PipelineLatency.of([stage(3), stage(1)], t_hop=0.0)
    assert piped.num_items == 8 and piped.stage_of(5) == (0, 5) and piped.stage_of(6) == (1, 0)
    with pytest.raises(ValueError):
        piped.stage_of(8)


def test_middle_stages_are_bypass_groups_weighing_their_hop():
    stages = [stage(2), stage(3), stage(2), stage(2)]
    # Δ = 0.7 ms (attention at n = 1000 on every stage): a 2.1 ms hop weighs 3.
    piped = PipelineLatency.of(stages, t_hop=2.1 * MS)
    assert piped.bypass_weights(1000) == [(4, 10, 3), (10, 14, 3)]
    assert piped.bypass_weights(1000, cap=2) == [(4, 10, 2), (10, 14, 2)]
    # No middle stage, or free hops: nothing to add.
    assert PipelineLatency.of(stages[:2], t_hop=2.1 * MS).bypass_weights(1000) == []
    assert PipelineLatency.of(stages, t_hop=0.0).bypass_weights(1000) == []
    assert stages[0].bypass_weights(1000) == []
