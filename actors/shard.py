"""Pipeline stages as Ray actors: a ShardActor holds one StageModel, a RayLink reaches it.

A forward over the pipeline submits stage k+1's call with stage k's result as an object
reference, so Ray moves the hidden states from actor to actor without a round trip
through the coordinator; only the last stage's output is waited for.

A replica's stages are placed by one placement group (a bundle per stage, PACK: on as few
nodes as their resources allow), created with a timeout and an error that names what the
cluster lacks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.resources import stage_footprints_of
from pipeline.errors import ConfigError
from pipeline.model.context import max_context_of, prefill_chunk_for
from pipeline.model.linear import ComputeMode
from pipeline.model.spec import ModelSpec
from pipeline.parallel.layout import StageLayout, stage_layouts
from pipeline.parallel.staged_model import PipelineModel, StageModel
from pipeline.parallel.tensor_parallel import check_tensor_parallel

logger = logging.getLogger(__name__)

# A stage that dies is restarted (it reloads its layers). Its requests' caches are gone
# then; the coordinator's retry re-prefills them. A tensor-parallel rank is not restarted:
# it could not rejoin its group's collectives, so its replica fails instead.
MAX_RESTARTS = 2
# A collective that waits longer than this on a rank has lost that rank.
TENSOR_PARALLEL_TIMEOUT_S = 60.0
# Methods that run collectives: every rank of a group must run them, in the same order.
_COLLECTIVE_METHODS = frozenset({"forward", "run_item_branches", "knapsack_rows"})
# Methods that change per-request state every rank keeps.
_STATE_METHODS = frozenset({"new_cache", "free", "copy_cache"})


class ShardActor:
    """One pipeline stage in one worker process (wrapped by `ray.remote` in start_pipeline)."""

    def __init__(
        self,
        path: str,
        layout: StageLayout,
        mode: str,
        device: str,
        num_threads: int | None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        import torch

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        started = time.perf_counter()
        self.stage = StageModel(Path(path), layout, ComputeMode(mode), device, tp_rank=tp_rank, tp_size=tp_size)
        self.device = device
        self.load_s = time.perf_counter() - started

    def info(self) -> dict:
        layout = self.stage.layout
        return {
            "stage": layout.index,
            "tp_rank": self.stage.tp_rank,
            "layers": (layout.first_layer, layout.end_layer),
            "loaded_bytes": self.stage.loaded_bytes,
            "load_s": self.load_s,
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def tensor_parallel_endpoint(self) -> tuple[str, int]:
        """Where the group's rank 0 listens for the others: this node's address and a free port."""
        import socket

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_tensor_parallel(self, address: str, port: int) -> None:
        """Join the stage's group (Gloo on CPU, NCCL on GPU); partial sums are all-reduced from now on."""
        from datetime import timedelta

        import torch.distributed as dist

        from pipeline.parallel.tensor_parallel import all_reduce_sum, collective_backend

        dist.init_process_group(
            backend=collective_backend(self.device),
            init_method=f"tcp://{address}:{port}",
            rank=self.stage.tp_rank,
            world_size=self.stage.tp_size,
            timeout=timedelta(seconds=TENSOR_PARALLEL_TIMEOUT_S),
        )
        self.stage.local.reduce = all_reduce_sum


