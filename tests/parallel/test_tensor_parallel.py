"""Tensor parallelism inside a stage: the slices cover each tensor, ranks read only theirs, and
T ranks summing their partial updates give the single-process logits and greedy tokens —
first with threads standing in for the all-reduce, then as Ray actors over Gloo."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipeline.decoding.drafters import NoDraft
from pipeline.errors import ConfigError
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.model import checkpoint
from pipeline.model.linear import ComputeMode
from pipeline.model.spec import ModelSpec
from pipeline.parallel.layout import StageLayout, stage_layouts
from pipeline.parallel.staged_model import PipelineModel, StageModel
from pipeline.parallel.tensor_parallel import check_tensor_parallel, shard_config, shard_rule, shard_tensor
from tests.builders import SEARCH_CONFIG, generate, load_tiny, make_tiny_checkpoint, random_prompt, synthetic_latency

FAMILIES = {
    "llama-bias": ("llama", {"attention_bias": True}),  # o_proj has a bias: added once, not T times
    "qwen3": ("qwen3", {}),  # q/k norms, head_dim != hidden / heads
    "qwen2": ("qwen2", {}),  # q/k/v biases only
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_path(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family, num_hidden_layers=4, **overrides)


def test_slices_cover_every_tensor(model_path):
    tensors = checkpoint.read_tensors(model_path)
    for name, full in tensors.items():
        parts = [shard_tensor(name, full, rank, 2) for rank in range(2)]
        rule = shard_rule(name)
        if rule == "rows":
            torch.testing.assert_close(torch.cat(parts, 0), full)
        elif rule == "columns":
            torch.testing.assert_close(torch.cat(parts, 1), full)
        elif rule == "shared_bias":
            torch.testing.assert_close(sum(parts), full)
        else:
            assert all(torch.equal(p, full) for p in parts), name


def test_a_rank_reads_only_its_share(model_path):
    config = checkpoint.load_config(model_path)
    layout = StageLayout(0, 1, 0, config.num_hidden_layers)
    whole = StageModel(model_path, layout, ComputeMode.FP32)
    ranks = [StageModel(model_path, layout, ComputeMode.FP32, tp_rank=r, tp_size=2) for r in range(2)]
    replicated = sum(
        t.numel() * t.element_size()
        for name, t in checkpoint.read_tensors(model_path).items()
        if shard_rule(name) in (None, "shared_bias")
    )
    split = whole.loaded_bytes - replicated
    for rank in ranks:
        assert rank.loaded_bytes == replicated + split // 2
        assert rank.local.spec.num_heads == whole.local.spec.num_heads // 2
        assert rank.local.spec.head_dim == whole.local.spec.head_dim


def test_sizes_that_do_not_divide_the_heads_are_refused(model_path):
    spec = ModelSpec.from_hf_config(checkpoint.load_config(model_path))
    with pytest.raises(ConfigError, match="does not divide"):
        check_tensor_parallel(spec, 3)
    with pytest.raises(ConfigError):
        shard_config(checkpoint.load_config(model_path), 3)


class ThreadGroup:
    """An all-reduce among threads in one process: what Gloo does among processes."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * size

    def reduce_for(self, rank: int):
        def reduce(partial: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = partial
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)  # the same order on every rank
            self.barrier.wait()
            return total

        return reduce


class ThreadedGroupLink:
    """A stage held by T in-process ranks, each call run on all of them at once (a thread per
    rank); rank 0's result is the stage's."""

    def __init__(self, ranks: list[StageModel]) -> None:
        self.ranks = ranks
        self.pool = ThreadPoolExecutor(len(ranks))

    def call(self, method: str, *args, num_returns: int = 1):
        futures = [self.pool.submit(getattr(rank, method), *args) for rank in self.ranks]
        return [f.result() for f in futures][0]

    def get(self, value):
        return value


