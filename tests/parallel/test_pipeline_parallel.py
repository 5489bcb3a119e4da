"""Pipeline stages: each loads only its tensors, and decoding over P stages — in this process
or as Ray actors — gives the single-process model's logits and tokens for every strategy."""

from __future__ import annotations

import time

import pytest
import torch

from pipeline.decoding.drafters import LayerSkipDrafter, NoDraft
from pipeline.decoding.loop import DecodeConfig
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.errors import ConfigError
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.knapspec.knapsack import KnapsackProblem, run_knapsack
from pipeline.model import checkpoint
from pipeline.model.linear import ComputeMode
from pipeline.parallel.layout import StageLayout, partition_layers
from pipeline.parallel.staged_model import PipelineModel, StageModel
from tests.builders import (
    SAMPLE_DOCS,
    SEARCH_CONFIG,
    assert_same_or_near_tie,
    generate,
    load_tiny,
    make_tiny_chat_checkpoint,
    make_tiny_checkpoint,
    mixed_drafters,
    random_prompt,
    repeating_prompt,
    synthetic_latency,
    weight_skipped_per_stage,
)
from tests.slow_device import slow_down, slowed


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    """Six layers, two of them quiet, so that drafts skipping them agree with the full model."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("six"), "llama", num_hidden_layers=6, quiet_layers=(2, 3))


def test_partition_is_contiguous_and_even():
    assert partition_layers(30, 1) == [(0, 30)]
    assert partition_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert partition_layers(6, 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ConfigError):
        partition_layers(4, 5)


def test_a_stage_reads_only_its_own_tensors(six_layers):
    total = sum(f.stat().st_size for f in six_layers.glob("*.safetensors"))
    stages = [StageModel(six_layers, StageLayout(i, 3, 2 * i, 2 * i + 2), ComputeMode.FP32) for i in range(3)]
    middle = stages[1].loaded_bytes
    assert middle < 0.4 * total, (middle, total)  # a third of the layers, no embeddings or head
    assert stages[0].loaded_bytes > middle and stages[2].loaded_bytes > middle
    assert sum(s.loaded_bytes for s in stages) == pytest.approx(total, rel=0.01)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_pipeline_forward_matches_the_whole_model(six_layers, num_stages):
    _, whole = load_tiny(six_layers)
    pipeline = PipelineModel.local(six_layers, num_stages, ComputeMode.FP32)
    ids = random_prompt(0)
    cache, pcache = whole.new_cache(64), pipeline.new_cache(64)
    expected = whole.forward(cache, ids, 0, logits="all", return_hidden=True)
    got = pipeline.forward(pcache, ids, 0, logits="all", return_hidden=True)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.hidden_states, expected.hidden_states, rtol=1e-5, atol=1e-5)
    # Then a skipping draft forward of two tokens on top of the cache.
    more = random_prompt(1, 2)
    expected = whole.forward(cache, more, 48, skip={2, 5, 7})
    got = pipeline.forward(pcache, more, 48, skip={2, 5, 7})
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    h = torch.randn(3, 4, whole.spec.hidden_size)
    for item in (0, 5, 11):
        torch.testing.assert_close(
            pipeline.run_item_branches(item, h, pcache, 48), whole.run_item_branches(item, h, cache, 48)
        )


def knapsack_problem(layer_rows: bool, num_layers: int = 6) -> KnapsackProblem:
    num_rows = num_layers if layer_rows else 2 * num_layers
    return KnapsackProblem(weights=(1, 2) * (num_rows // 2), budget=num_rows, threshold=-1.0, max_branches=5)


def assert_same_frontier(got, expected):
    assert (got.weights, got.skips, got.next_item) == (expected.weights, expected.skips, expected.next_item)
    torch.testing.assert_close(torch.tensor(got.scores), torch.tensor(expected.scores), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.hidden, expected.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("layer_rows", [False, True])
def test_the_dp_runs_on_each_stage_on_a_frontier_passed_along(six_layers, num_stages, layer_rows, monkeypatch):
    """Each stage runs its own rows on the frontier the previous one hands it, one call per
    stage, and the result is the whole model's DP."""
    _, whole = load_tiny(six_layers)
    pipeline = PipelineModel.local(six_layers, num_stages, ComputeMode.FP32)
    ids = random_prompt(4, 56)
    cache, pcache = whole.new_cache(64), pipeline.new_cache(64)
    whole.prefill(cache, ids[:48])
    pipeline.prefill(pcache, ids[:48])
    calls = []
    for link in pipeline.links:
        monkeypatch.setattr(
            link, "call", lambda method, *a, _call=link.call, **k: calls.append(method) or _call(method, *a, **k)
        )

    problem = knapsack_problem(layer_rows)
    got = pipeline.run_knapsack(pcache, ids[48:], problem, 48, layer_rows)
    assert calls == ["knapsack_rows"] * num_stages
    assert_same_frontier(got, run_knapsack(whole, cache, ids[48:], problem, 48, layer_rows))


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("strategy", ["ar", "static", "knapspec"])
def test_greedy_tokens_equal_the_single_process_engine(six_layers, num_stages, strategy):
    _, whole = load_tiny(six_layers)
    pipeline = PipelineModel.local(six_layers, num_stages, ComputeMode.FP32)

    def drafter():
        if strategy == "static":
            return LayerSkipDrafter((4, 5, 6, 7), whole.spec.num_items, max_draft=3)
        if strategy == "knapspec":
            return KnapSpecDrafter(synthetic_latency(whole.spec.num_layers, verify_growth=0.0), SEARCH_CONFIG)
        return NoDraft()

    for seed in (0, 1):
        ids = random_prompt(seed)
        reference = generate(whole, ids, NoDraft())
        assert generate(pipeline, ids, drafter()) == reference


