"""Two Ray nodes on this machine (ray.cluster_utils.Cluster, each with its own resources), the
second one slower: a replica's stages land on both, each node's profiler calibrates its own
device, the knapsack skips more of the slow node's time, and the tokens are the
single-process model's. Placement errors name what the cluster lacks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.decoding.drafters import NoDraft
from pipeline.errors import ConfigError
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.model.linear import ComputeMode
from tests import slow_device
from tests.builders import (
    REPO,
    SEARCH_CONFIG,
    generate,
    load_tiny,
    make_tiny_checkpoint,
    random_prompt,
    weight_skipped_per_stage,
)

pytestmark = pytest.mark.ray

SLOW_NODE_DELAY_S = 1e-3  # per sublayer call; this tiny model's sublayers take well under that
MEASURE = {"context_lengths": (64, 256), "repeats": 5, "max_verify": SEARCH_CONFIG.max_draft + 1}


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    # The slow node's workers slow their models down (tests/slow_device.py) and name their device apart.
    slow = cluster.add_node(num_cpus=1, env_vars={slow_device.SLOW_DEVICE_ENV: str(SLOW_NODE_DELAY_S)})
    try:
        ray.init(address=cluster.address, runtime_env=slow_device.runtime_env())
        cluster.wait_for_nodes()
        yield cluster, slow.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def quiet_model(tmp_path_factory):
    # Every layer nearly redundant: agreement does not tell the stages apart, latency does.
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("quiet"), "llama", num_hidden_layers=8, quiet_layers=tuple(range(8))
    )


def test_stages_on_both_nodes_weighed_by_their_own_profiler(two_nodes, quiet_model, tmp_path):
    import ray

    from actors.profiler import PROFILER_NAME, calibrate_pipeline, start_profilers
    from actors.shard import start_pipeline

    _, slow_node = two_nodes
    profilers = start_profilers()  # as a job does: it owns them, replicas find them by name
    # One CPU per stage and per node: the PACK placement group has to use both nodes.
    staged = start_pipeline(quiet_model, 2, ComputeMode.FP32, num_cpus=1, num_threads=1)
    try:
        assert len(set(staged.node_ids)) == 2 and slow_node in staged.node_ids
        latency = calibrate_pipeline(staged, quiet_model, ComputeMode.FP32, "cpu", tmp_path / "store", 1, MEASURE)

        names = sorted(name for name in ray.util.list_named_actors() if name.startswith("knapspec-profiler-"))
        assert names == sorted(PROFILER_NAME.format(node_id=node["NodeID"]) for node in ray.nodes())
        assert sorted(ray.get([p.node.remote() for p in profilers.values()]), key=str) and len(profilers) == 2
        assert len(list((tmp_path / "store").glob("*layer-shapes*.json"))) == 2  # one table per device

        slow = staged.node_ids.index(slow_node)
        fast = 1 - slow
        assert latency.stages[slow].t_mlp > SLOW_NODE_DELAY_S > latency.stages[fast].t_mlp
        assert latency.t_hop > 0
        weights = latency.item_weights(256)
        stage_weight = [sum(weights[:8]), sum(weights[8:])]
        assert stage_weight[slow] > 1.5 * stage_weight[fast], weights

        model = staged.model
        skipped = weight_skipped_per_stage(model, weights)
        assert skipped[slow] > skipped[fast], (skipped, weights)

        # And decoding with that latency model gives the single-process tokens.
        _, whole = load_tiny(quiet_model)
        ids = random_prompt(6)
        assert generate(model, ids, KnapSpecDrafter(latency, SEARCH_CONFIG)) == generate(whole, ids, NoDraft())
    finally:
        staged.shutdown()


def test_placement_that_cannot_fit_names_the_missing_resources(two_nodes, quiet_model):
    from actors.shard import start_pipeline

    with pytest.raises(ConfigError, match=r"CPU 3 needed, 2 free of 2"):
        start_pipeline(quiet_model, 2, ComputeMode.FP32, num_cpus=1.5, start_timeout_s=3)
    # Enough CPUs in total, but no node holds a 2-CPU bundle.
    with pytest.raises(ConfigError, match=r"no node fits a bundle of CPU 2, memory \d+\.\d\d GiB"):
        start_pipeline(quiet_model, 1, ComputeMode.FP32, num_cpus=2, start_timeout_s=3)


def test_profile_job_calibrates_every_node(two_nodes, quiet_model, tmp_path):
    cluster, slow_node = two_nodes
    result = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "calibrate.py"), "--address", cluster.address, "--model", str(quiet_model),
         "--dtype", "fp32", "--context-lengths", "64,256", "--repeats", "3", "--max-verify", "3",
         "--store", str(tmp_path / "store"), "--quiet"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("# Node ") == 2 and f"# Node {slow_node[:8]}" in out
    assert "Per-hop latency" in out
    hop_rows = [line for line in out.splitlines() if line.startswith("| ") and len(line.split("|")) == 5]
    assert len(hop_rows) >= 2


def test_gpu_measurements_hold_a_gpu_on_their_node():
    """The CPU-visible half of the CUDA path: a GPU node's measurement is a task pinned to that
    node holding one GPU (an actor asking for none would not see the device)."""
    from actors.profiler import measurement_options

    options = measurement_options("cuda", "ab" * 28)
    assert options["num_gpus"] == 1 and options["scheduling_strategy"].node_id == "ab" * 28
    assert options["scheduling_strategy"].soft is False
    assert "num_gpus" not in measurement_options("cpu", "ab" * 28)


def test_stage_bundles_ask_a_gpu_per_stage_on_cuda():
    from actors.shard import stage_bundles

    assert stage_bundles(3, 0.5, "cpu") == [{"CPU": 0.5}] * 3
    # Each stage's memory per rank (actors.resources.stage_footprints_of), for all its ranks.
    assert stage_bundles(2, 0.5, "cpu", 2, memory=[100, 300]) == [{"CPU": 1.0, "memory": 200.0},
                                                                   {"CPU": 1.0, "memory": 600.0}]  # fmt: skip
    assert stage_bundles(2, 1, "cuda") == [{"CPU": 1, "GPU": 1.0}] * 2
    with pytest.raises(ConfigError):
        stage_bundles(2, 0, "cpu")