def threaded_pipeline(path, num_stages: int, size: int) -> PipelineModel:
    config = checkpoint.load_config(path)
    spec = ModelSpec.from_hf_config(config)
    layouts = stage_layouts(spec.num_layers, num_stages)
    links = []
    for layout in layouts:
        group = ThreadGroup(size)
        ranks = [StageModel(path, layout, ComputeMode.FP32, tp_rank=r, tp_size=size) for r in range(size)]
        for r, rank in enumerate(ranks):
            rank.local.reduce = group.reduce_for(r)
        links.append(ThreadedGroupLink(ranks))
    last = links[-1].ranks[0].local
    return PipelineModel(links, layouts, spec, last.max_context, last.prefill_chunk)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_two_ranks_give_the_whole_models_logits_and_tokens(model_path, num_stages):
    _, whole = load_tiny(model_path)
    pipeline = threaded_pipeline(model_path, num_stages, 2)
    ids = random_prompt(0)
    cache, pcache = whole.new_cache(96), pipeline.new_cache(96)
    expected = whole.forward(cache, ids, 0, logits="all")
    got = pipeline.forward(pcache, ids, 0, logits="all")
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
    h = torch.randn(3, 4, whole.spec.hidden_size)
    for item in (0, 3, 6):  # attention and MLP branches of the DP
        torch.testing.assert_close(
            pipeline.run_item_branches(item, h, pcache, 48),
            whole.run_item_branches(item, h, cache, 48),
            rtol=1e-4,
            atol=1e-4,
        )
    reference = generate(whole, ids, NoDraft())
    assert generate(pipeline, ids, NoDraft()) == reference
    drafter = KnapSpecDrafter(synthetic_latency(whole.spec.num_layers, verify_growth=0.0), SEARCH_CONFIG)
    assert generate(pipeline, ids, drafter) == reference


def test_ranks_decode_a_batch_like_the_whole_model(model_path):
    """Packed rows of several requests through two stages of two ranks each (the partial sums
    all-reduced over the whole packed tensor): each request keeps its tokens."""
    from pipeline.decoding.loop import DecodeConfig
    from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
    from tests.builders import assert_same_or_near_tie

    _, whole = load_tiny(model_path)
    pipeline = threaded_pipeline(model_path, 2, 2)
    prompts = [random_prompt(seed, n) for seed, n in enumerate((30, 48, 12))]
    batcher = ContinuousBatcher(pipeline, max_batch=3, prefill_chunk=16)
    tickets = [batcher.submit(GenerationRequest(p, DecodeConfig(20))) for p in prompts]
    done = {finished.ticket: finished for finished in batcher.run()}
    for ticket, prompt in zip(tickets, prompts):
        assert_same_or_near_tie(whole, prompt, done[ticket].result.token_ids, generate(whole, prompt, NoDraft(), 20))


@pytest.fixture(scope="class")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
class TestGlooGroups:
    @pytest.mark.parametrize("num_stages", [1, 2])
    def test_ranks_as_actors_over_gloo(self, tmp_path, num_stages):
        """P stages × T = 2 ranks as Ray actors, all-reducing over Gloo: the logits of one
        process (allclose), and its greedy tokens for ar and knapspec."""
        import ray

        from actors.resources import stage_footprints_of
        from actors.shard import start_pipeline

        path = make_tiny_checkpoint(tmp_path / "model", "llama", num_hidden_layers=4, quiet_layers=(1, 2))
        _, whole = load_tiny(path)
        staged = start_pipeline(path, num_stages, ComputeMode.FP32, num_cpus=0.5, num_threads=1, tensor_parallel=2)
        try:
            assert [len(stage) for stage in staged.ranks] == [2] * num_stages
            table = ray.util.placement_group_table(staged.placement_group)
            # A group's ranks share a bundle: their CPUs and the memory each declares.
            memory = stage_footprints_of(path, num_stages, 2, ComputeMode.FP32, "cpu", 1, None)
            assert list(table["bundles"].values()) == [{"CPU": 1.0, "memory": 2.0 * f.peak} for f in memory]
            pipeline = staged.model
            ids = random_prompt(1)
            cache, pcache = whole.new_cache(96), pipeline.new_cache(96)
            torch.testing.assert_close(
                pipeline.forward(pcache, ids, 0).logits, whole.forward(cache, ids, 0).logits, rtol=1e-4, atol=1e-4
            )
            pipeline.free_all()
            reference = generate(whole, ids, NoDraft())
            assert generate(pipeline, ids, NoDraft()) == reference
            drafter = KnapSpecDrafter(synthetic_latency(whole.spec.num_layers, verify_growth=0.0), SEARCH_CONFIG)
            assert generate(pipeline, ids, drafter) == reference
        finally:
            staged.shutdown()