class RayLink:
    """Reaches a ShardActor; results stay object references until someone gets them."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def call(self, method: str, *args: Any, num_returns: int = 1) -> Any:
        return getattr(self.handle, method).options(num_returns=num_returns).remote(*args)

    def get(self, value: Any) -> Any:
        return ray.get(value) if isinstance(value, ray.ObjectRef) else value


class TensorParallelLink(RayLink):
    """Reaches a stage held by a tensor-parallel group of ShardActors.

    Collective calls go to every rank and are submitted under one lock: Ray runs an actor's
    calls from one process in submission order, so every rank sees the same sequence of
    collectives even when several requests (threads) use the pipeline at once. All ranks end
    with the same result; the next stage takes rank 0's. Calls without collectives that only
    read (embed, logits, echo) go to rank 0 alone.
    """

    _lock = threading.Lock()  # one per process: a stage's calls may come from any thread

    def __init__(self, handles: list) -> None:
        super().__init__(handles[0])
        self.handles = list(handles)

    def call(self, method: str, *args: Any, num_returns: int = 1) -> Any:
        if method not in _COLLECTIVE_METHODS and method not in _STATE_METHODS:
            return super().call(method, *args, num_returns=num_returns)
        with self._lock:
            results = [
                getattr(handle, method).options(num_returns=num_returns).remote(*args) for handle in self.handles
            ]
        return results[0]


_STAGE_METHODS = (
    "forward", "new_cache", "free", "copy_cache", "embed_tokens", "logits",
    "run_item_branches", "knapsack_rows", "echo",
)


def _actor_class():
    """ShardActor with its stage methods spelled out: Ray exposes only methods defined on the class."""

    def delegate(name):
        def method(self, *args):
            return getattr(self.stage, name)(*args)

        method.__name__ = name
        return method

    namespace = {name: delegate(name) for name in _STAGE_METHODS}
    return type("ShardActor", (ShardActor,), namespace)


@dataclass
class RayPipeline:
    """A replica's stages on Ray: the model the coordinator drives, the actors, their placement."""

    model: PipelineModel
    handles: list
    placement_group: Any
    node_ids: list[str]  # stage k's node
    owns_group: bool = True  # reserved by start_pipeline (else the caller's, who removes it)
    ranks: list[list] | None = None  # stage k's tensor-parallel group (one actor without TP)

    def shutdown(self) -> None:
        for handle in self.handles:
            ray.kill(handle)
        if self.owns_group:
            remove_placement_group(self.placement_group)


def stage_bundles(
    num_stages: int, num_cpus: float, device: str, tensor_parallel: int = 1, memory: Sequence[int] | None = None
) -> list[dict[str, float]]:
    """One bundle per stage, for all its tensor-parallel ranks (a bundle lies on one node, so a
    group's all-reduces never cross nodes): `num_cpus` per rank, on a GPU one per rank, and
    `memory[stage]` bytes per rank (stage_footprints_of)."""
    bundle = {"CPU": num_cpus * tensor_parallel} if num_cpus > 0 else {}
    if device.startswith("cuda"):
        bundle["GPU"] = float(tensor_parallel)
    if not bundle:
        raise ConfigError("a pipeline stage must ask for some CPU or a GPU")
    bundles = [dict(bundle) for _ in range(num_stages)]
    for stage, size in enumerate(memory or ()):
        bundles[stage]["memory"] = float(size * tensor_parallel)
    return bundles


def reserve(bundles: list[dict[str, float]], strategy: str, timeout_s: float, what: str):
    """A ready placement group for `bundles`, or a ConfigError naming what the cluster lacks."""
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready:
        return group
    remove_placement_group(group)
    raise ConfigError(f"{what} could not be placed within {timeout_s:.0f} s: {missing_resources(bundles)}")


def missing_resources(bundles: list[dict[str, float]]) -> str:
    """Which resources the bundles need beyond what the cluster has free, in words."""
    needed: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount
    free, total = ray.available_resources(), ray.cluster_resources()
    short = [
        f"{name} {_amount(name, amount)} needed, {_amount(name, free.get(name, 0.0))} free of "
        f"{_amount(name, total.get(name, 0.0))}"
        for name, amount in sorted(needed.items())
        if free.get(name, 0.0) < amount
    ]
    if short:
        return "; ".join(short)
    # The most a bundle asks of each resource: what some node must hold at once.
    largest = {name: max(b.get(name, 0.0) for b in bundles) for name in needed}
    return (
        f"the cluster has {', '.join(f'{k} {_amount(k, v)}' for k, v in sorted(needed.items()))} free in total, "
        f"but no node fits a bundle of {', '.join(f'{k} {_amount(k, v)}' for k, v in sorted(largest.items()))} "
        "(each bundle must fit on one node)"
    )