@pytest.mark.parametrize("num_stages", [2, 3])
def test_batches_through_stages_keep_each_requests_tokens(six_layers, num_stages):
    """Continuous batching over stages: packed rows go from stage to stage, requests join and
    leave, and each request's tokens are the whole model's alone; a request that leaves frees
    its caches on every stage."""
    _, whole = load_tiny(six_layers)
    pipeline = PipelineModel.local(six_layers, num_stages, ComputeMode.FP32)
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((5, 70, 33, 2, 50))]
    limits = [30, 12, 25, 1, 18]
    batcher = ContinuousBatcher(pipeline, max_batch=3, prefill_chunk=16)
    tickets = [
        batcher.submit(GenerationRequest(p, DecodeConfig(m), SamplingParams(), d))
        for p, m, d in zip(prompts, limits, mixed_drafters(whole))
    ]
    done = {finished.ticket: finished for finished in batcher.run()}
    for ticket, prompt, limit in zip(tickets, prompts, limits):
        assert done[ticket].error is None, done[ticket].error
        expected = generate(whole, prompt, NoDraft(), max_new=limit)
        assert_same_or_near_tie(whole, prompt, done[ticket].result.token_ids, expected)
    assert all(link.stage.caches == {} for link in pipeline.links)


def test_a_stage_whose_items_are_all_skipped_is_bypassed(six_layers):
    pipeline = PipelineModel.local(six_layers, 3, ComputeMode.FP32)
    cache = pipeline.new_cache(64)
    pipeline.forward(cache, random_prompt(0), 0)
    hops = pipeline.hops
    pipeline.forward(cache, random_prompt(1, 1), 48, skip={4, 5, 6, 7})  # the whole middle stage
    assert pipeline.hops - hops == 1  # stage 0 -> stage 2 only
    pipeline.forward(cache, random_prompt(2, 1), 49, skip={4})
    assert pipeline.hops - hops == 3


