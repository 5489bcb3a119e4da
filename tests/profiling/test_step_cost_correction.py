"""What timed steps teach goes back into the device's table: the corrected table, how it is
kept with the measured one, and an engine whose device slows down after calibration."""

from __future__ import annotations

import dataclasses
import statistics
from types import SimpleNamespace

import pytest
import torch

from pipeline.decoding import batch_drafts
from pipeline.decoding.batch_drafts import DeviceStepCost
from pipeline.decoding.step_cost import StepCost
from pipeline.engine import Engine, EngineConfig, StrategyConfig
from pipeline.knapspec.batch_latency import corrected_table
from pipeline.knapspec.latency import LatencyModel
from profiling import microbench
from profiling.calibration import CalibrationStore, store_calibrator
from profiling.record import Calibration, CalibrationFormatError, CalibrationKey, StepCostCorrection, device_name
from tests.builders import load_job, random_prompt
from tests.profiling.test_profiling import make_calibration
from tests.slow_device import slow_down

TABLE = LatencyModel(
    attn_slope=0.4e-6,
    attn_base=0.5e-3,
    t_mlp=0.6e-3,
    t_fixed=3.7e-3,
    verify_ratios=(1.0, 1.05, 1.12, 1.2, 1.3),
    num_layers=30,
)
FIT = StepCost(fixed=0.06, per_row=0.012, per_key=30e-6, per_key_row=4e-6)


def test_a_corrected_table_gives_back_the_fit_and_keeps_the_items_split():
    corrected = corrected_table(TABLE, FIT)
    again = StepCost.from_table(corrected)
    assert again.fixed == pytest.approx(FIT.fixed, rel=1e-9)
    assert again.per_row == pytest.approx(FIT.per_row, rel=1e-9)
    assert again.per_key == pytest.approx(FIT.per_key, rel=1e-9)
    # Timed steps cannot tell items apart: one row's cost is split as the table split it.
    for name in ("attn_base", "t_mlp"):
        assert getattr(corrected, name) / corrected.t_fixed == pytest.approx(getattr(TABLE, name) / TABLE.t_fixed)
    # The verify curve keeps its shape, stretched to the fit's slope.
    stretch = (corrected.verify_ratios[-1] - 1) / (TABLE.verify_ratios[-1] - 1)
    for r, r0 in zip(corrected.verify_ratios[1:], TABLE.verify_ratios[1:]):
        assert r - 1 == pytest.approx((r0 - 1) * stretch)
    assert corrected.search_base == TABLE.search_base and corrected.num_layers == TABLE.num_layers
    # A table's own step cost corrects it to itself.
    itself = corrected_table(TABLE, StepCost.from_table(TABLE))
    assert itself.verify_ratios == pytest.approx(TABLE.verify_ratios)
    for name in ("attn_slope", "attn_base", "t_mlp", "t_fixed"):
        assert getattr(itself, name) == pytest.approx(getattr(TABLE, name))


def test_a_flat_verify_curve_takes_the_fits_straight_line():
    flat = dataclasses.replace(TABLE, verify_ratios=(1.0, 0.99, 1.0))
    corrected = corrected_table(flat, FIT)
    slope = FIT.per_row / (FIT.fixed + FIT.per_row)
    assert corrected.verify_ratios == pytest.approx((1.0, 1 + slope, 1 + 2 * slope))
    with pytest.raises(ValueError, match="positive"):
        corrected_table(TABLE, StepCost(0.0, 0.0, 1e-6, 0.0))


def calibration(**overrides) -> Calibration:
    return make_calibration(**({"latency": TABLE, "device": device_name("cpu"), "model": "tiny"} | overrides))


def test_a_correction_is_kept_beside_the_measured_table(tmp_path):
    corrected = calibration(correction=StepCostCorrection(FIT, 300, Calibration.now()))
    corrected.save(tmp_path / "cal.json")
    loaded = Calibration.load(tmp_path / "cal.json")
    assert loaded == corrected and loaded.latency == TABLE  # what was measured stays as measured
    assert loaded.corrected_latency == corrected_table(TABLE, FIT)
    plain = calibration()
    assert plain.corrected_latency is plain.latency
    data = plain.to_dict()
    del data["correction"]  # a file stored before corrections existed
    assert Calibration.from_dict(data) == plain
    data["correction"] = {**dataclasses.asdict(FIT), "per_key": -1.0, "steps": 3, "updated_at": "now"}
    with pytest.raises(CalibrationFormatError):
        Calibration.from_dict(data)


def test_the_calibrate_job_shows_the_measured_table_beside_the_corrected_one():
    calibrate = load_job("calibrate.py", "calibrate_job_corrected")
    shown = calibrate.format_table(calibration(correction=StepCostCorrection(FIT, 300, "2026-01-01T00:00:00+00:00")))
    assert "Corrected by the fit of 300 timed batch steps (2026-01-01T00:00:00+00:00)" in shown
    forward = f"{TABLE.t_forward(1024) * 1e3:.2f} ms | {corrected_table(TABLE, FIT).t_forward(1024) * 1e3:.2f} ms"
    assert f"| t_forward(1024) | {forward} |" in shown
    assert "Corrected" not in calibrate.format_table(calibration())