def _amount(name: str, amount: float) -> str:
    return f"{amount / 2**30:.2f} GiB" if name in ("memory", "object_store_memory") else f"{amount:g}"


def start_pipeline(
    path: Path,
    num_stages: int,
    mode: ComputeMode,
    device: str = "cpu",
    num_cpus: float = 1.0,
    num_threads: int | None = None,
    start_timeout_s: float = 600.0,
    group=None,
    tensor_parallel: int = 1,
    kv_requests: int = 1,
    slot_positions: int | None = None,
) -> RayPipeline:
    """Start `tensor_parallel` ShardActors per stage (a group whose ranks split the stage's
    heads and MLP) in a placement group (`group`, one bundle per stage as stage_bundles makes
    them, or one reserved here), and return the pipeline over them.

    A group reserved here belongs to the job, not to a calling actor: an actor that starts
    stages and may be killed (a coordinator) should be handed a group its creator removes."""
    from pipeline.model import checkpoint

    config = checkpoint.load_config(path)
    spec = ModelSpec.from_hf_config(config)
    layouts = stage_layouts(spec.num_layers, num_stages)
    check_tensor_parallel(spec, tensor_parallel)
    # Each rank declares the memory it holds (its layers, the caches of `kv_requests` requests
    # of `slot_positions`): the group's bundles reserve it, `stage_bundles(..., memory)` alike.
    memory = [f.peak for f in stage_footprints_of(path, num_stages, tensor_parallel, mode, device, kv_requests,
                                                   slot_positions)]  # fmt: skip
    owns_group = group is None
    if owns_group:
        bundles = stage_bundles(num_stages, num_cpus, device, tensor_parallel, memory)
        what = f"{num_stages} pipeline stage(s) × {tensor_parallel} tensor-parallel rank(s)"
        group = reserve(bundles, "PACK", start_timeout_s, what)
    actor = ray.remote(_actor_class())
    ranks = [
        [
            actor.options(
                num_cpus=num_cpus,
                num_gpus=1 if device.startswith("cuda") else 0,
                memory=memory[layout.index],
                max_restarts=MAX_RESTARTS if tensor_parallel == 1 else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=layout.index),
            ).remote(str(path), layout, mode.value, device, num_threads, rank, tensor_parallel)
            for rank in range(tensor_parallel)
        ]
        for layout in layouts
    ]
    handles = [handle for stage in ranks for handle in stage]

    def fail(message: str) -> None:
        for h in handles:
            ray.kill(h)
        if owns_group:
            remove_placement_group(group)
        raise ConfigError(message)

    ready, pending = ray.wait([h.info.remote() for h in handles], num_returns=len(handles), timeout=start_timeout_s)
    if pending:
        fail(f"{len(pending)} of {len(handles)} stage actors did not load within {start_timeout_s:.0f} s")
    infos = sorted(ray.get(ready), key=lambda info: (info["stage"], info["tp_rank"]))
    if tensor_parallel > 1:
        try:
            for stage in ranks:
                address, port = ray.get(stage[0].tensor_parallel_endpoint.remote())
                ray.get([h.join_tensor_parallel.remote(address, port) for h in stage], timeout=start_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            fail(f"a tensor-parallel group could not form: {e}")
    for info in infos:
        logger.info(
            "Stage %d rank %d: layers %s on node %s, %.1f MB read in %.1f s",
            info["stage"], info["tp_rank"], info["layers"], info["node_id"][:8], info["loaded_bytes"] / 1e6,
            info["load_s"],
        )
    links = [RayLink(stage[0]) if tensor_parallel == 1 else TensorParallelLink(stage) for stage in ranks]
    max_context = max_context_of(config, spec)
    model = PipelineModel(links, layouts, spec, max_context, prefill_chunk_for(spec), device, mode.activation_dtype)
    node_ids = [info["node_id"] for info in infos if info["tp_rank"] == 0]
    return RayPipeline(model, handles, group, node_ids, owns_group, ranks)