@pytest.fixture(scope="class")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False)  # on 127.0.0.1: see conftest
    yield
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
class TestRayStages:
    @pytest.mark.parametrize("num_stages", [1, 2, 3])
    def test_greedy_tokens_through_shard_actors(self, six_layers, num_stages):
        import ray

        from actors.resources import stage_footprints_of
        from actors.shard import start_pipeline

        _, whole = load_tiny(six_layers)
        staged = start_pipeline(six_layers, num_stages, ComputeMode.FP32, num_cpus=0.5, num_threads=1)
        pipeline, handles = staged.model, staged.handles
        try:
            for strategy in ("ar", "knapspec"):
                drafter = (
                    NoDraft()
                    if strategy == "ar"
                    else KnapSpecDrafter(synthetic_latency(whole.spec.num_layers, verify_growth=0.0), SEARCH_CONFIG)
                )
                ids = random_prompt(3)
                assert generate(pipeline, ids, drafter) == generate(whole, ids, NoDraft()), strategy
            # The DP through the actors: frontiers go from stage to stage as object refs.
            cache, pcache = whole.new_cache(64), pipeline.new_cache(64)
            whole.prefill(cache, ids[:40])
            pipeline.prefill(pcache, ids[:40])
            problem = knapsack_problem(layer_rows=False)
            assert_same_frontier(
                pipeline.run_knapsack(pcache, ids[40:48], problem, 40),
                run_knapsack(whole, cache, ids[40:48], problem, 40),
            )
            infos = ray.get([h.info.remote() for h in handles])
            assert [i["layers"] for i in infos] == [tuple(r) for r in partition_layers(6, num_stages)]
            table = ray.util.placement_group_table(staged.placement_group)
            assert table["state"] == "CREATED" and table["strategy"] == "PACK"
            # Each stage reserves the memory its actor declares: its layers and one request's caches.
            memory = stage_footprints_of(six_layers, num_stages, 1, ComputeMode.FP32, "cpu", 1, None)
            assert list(table["bundles"].values()) == [{"CPU": 0.5, "memory": float(f.peak)} for f in memory]
            assert memory[0].weights != memory[-1].weights or num_stages == 1  # the embedding, the head
        finally:
            staged.shutdown()
        assert ray.util.placement_group_table(staged.placement_group)["state"] == "REMOVED"

    def test_a_killed_stage_does_not_change_the_output(self, tmp_path):
        """Kill a stage actor while six requests run in batches (two per stage in flight): Ray
        restarts it (without its caches), the coordinator runs the interrupted requests again
        from the start, and the tokens are those of an undisturbed run."""
        import ray

        from actors.replica import PipelineReplica
        from pipeline.engine import EngineConfig, StrategyConfig

        model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=6)
        config = EngineConfig(model=str(model), dtype="fp32")
        new_tokens = 80  # a few seconds of batches through three stages: the kill lands mid-run
        coordinator = (
            ray.remote(PipelineReplica)
            .options(num_cpus=0, max_concurrency=8)
            .remote(config, StrategyConfig("static", skip=(4, 5, 6, 7)), 3, 0.5, 1, None, 1, 2)
        )
        prompts = [
            torch.randint(300, 40000, (150 + 10 * i,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(6)
        ]
        expected = [
            ray.get(coordinator.generate.remote(ids, new_tokens, SamplingParams()))["token_ids"] for ids in prompts
        ]
        assert all(len(tokens) == new_tokens for tokens in expected)
        middle = ray.get(coordinator.stage_handles.remote())[1]
        running = [coordinator.generate.remote(ids, new_tokens, SamplingParams()) for ids in prompts]
        time.sleep(0.5)
        ray.kill(middle, no_restart=False)
        assert [out["token_ids"] for out in ray.get(running)] == expected
        assert ray.get(coordinator.info.remote())["retried_requests"] >= 1  # the kill did interrupt them
        assert ray.get(middle.info.remote())["layers"] == (2, 4)  # restarted, same layers
        ray.get(coordinator.shutdown.remote())
        ray.kill(coordinator)

    def test_knapspec_replica_calibrates_its_stages(self, tmp_path):
        """A pipelined knapspec replica times each stage on its own actor (and the hop), then
        gives the tokens of plain decoding in one process."""
        import ray

        from actors.replica import EngineReplica, PipelineReplica
        from pipeline.engine import EngineConfig, StrategyConfig

        model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=6)
        config = EngineConfig(model=str(model), dtype="fp32", calibration_dir=tmp_path / "store")
        ids = torch.randint(300, 40000, (120,), generator=torch.Generator().manual_seed(6)).tolist()
        single = EngineReplica(config, StrategyConfig("ar"), 1)
        expected = single.generate(ids, 40, SamplingParams())["token_ids"]
        coordinator = (
            ray.remote(PipelineReplica).options(num_cpus=0).remote(config, StrategyConfig("knapspec"), 2, 0.5, 1)
        )
        try:
            assert ray.get(coordinator.generate.remote(ids, 40, SamplingParams()))["token_ids"] == expected
        finally:
            ray.get(coordinator.shutdown.remote())
            ray.kill(coordinator)
        # The stages and their placement group are gone (Ray frees resources asynchronously).
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]
        # Both stages on this one node: one table of its device, from its profiler.
        stored = [p.name for p in (tmp_path / "store").glob("*.json")]
        assert len(stored) == 1 and "layer-shapes" in stored[0], stored

    @pytest.mark.slow
    def test_real_model_on_a_sample_document(self, calibration_store):
        """SmolLM2 in two stage actors: ar and knapspec give the single-process tokens on real text."""
        import json

        from actors.shard import start_pipeline
        from pipeline.engine import Engine, EngineConfig, StrategyConfig
        from pipeline.summarization.prompts import build_prompt
        from profiling.calibration import store_calibrator

        engine = Engine(EngineConfig(dtype="fp32"), calibrator=store_calibrator(calibration_store))
        doc = next(json.loads(line) for line in SAMPLE_DOCS.open() if "crs-r48179" in line)
        ids = build_prompt(engine.tokenizer, doc["text"], max_prompt_tokens=600).token_ids
        reference = engine.generate(ids, StrategyConfig("ar"), 24).token_ids
        path = checkpoint.resolve_checkpoint(None)
        staged = start_pipeline(path, 2, ComputeMode.FP32, num_cpus=1, num_threads=1)
        try:
            assert generate(staged.model, ids, NoDraft(), max_new=24) == reference
            drafter = KnapSpecDrafter(engine.latency, SEARCH_CONFIG)
            assert generate(staged.model, ids, drafter, max_new=24) == reference
        finally:
            staged.shutdown()