def test_the_store_records_a_correction_and_plans_from_it(tmp_path):
    store_root = tmp_path / "store"
    model = SimpleNamespace(mode=SimpleNamespace(value="fp16w"), device=torch.device("cpu"), attention_route="matmul")
    calibrator = store_calibrator(store_root)
    assert not calibrator.record(model, "tiny", FIT, 100)  # nothing stored: nothing to correct
    CalibrationStore(store_root).put(calibration())
    assert calibrator(model, "tiny", False) == TABLE
    assert calibrator.record(model, "tiny", FIT, 100)
    stored = CalibrationStore(store_root).get(CalibrationKey(device_name("cpu"), "tiny", "fp16w"))
    assert stored.correction.cost == FIT and stored.correction.steps == 100 and stored.latency == TABLE
    assert calibrator(model, "tiny", False) == corrected_table(TABLE, FIT)


def timed_step(budget, contexts, seconds):
    budget.observe([SimpleNamespace(token_ids=[])] * len(contexts), contexts, False, seconds)


def test_the_device_fit_is_shared_by_batches_and_recorded_now_and_then(monkeypatch):
    monkeypatch.setattr(batch_drafts, "RECORD_FIRST", 10)
    monkeypatch.setattr(batch_drafts, "RECORD_EVERY", 20)
    recorded = []
    device = DeviceStepCost(record=lambda cost, steps: recorded.append(steps))
    truth = StepCost(fixed=0.03, per_row=0.004, per_key=8e-6, per_key_row=2e-6)
    first, second = device.budget(), device.budget()
    assert first.step_cost(TABLE) is second.step_cost(TABLE) is device.cost  # one fit, from the first table
    for step in range(45):
        contexts = [500 + 40 * step, 2000 + 13 * step]
        timed_step(first if step < 25 else second, contexts, truth.seconds(contexts, [1, 1]))
    assert recorded == [10, 30]
    device.flush()
    device.flush()  # nothing new since
    assert recorded == [10, 30, 45]
    assert DeviceStepCost().budget().step_cost(TABLE) is not device.cost


# Per MLP call: 20 ms per step on 2 layers, ten times the step itself, so that a busy machine's
# noise on the compute stays small beside it.
SLOWDOWN_S = 10e-3


def median_errors(cost, after: int) -> tuple[float, float]:
    """Median relative errors of the table's and the fit's predictions past the first `after`
    steps (a median: an odd step stalled by a neighbour says nothing of the fit)."""
    seen = list(cost.errors)[after:]
    return statistics.median(t for t, _ in seen), statistics.median(f for _, f in seen)


def test_an_engine_follows_a_device_slowed_mid_run_and_the_next_engine_starts_there(
    tiny_chat_checkpoint, tmp_path, monkeypatch
):
    """The test throttle (tests/slow_device.py) makes every MLP call wait once the engine has
    run a while: the measured table is then far off. The engine's fit follows within a few
    dozen steps, is kept with the table, and a new engine plans from the corrected table."""
    real = microbench.measure
    monkeypatch.setattr(microbench, "measure", lambda *a, **k: real(*a, **k, repeats=1))
    config = EngineConfig(model=str(tiny_chat_checkpoint), dtype="fp32")
    calibrator = store_calibrator(tmp_path)
    prompts = [random_prompt(seed, length) for seed, length in enumerate((40, 64, 90, 52))]
    strategy = StrategyConfig("knapspec")

    engine = Engine(config, calibrator=calibrator)
    measured = engine.latency
    engine.generate_batch(prompts, strategy, 40, max_batch=2)  # at the device's own speed
    fit = engine.step_cost.cost
    before = fit.num_observed
    assert before >= batch_drafts.RECORD_FIRST  # kept once already
    slow_down(engine.model, SLOWDOWN_S, sublayers=("mlp",))
    engine.generate_batch(prompts, strategy, 40, max_batch=2)  # the same fit goes on
    table_error, fit_error = median_errors(fit, after=before + 32)
    assert table_error > 0.5 and fit_error < 0.15, (table_error, fit_error)

    stored = CalibrationStore(tmp_path).get(CalibrationKey.for_model(engine.model, engine.name))
    assert stored.latency == measured and stored.correction.steps == fit.num_observed
    assert stored.correction.cost == fit.current()

    following = Engine(config, calibrator=calibrator)
    assert following.latency == corrected_table(measured, stored.correction.cost) != measured
    slow_down(following.model, SLOWDOWN_S, sublayers=("mlp",))
    following.generate_batch(prompts, strategy, 40, max_batch=2)
    table_error, _ = median_errors(following.step_cost.cost, after=0)
    assert table_error < 0.2, table_error  # its table is the corrected one, from its first step
