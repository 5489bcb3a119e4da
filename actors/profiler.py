"""One ProfilerActor per node: it calibrates that node's devices for a model's layer shapes.

Stages take their items' weights from the table of the device they run on, so a replica
whose stages span a fast and a slow node skips more of the slow node's items. A profiler
times a model with the checkpoint's layer shapes and random weights (profiling/
device_profile.py): it reads no checkpoint. Tables are cached in the actor and in the
node's calibration store, keyed by device name, model, dtype and thread count, so every
replica on a node reuses one measurement.

On a GPU node the measurement runs as a task holding one GPU on that node (Ray hides the
GPUs from an actor that asks for none), so calibrate before the stages take every GPU;
the store then serves later replicas without one.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.knapspec.latency import PipelineLatency
from pipeline.model.linear import ComputeMode
from profiling.record import Calibration

logger = logging.getLogger(__name__)

PROFILER_NAME = "knapspec-profiler-{node_id}"


def measure_device(
    path: str,
    mode: str,
    device: str,
    store_dir: str | None,
    num_threads: int | None,
    measure_kwargs: dict,
    tensor_parallel: int = 1,
) -> Calibration:
    """This process's device's calibration for the checkpoint's layer shapes (stored or measured);
    with tensor parallelism, for one rank's share of them."""
    import torch

    from pipeline.model import checkpoint
    from pipeline.parallel.tensor_parallel import shard_config
    from profiling.device_profile import device_calibration

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    config = shard_config(checkpoint.load_config(Path(path)), tensor_parallel)
    return device_calibration(
        config,
        Path(path).name + (f"-tp{tensor_parallel}" if tensor_parallel > 1 else ""),
        ComputeMode(mode),
        device,
        Path(store_dir) if store_dir else None,
        **measure_kwargs,
    )


def measurement_options(device: str, node_id: str) -> dict:
    """Ray options of a measurement on `node_id`: on a GPU, a task holding one of its GPUs."""
    options: dict = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
    if device.startswith("cuda"):
        options.update(num_gpus=1, num_cpus=0)
    else:
        options.update(num_cpus=0)
    return options


class ProfilerActor:
    """Calibrates the devices of the node it is pinned to (see start_profilers)."""

    def __init__(self) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self.calibrations: dict[tuple, Calibration] = {}

    def node(self) -> dict:
        from profiling.record import cpu_model_name

        return {"node_id": self.node_id, "cpu": cpu_model_name(), "resources": _node_resources(self.node_id)}

    def calibrate(
        self,
        path: str,
        mode: str,
        device: str = "cpu",
        num_threads: int | None = None,
        measure_kwargs: dict | None = None,
        store_dir: str | None = None,
        tensor_parallel: int = 1,
    ) -> Calibration:
        """The per-layer calibration of this node's `device` for the checkpoint at `path`
        (stored in `store_dir`, default the node's cache); for one rank's share with tensor
        parallelism (the all-reduces are not in it)."""
        measure_kwargs = measure_kwargs or {}
        key = (path, mode, device, num_threads, tuple(sorted(measure_kwargs.items())), store_dir, tensor_parallel)
        if key not in self.calibrations:
            args = (path, mode, device, store_dir, num_threads, measure_kwargs, tensor_parallel)
            if device.startswith("cuda"):
                task = ray.remote(measure_device).options(**measurement_options(device, self.node_id))
                self.calibrations[key] = ray.get(task.remote(*args))
            else:
                self.calibrations[key] = measure_device(*args)
        return self.calibrations[key]

    def echo(self, value):
        return value

    def hop_to(self, other, hidden_size: int, rounds: int = 30) -> float:
        """Median seconds of one hidden state [1, d] to `other` (an actor with `echo`, never
        this one: it would wait on itself) and back."""
        import torch

        probe = torch.zeros(1, hidden_size)
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            ray.get(other.echo.remote(probe))
            times.append(time.perf_counter() - started)
        return statistics.median(times)


class EchoActor:
    """The far end of a hop measured within one node."""

    def echo(self, value):
        return value


def echo_on(node_id: str):
    return ray.remote(EchoActor).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    ).remote()


def _node_resources(node_id: str) -> dict:
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return {k: v for k, v in node["Resources"].items() if not k.startswith("node:")}
    return {}


def start_profilers() -> dict[str, object]:
    """A ProfilerActor on every alive node, by node id. They are named, so replicas share them;
    one that does not exist yet is started, and lives while its starter holds a handle (a
    job keeps them for its duration; see ReplicaPool)."""
    actor = ray.remote(ProfilerActor)
    handles = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        node_id = node["NodeID"]
        handles[node_id] = actor.options(
            name=PROFILER_NAME.format(node_id=node_id),
            get_if_exists=True,
            num_cpus=0,
            max_restarts=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote()
    return handles


def calibrate_pipeline(
    ray_pipeline,
    path: Path,
    mode: ComputeMode,
    device: str = "cpu",
    store_dir: Path | None = None,
    num_threads: int | None = None,
    measure_kwargs: dict | None = None,
    tensor_parallel: int = 1,
) -> PipelineLatency:
    """A replica's latency model: each stage's table from the profiler of its own node, and
    the hop measured through the stages."""
    from profiling.device_profile import stage_table

    profilers = start_profilers()
    nodes = sorted(set(ray_pipeline.node_ids))
    missing = [n for n in nodes if n not in profilers]
    if missing:
        raise RuntimeError(f"no profiler on node(s) {missing}: they are not alive")
    futures = {
        node: profilers[node].calibrate.remote(
            str(path), mode.value, device, num_threads, measure_kwargs, str(store_dir) if store_dir else None,
            tensor_parallel,
        )
        for node in nodes
    }
    tables = {node: calibration.latency for node, calibration in zip(futures, ray.get(list(futures.values())))}
    stage_tables = [
        stage_table(tables[node], layout.end_layer - layout.first_layer, layout.has_head)
        for node, layout in zip(ray_pipeline.node_ids, ray_pipeline.model.layouts)
    ]
    latency = ray_pipeline.model.calibrate(stage_tables)
    logger.info(
        "Calibrated %d stage(s) on %d node(s); hop %.2f ms", len(stage_tables), len(nodes), latency.t_hop * 1e3
    )
    return latency