@pytest.mark.ray
def test_generate_cli_through_pipeline_stages(tmp_path):
    """jobs/generate.py --pipeline-parallel 3, and 2 stages × 2 tensor-parallel ranks with
    knapspec (profiled per node, hop measured), print the tokens of the single-process run."""
    import json
    import subprocess
    import sys

    from tests.builders import REPO

    model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=6)

    def run(*extra):
        result = subprocess.run(
            [
                sys.executable,
                str(REPO / "jobs" / "generate.py"),
                "--input",
                str(SAMPLE_DOCS),
                "--id",
                "crs-r48179",
                "--model",
                str(model),
                "--max-context",
                "300",
                "--max-new-tokens",
                "12",
                "--dtype",
                "fp32",
                "--json",
                "--quiet",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)["token_ids"]

    single = run()
    assert run("--pipeline-parallel", "3") == single
    assert run("--pipeline-parallel", "2", "--tensor-parallel", "2", "--strategy", "knapspec") == single


@pytest.mark.parametrize("slow", [0, 1])
def test_a_slower_stage_gets_more_of_its_items_skipped(tmp_path, slow):
    """Heterogeneous devices: stage `slow` waits 1 ms in every sublayer (a slower device, which its
    device's profile measures: this tiny model's sublayers take well under 1 ms here); its items
    weigh more, and the knapsack skips more of its time than of the fast stage's."""
    from profiling.device_profile import device_calibration, stage_table

    # Every layer nearly redundant: agreement does not tell the stages apart, latency does.
    path = make_tiny_checkpoint(tmp_path / "model", "llama", num_hidden_layers=8, quiet_layers=tuple(range(8)))
    fast = 1 - slow
    delays = [1e-3 if k == slow else 0.0 for k in range(2)]
    pipeline = PipelineModel.local(path, 2, ComputeMode.FP32)
    slow_down(pipeline.links[slow].stage.local, delays[slow])
    measure = {"context_lengths": (64, 256), "repeats": 5, "max_verify": 4}
    config = checkpoint.load_config(path)
    tables = []
    for d in delays:
        with slowed(d):  # the slowed CPU is named apart: the two tables are stored apart
            calibration = device_calibration(config, "tiny", ComputeMode.FP32, "cpu", tmp_path / "store", **measure)
        tables.append(calibration.latency)
    latency = pipeline.calibrate([stage_table(t, 4, has_head=k == 1) for k, t in enumerate(tables)])
    weights = latency.item_weights(256)
    stage_weight = [sum(weights[:8]), sum(weights[8:])]
    assert stage_weight[slow] > 1.5 * stage_weight[fast], weights
    assert latency.stages[slow].t_mlp > 1e-3 > latency.stages[fast].t_mlp

    skipped = weight_skipped_per_stage(pipeline, weights)
    assert skipped[slow] > skipped[fast], (skipped, weights)