def test_groups_all_reduce_over_nccl_on_gpus_and_gloo_on_cpus():
    from pipeline.parallel.tensor_parallel import collective_backend

    assert collective_backend("cuda") == collective_backend("cuda:0") == "nccl"
    assert collective_backend("cpu") == "gloo"


@pytest.mark.ray
def test_a_lost_rank_restarts_its_replica_whole(tmp_path):
    """A tensor-parallel rank is not restarted in place (it could not rejoin its group): killing
    one mid-request ends the coordinator's process instead of hanging, Ray restarts it, and it
    forms its group anew and serves again (its callers send the lost request again: dispatch.py)."""
    import time

    import ray

    from actors.replica import PipelineReplica
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.engine import EngineConfig, StrategyConfig
    from tests.builders import make_tiny_chat_checkpoint

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=2)
        config = EngineConfig(model=str(model), dtype="fp32")
        coordinator = (
            ray.remote(PipelineReplica)
            .options(num_cpus=0, max_restarts=1, max_task_retries=0)
            .remote(config, StrategyConfig("ar"), 1, 0.5, 1, None, 2)
        )
        ids = torch.randint(300, 40000, (200,), generator=torch.Generator().manual_seed(4)).tolist()
        first_pid = ray.get(coordinator.ping.remote())
        rank = ray.get(coordinator.stage_handles.remote())[1]  # loaded, the group formed
        expected = ray.get(coordinator.generate.remote(ids, 8, SamplingParams()))["token_ids"]
        running = coordinator.generate.remote(ids, 2000, SamplingParams())  # about 30 s here
        time.sleep(1.0)
        ray.kill(rank)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(running, timeout=120)
        deadline = time.monotonic() + 120
        while True:
            try:
                pid = ray.get(coordinator.ping.remote(), timeout=60)
                break
            except ray.exceptions.ActorUnavailableError:  # restarting
                assert time.monotonic() < deadline, "the coordinator did not come back"
                time.sleep(0.2)
        assert pid != first_pid
        assert ray.get(coordinator.generate.remote(ids, 8, SamplingParams()), timeout=120)["token_ids"] == expected
        ray.get(coordinator.shutdown.remote())
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_requests_in_flight_share_a_group_without_deadlock(tmp_path):
    """Several requests at once through one coordinator (two lanes, batches of two) keep every
    rank's collectives in one order: all finish, each with the single-process tokens."""
    import ray

    from actors.replica import EngineReplica, PipelineReplica
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.engine import EngineConfig, StrategyConfig
    from tests.builders import make_tiny_chat_checkpoint

    model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=2)
    config = EngineConfig(model=str(model), dtype="fp32")
    prompts = [
        torch.randint(300, 40000, (60 + 20 * i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)
    ]
    single = EngineReplica(config, StrategyConfig("ar"), 1)
    expected = [single.generate(ids, 40, SamplingParams())["token_ids"] for ids in prompts]
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        coordinator = (
            ray.remote(PipelineReplica)
            .options(num_cpus=0, max_concurrency=3)
            .remote(config, StrategyConfig("ar"), 2, 0.5, 1, None, 2, 2)
        )
        running = [coordinator.generate.remote(ids, 40, SamplingParams()) for ids in prompts]
        assert [out["token_ids"] for out in ray.get(running, timeout=240)] == expected
        ray.get(coordinator.shutdown.remote())
    finally:
        ray.shutdown()
