"""profiling/: the least-squares fit, timers, microbenchmarks, the calibration store and jobs/calibrate.py.

No test asserts on wall time: timings are checked for shape, sign and finiteness only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.knapspec.latency import LatencyModel
from pipeline.model.linear import ComputeMode
from profiling import microbench
from profiling.calibration import CalibrationStore, store_calibrator
from profiling.fit import fit_linear, relative_rms
from profiling.record import (
    FORMAT_VERSION,
    Calibration,
    CalibrationFormatError,
    CalibrationKey,
    cpu_model_name,
    device_name,
)
from profiling.timer import (
    CudaEventTimer,
    Measurement,
    WallClockTimer,
    benchmark,
    benchmark_interleaved,
    timer_for,
)
from tests.builders import load_job, load_tiny

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "jobs" / "calibrate.py"
LENGTHS = (128, 512, 1024, 2048, 4096)


profile_cli = load_job("calibrate.py", "profile_cli")


# ------------------------------------------------------------------- fit


def test_fit_recovers_exact_line():
    a, b = 0.36e-6, 0.52e-3
    fit = fit_linear(LENGTHS, [a * n + b for n in LENGTHS])
    assert fit.slope == pytest.approx(a, rel=1e-9)
    assert fit.intercept == pytest.approx(b, rel=1e-9)
    assert fit.residual < 1e-9
    assert fit(8192) == pytest.approx(a * 8192 + b)


def test_fit_of_noisy_data_reports_its_noise():
    a, b = 0.36e-6, 0.52e-3
    rng = np.random.default_rng(0)
    lengths = np.repeat(LENGTHS, 4)
    times = (a * lengths + b) * (1 + 0.05 * rng.standard_normal(lengths.size))  # 5% noise
    fit = fit_linear(lengths, times)
    assert fit.slope == pytest.approx(a, rel=0.15)
    assert fit.intercept == pytest.approx(b, rel=0.3)
    assert 0.01 < fit.residual < 0.1


def test_fit_keeps_latencies_non_negative():
    # A flat, noisy curve must not fit a negative slope.
    falling = fit_linear([100, 200, 300], [1.2e-3, 1.1e-3, 1.0e-3])
    assert falling.slope == 0.0
    assert falling.intercept == pytest.approx(1.1e-3)
    # A line whose free fit crosses below zero at n = 0 goes through the origin instead.
    steep = fit_linear([100, 200, 300], [0.5e-3, 2.0e-3, 3.5e-3])
    assert steep.intercept == 0.0 and steep.slope > 0
    assert steep.residual > 0


def test_fit_of_one_context_is_a_constant():
    fit = fit_linear([512, 512], [1e-3, 3e-3])
    assert (fit.slope, fit.intercept) == (0.0, pytest.approx(2e-3))


def test_fit_rejects_bad_samples():
    for xs, ys in (([], []), ([1, 2], [1.0]), ([1, 2], [1.0, math.nan])):
        with pytest.raises(ValueError):
            fit_linear(xs, ys)


def test_relative_rms():
    assert relative_rms([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert relative_rms([1.1], [1.0]) == pytest.approx(0.1)
    assert relative_rms([2.0, 2.0], [1.0, 3.0]) == pytest.approx(0.5)


def test_verify_ratios_start_at_one_and_never_fall():
    assert microbench.verify_ratios([2.0, 2.2, 2.1, 3.0]) == (1.0, 1.1, 1.1, 1.5)
    with pytest.raises(ValueError):
        microbench.verify_ratios([0.0, 1.0])


# ----------------------------------------------------------------- timer


def test_timer_is_chosen_by_device_type():
    assert isinstance(timer_for("cpu"), WallClockTimer)
    assert isinstance(timer_for(torch.device("cpu")), WallClockTimer)
    # Building a CUDA timer must not touch CUDA: this runs on machines without it.
    cuda = timer_for("cuda:1")
    assert isinstance(cuda, CudaEventTimer)
    assert cuda.device == torch.device("cuda:1")
    with pytest.raises(ValueError):
        timer_for("meta")


class FakeEvent:
    log: list[str] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.stream = None

    def record(self, stream=None) -> None:
        self.stream = stream
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        FakeEvent.log.append("event-sync")

    def elapsed_time(self, end: FakeEvent) -> float:
        return 2.5  # milliseconds, as CUDA reports them


def test_cuda_timer_records_events_around_the_work(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: FakeEvent.log.append(f"sync {device}"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    seconds = CudaEventTimer(torch.device("cuda:0")).elapsed(lambda: FakeEvent.log.append("work"))
    assert seconds == pytest.approx(2.5e-3)
    assert FakeEvent.log == ["sync cuda:0", "record", "work", "record", "event-sync"]


def test_wall_clock_timer_synchronizes_around_the_work():
    log = []
    timer = WallClockTimer(synchronize=lambda: log.append("sync"))
    assert timer.elapsed(lambda: log.append("work")) >= 0
    assert log == ["sync", "work", "sync"]


class CountingTimer:
    def __init__(self, values):
        self.values = iter(values)

    def elapsed(self, fn):
        fn()
        return next(self.values)


def test_benchmark_warms_up_then_takes_the_median():
    calls = []
    result = benchmark(lambda: calls.append(1), CountingTimer([3.0, 1.0, 2.0]), repeats=3, warmup=2)
    assert len(calls) == 5
    assert result == Measurement((3.0, 1.0, 2.0))
    assert result.median == 2.0
    with pytest.raises(ValueError):
        benchmark(lambda: None, CountingTimer([]), repeats=0)


def test_interleaved_benchmark_runs_tasks_in_rounds():
    order = []
    tasks = {name: (lambda name=name: order.append(name)) for name in "ab"}
    result = benchmark_interleaved(tasks, CountingTimer([1.0, 10.0, 3.0, 30.0]), repeats=2, warmup=1)
    assert order == ["a", "b"] * 3
    assert result["a"].samples == (1.0, 3.0)
    assert result["b"].samples == (10.0, 30.0)


# ---------------------------------------------------------- calibration


def test_cpu_model_name_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n")
    assert cpu_model_name(cpuinfo) == "AMD EPYC 7B13"
    assert cpu_model_name(tmp_path / "missing")  # falls back to the platform module


def test_cpu_device_name_includes_the_thread_count():
    assert f"{torch.get_num_threads()} threads" in device_name("cpu")


def test_key_file_names_are_safe_and_distinct():
    key = CalibrationKey(device="NVIDIA H200", model="/models/Llama 3.1:70B", dtype="bf16", layout="pp4-tp2")
    name = key.file_name()
    assert name.endswith(".json") and "/" not in name and " " not in name and ":" not in name
    assert name.startswith("Llama-3.1-70B-bf16-pp4-tp2-NVIDIA-H200-")
    # Keys that slug alike still get different files.
    other = CalibrationKey(device="NVIDIA H200", model="/models/Llama 3.1 70B", dtype="bf16", layout="pp4-tp2")
    assert other.file_name() != name
    assert key.file_name() == name  # stable


def test_the_attention_route_is_part_of_a_key_and_the_matmuls_keep_their_old_names():
    matmul = CalibrationKey(device="cpu (2 threads)", model="smollm2", dtype="fp16w")
    # The name a key had before the route was part of it: tables measured then were the matmuls'.
    digest = hashlib.sha256("\0".join(["cpu (2 threads)", "smollm2", "fp16w", "pp1-tp1"]).encode()).hexdigest()[:12]
    assert matmul.file_name().endswith(f"-{digest}.json")
    kernel = dataclasses.replace(matmul, attention="kernel")
    assert kernel.file_name() != matmul.file_name() and "-fp16w-kernel-" in kernel.file_name()
    assert make_calibration(attention="kernel").key.attention == "kernel"


def test_a_calibration_from_before_the_route_is_the_matmuls():
    data = make_calibration().to_dict()
    del data["attention"]
    assert Calibration.from_dict(data).key.attention == "matmul"
    routed = make_calibration(attention="kernel")
    assert Calibration.from_dict(json.loads(json.dumps(routed.to_dict()))) == routed


def make_calibration(**overrides) -> Calibration:
    values = dict(
        latency=LatencyModel(
            attn_slope=0.36e-6,
            attn_base=0.5e-3,
            t_mlp=0.6e-3,
            t_fixed=3.7e-3,
            verify_ratios=(1.0, 1.05, 1.3),
            num_layers=30,
        ),
        device="Test CPU, 2 threads",
        model="smollm2-135m-instruct",
        dtype="fp16w",
        layout="pp1-tp1",
        num_threads=2,
        torch_version=torch.__version__,
        created_at=Calibration.now(),
        context_lengths=(128, 1024),
        t_attn_measured=(0.55e-3, 0.87e-3),
        reference_context=1024,
        t_verify_measured=(0.06, 0.063, 0.078),
        repeats=5,
        fit_residuals={"t_attn": 0.01, "t_forward": 0.2},
    )
    values.update(overrides)
    return Calibration(**values)


def test_calibration_json_round_trip(tmp_path):
    calibration = make_calibration()
    path = tmp_path / "sub" / "cal.json"
    calibration.save(path)
    assert json.loads(path.read_text())["format"] == FORMAT_VERSION
    assert Calibration.load(path) == calibration
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary file left behind


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(format=0),
        lambda d: d.pop("format"),
        lambda d: d.pop("latency"),
        lambda d: d["latency"].update(verify_ratios=[]),
        lambda d: d.update(extra=1),
        lambda d: d.update(t_attn_measured=[1.0]),
    ],
)
def test_calibration_rejects_other_formats(change):
    data = make_calibration().to_dict()
    change(data)
    with pytest.raises(CalibrationFormatError):
        Calibration.from_dict(data)


def fake_measure(calls: list):
    def measure(model, model_name="unknown", layout="pp1-tp1", **kwargs):
        calls.append(kwargs)
        return make_calibration(model=model_name, layout=layout, dtype=model.mode.value, device=device_name("cpu"))

    return measure


def fake_model(mode: ComputeMode = ComputeMode.FP16W):
    return SimpleNamespace(mode=mode, device=torch.device("cpu"), attention_route="matmul")


def test_the_store_folder_is_the_cache_s_unless_a_job_names_one(tmp_path):
    """The jobs read $KNAPSPEC_CALIBRATION_DIR (tests/jobs); the store itself never does."""
    assert CalibrationStore().root == Path.home() / ".cache" / "knapspec-ray" / "calibration"
    assert CalibrationStore(tmp_path / "shared").root == tmp_path / "shared"


def test_store_get_and_put(tmp_path):
    store = CalibrationStore(tmp_path)
    calibration = make_calibration()
    assert store.get(calibration.key) is None
    path = store.put(calibration)
    assert path.parent == tmp_path
    assert store.get(calibration.key) == calibration
    other_model = CalibrationKey(calibration.device, "another-model", calibration.dtype, calibration.layout)
    assert store.get(other_model) is None


def test_store_measures_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(microbench, "measure", fake_measure(calls))
    store = CalibrationStore(tmp_path)
    model = fake_model()
    key = CalibrationKey(device_name("cpu"), "tiny", "fp16w")
    first = store.load_or_measure(model, key, repeats=2)
    assert calls == [{"repeats": 2}]
    assert first.key == key
    second = store.load_or_measure(model, key, repeats=2)
    assert len(calls) == 1
    assert second == first
    store.load_or_measure(model, key, force=True)
    assert len(calls) == 2


def test_store_re_measures_a_corrupt_file(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(microbench, "measure", fake_measure(calls))
    store = CalibrationStore(tmp_path)
    key = CalibrationKey(device_name("cpu"), "tiny", "fp16w")
    tmp_path.joinpath(key.file_name()).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="profiling.calibration"):
        calibration = store.load_or_measure(fake_model(), key)
    assert len(calls) == 1
    assert "re-measured" in caplog.text
    assert store.get(key) == calibration


def test_store_re_measures_an_old_format(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(microbench, "measure", fake_measure(calls))
    store = CalibrationStore(tmp_path)
    key = CalibrationKey(device_name("cpu"), "tiny", "fp16w")
    old = make_calibration(device=key.device, model=key.model).to_dict()
    old["format"] = 0
    tmp_path.joinpath(key.file_name()).write_text(json.dumps(old))
    store.load_or_measure(fake_model(), key)
    assert len(calls) == 1


def test_store_refuses_a_key_of_another_dtype(tmp_path):
    key = CalibrationKey(device_name("cpu"), "tiny", "bf16")
    with pytest.raises(ValueError, match="dtype"):
        CalibrationStore(tmp_path).load_or_measure(fake_model(ComputeMode.FP32), key)


def test_store_refuses_a_key_of_another_attention_route(tmp_path):
    key = CalibrationKey(device_name("cpu"), "tiny", "fp16w", attention="kernel")
    with pytest.raises(ValueError, match="attention"):
        CalibrationStore(tmp_path).load_or_measure(fake_model(), key)


# -------------------------------------------------------------- measure


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    return load_tiny(tiny_llama)[1]


def test_measure_on_a_tiny_model(tiny_model, caplog):
    # 1000 is past the tiny model's 512-token context: dropped with a warning.
    with caplog.at_level(logging.WARNING, logger="profiling.microbench"):
        calibration = microbench.measure(
            tiny_model, context_lengths=(8, 200, 64, 1000), max_verify=3, repeats=1, model_name="tiny"
        )
    assert "1000" in caplog.text
    latency = calibration.latency
    assert calibration.context_lengths == (8, 64, 200)
    assert len(calibration.t_attn_measured) == 3
    assert calibration.reference_context == 64
    assert len(calibration.t_verify_measured) == 3
    assert latency.verify_ratios[0] == 1.0 and len(latency.verify_ratios) == 3
    assert list(latency.verify_ratios) == sorted(latency.verify_ratios)
    assert latency.num_layers == tiny_model.spec.num_layers
    positive = [*calibration.t_attn_measured, *calibration.t_verify_measured, latency.t_mlp, latency.t_fixed]
    assert all(math.isfinite(t) and t > 0 for t in positive)
    assert latency.attn_slope >= 0 and latency.attn_base >= 0 and latency.t_attn(64) > 0
    # One search on four branches costs no less than on one. (Strictly more, or more than a
    # forward, are timings of this machine compared with each other: on a tiny model a search's
    # cost per reference token can sit within the noise of a busy machine, and fit as zero.)
    assert latency.search_base >= 0 and latency.search_per_token >= 0
    assert latency.t_search(48, 64) >= latency.t_search(12, 64) > 0
    assert all(math.isfinite(r) and r >= 0 for r in calibration.fit_residuals.values())
    assert set(calibration.fit_residuals) == {"t_attn", "t_forward"}
    assert (calibration.model, calibration.dtype, calibration.layout) == ("tiny", "fp32", "pp1-tp1")
    assert calibration.attention == "matmul"  # fp32 never takes the kernel
    assert calibration.device == device_name(tiny_model.device)
    assert Calibration.from_dict(json.loads(json.dumps(calibration.to_dict()))) == calibration


def test_measure_limits_the_verify_context_to_the_model(tiny_model):
    calibration = microbench.measure(tiny_model, context_lengths=(510,), max_verify=4, repeats=1)
    # Room above it for the verify and for the search's reference tokens.
    assert calibration.reference_context == tiny_model.max_context - max(4, microbench.SEARCH_REFERENCE_TOKENS)
    with pytest.raises(ConfigError):
        microbench.measure(tiny_model, context_lengths=(600,), repeats=1)
    with pytest.raises(ConfigError):
        microbench.measure(tiny_model, context_lengths=(8,), max_verify=0, repeats=1)


def test_store_measures_a_real_model_once(tiny_model, tmp_path):
    store = CalibrationStore(tmp_path)
    key = CalibrationKey.for_model(tiny_model, "tiny")
    first = store.load_or_measure(tiny_model, key, context_lengths=(8, 32), max_verify=2, repeats=1)
    assert first.key == key
    assert store.load_or_measure(tiny_model, key) == first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_on_cuda(tiny_llama):
    from pipeline.model import checkpoint
    from pipeline.model.loading import model_from_tensors

    config = checkpoint.load_config(tiny_llama)
    model = model_from_tensors(config, checkpoint.read_tensors(tiny_llama), ComputeMode.BF16, "cuda")
    calibration = microbench.measure(model, context_lengths=(8, 64, 256), max_verify=3, repeats=2)
    assert calibration.device == torch.cuda.get_device_name(0)
    assert all(t > 0 for t in calibration.t_attn_measured + calibration.t_verify_measured)


# ------------------------------------------------------------------ CLI


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--context-lengths", "a,b"], "--context-lengths"),
        (["--context-lengths", "0,64"], "--context-lengths"),
        (["--repeats", "0"], "--repeats"),
        (["--dtype", "int4"], "--dtype"),
    ],
)
def test_cli_rejects_bad_arguments(args, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_cli.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and fragment in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cli_reports_a_missing_device_before_loading(capsys):
    assert profile_cli.main(["--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "CUDA is not available" in err


def test_cli_table_shows_fit_weights_and_ratios():
    table = profile_cli.format_table(make_calibration())
    assert "a = 0.3600 µs/token, b = 0.500 ms (residual 1.0%)" in table
    assert "| 128 | 0.550 |" in table
    assert "| 8192 | — |" in table  # weights shown beyond the measured contexts too
    assert "| ratio | 1.00 | 1.05 | 1.30 |" in table


@pytest.mark.slow
def test_cli_on_the_embedded_model(tmp_path):
    output = tmp_path / "cal.json"
    env = dict(os.environ)
    # One thread: steady beside other busy processes (see test_generate_cli.py).
    env.setdefault("OMP_NUM_THREADS", "1")
    args = ["--context-lengths", "64,256", "--repeats", "1", "--max-verify", "3"]
    args += ["--output", str(output), "--store", str(tmp_path / "store")]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    calibration = Calibration.load(output)
    assert calibration.context_lengths == (64, 256)
    assert calibration.latency.max_verify == 3
    assert calibration.latency.num_layers == 30
    assert [p.name for p in (tmp_path / "store").glob("*.json")] == [calibration.key.file_name()]
    assert "| ratio | 1.00 |" in proc.stdout


def test_an_engine_measures_once_and_again_when_forced(tiny_chat_checkpoint, tmp_path, monkeypatch):
    from pipeline.engine import Engine, EngineConfig

    calls = []
    real = microbench.measure
    monkeypatch.setattr(microbench, "measure", lambda *a, **k: calls.append(1) or real(*a, **k, repeats=1))
    config = EngineConfig(model=str(tiny_chat_checkpoint), dtype="fp32")
    calibrator = store_calibrator(tmp_path)
    engine = Engine(config, calibrator=calibrator)
    first = engine.latency
    assert engine.latency is first and len(calls) == 1
    assert Engine(config, calibrator=calibrator).latency == first and len(calls) == 1  # stored: a new engine reads it
    engine.calibrate(force=True)  # a machine whose load changed measures again
    assert len(calls) == 2 and Engine(config, calibrator=calibrator).latency == engine.latency
    with pytest.raises(ConfigError, match="calibrator"):
        Engine(config).latency  # neither a latency model nor a calibrator: say what to pass


def test_a_model_with_captured_steps_is_timed_as_it_replays_them(tiny_llama, monkeypatch):
    """Items as the replays of their own pieces, the embedding and head as theirs, a verify as a
    captured step (pipeline/model/graphs; on a CPU the pieces run eagerly); the table is stored
    under the captured route, apart from the eager one."""
    from pipeline.model.graphs import GraphSettings, StepGraphs

    model = load_tiny(tiny_llama)[1]
    model.use_graphs(GraphSettings(capture="eager"))
    replayed = []
    real = StepGraphs.replay
    monkeypatch.setattr(
        StepGraphs, "replay", lambda self, step, piece: (replayed.append(piece), real(self, step, piece))
    )
    calibration = microbench.measure(model, context_lengths=(8, 64, 200), max_verify=3, repeats=1, model_name="tiny")
    num_items = model.spec.num_items
    assert {((item, item + 1),) for item in range(num_items)} | {"embed", "head"} <= set(replayed)
    assert ((0, num_items),) in replayed  # the verify: one run of every item
    assert calibration.attention == model.attention_route == "captured matmul"
    positive = [*calibration.t_attn_measured, *calibration.t_verify_measured, calibration.latency.t_mlp]
    assert all(math.isfinite(t) and t > 0 for t in positive)
    assert CalibrationKey.for_model(model, "tiny") != CalibrationKey.for_model(load_tiny(tiny_llama)[1], "tiny")
