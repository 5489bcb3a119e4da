"""What a replica asks Ray for: CPUs (leaving the data stages theirs), GPUs, and the memory it
holds at its peak (pipeline/model/footprint.py); and the refusals, in one line, of replicas the
cluster can never hold."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from pipeline.engine import EngineConfig
from pipeline.errors import ConfigError
from pipeline.model.footprint import Footprint, checkpoint_bytes, gib, replica_footprint, stage_footprint

# CPUs left to Ray Data when replicas are placed (with every CPU held by a replica, a data
# task would wait forever): USER_TASK_CPUS for one task at Ray Data's default of one CPU (a
# user's own read, map, filter or write around the summarize stage, actors/summarizer.py),
# and a quarter for the job's light stages (its reads, filters, dispatchers and writes).
USER_TASK_CPUS = 1.0
DATA_CPUS = USER_TASK_CPUS + 0.25


@dataclass(frozen=True)
class ReplicaResources:
    num_cpus: float | None = None  # None: up to one CPU each, whatever the cluster has after DATA_CPUS
    num_gpus: float = 0.0
    num_threads: int | None = None  # torch threads per replica; None: Ray's default for the reservation
    pipeline_parallel: int = 1  # stages per replica
    tensor_parallel: int = 1  # ranks per stage; each rank gets num_cpus / (stages × ranks)
    max_batch: int = 1  # requests decoded in one batch (per stage in flight, for a pipelined replica)


def cpus_per_replica(count: int, resources: ReplicaResources) -> float:
    """CPUs to reserve per replica; fails at once, naming what is missing, when the cluster
    can never hold the replicas and still run the data stages."""
    total = ray.cluster_resources()
    usable = total.get("CPU", 0.0) - DATA_CPUS
    shards = resources.pipeline_parallel * resources.tensor_parallel
    gpus = count * resources.num_gpus * shards  # a GPU per stage and rank
    if gpus > total.get("GPU", 0.0):
        raise ConfigError(
            f"{count} replicas of {resources.pipeline_parallel} stages × {resources.tensor_parallel} ranks "
            f"need {gpus:g} GPUs, "
            f"but the cluster has {total.get('GPU', 0.0):g}; lower --replicas"
        )
    num_cpus = resources.num_cpus if resources.num_cpus is not None else min(1.0, usable / count)
    if num_cpus <= 0 or count * num_cpus > usable + 1e-9:
        raise ConfigError(
            f"{count} replicas × {num_cpus:g} CPUs need {count * num_cpus:g} CPUs plus {DATA_CPUS:g} for the data "
            f"stages, but the cluster has {total.get('CPU', 0.0):g}; lower --replicas or --cpus-per-replica"
        )
    return num_cpus


def replica_footprint_of(engine_config: EngineConfig, max_batch: int) -> Footprint:
    """The host memory one single-process replica of `engine_config` needs at its peak, from
    the checkpoint's config and size (the driver sees the checkpoint, as the replicas will)."""
    from pipeline.model import checkpoint
    from pipeline.model.context import max_context_of
    from pipeline.model.linear import resolve_compute_mode
    from pipeline.model.spec import ModelSpec

    path = checkpoint.resolve_checkpoint(engine_config.model, engine_config.cache_dir)
    config = checkpoint.load_config(path)
    spec = ModelSpec.from_hf_config(config)
    return replica_footprint(
        spec,
        resolve_compute_mode(engine_config.dtype, engine_config.device),
        engine_config.device,
        checkpoint_bytes(path),
        max_batch,
        engine_config.kv_slot_positions or max_context_of(config, spec),
        engine_config.kv_cache_bytes,
    )


def check_memory(count: int, footprint: Footprint, nodes: list[float]) -> None:
    """Refuse at once, with the figure, replicas that the nodes' memory (what each offers Ray)
    cannot hold: Ray would leave them pending until the start's timeout."""
    largest = max(nodes, default=0.0)
    if footprint.peak > largest:
        raise ConfigError(
            f"a replica needs {footprint.describe()} of memory, but the largest node offers Ray "
            f"{gib(largest)}; lower --max-batch or --max-chunk-tokens, or use a node with more memory"
        )
    fits = sum(int(memory // footprint.peak) for memory in nodes)
    if count > fits:
        raise ConfigError(
            f"{count} replicas of {footprint.describe()} each do not fit the memory the cluster offers Ray "
            f"({', '.join(gib(memory) for memory in nodes)} on its nodes: {fits} fit); lower --replicas"
        )


def node_memory() -> list[float]:
    """The memory each live node offers Ray (its `memory` resource), in bytes."""
    return [node["Resources"].get("memory", 0.0) for node in ray.nodes() if node["Alive"]]


def stage_footprints_of(
    path, num_stages: int, ranks: int, mode, device: str, kv_requests: int, slot_positions: int | None
) -> list[Footprint]:
    """What one rank of each pipeline stage of the checkpoint at `path` declares: its layers'
    weights and the caches of `kv_requests` requests of `slot_positions` (None: the model's
    context) for them (pipeline/parallel/layout.py places the layers)."""
    from pipeline.model import checkpoint
    from pipeline.model.context import max_context_of
    from pipeline.model.spec import ModelSpec
    from pipeline.parallel.layout import stage_layouts

    config = checkpoint.load_config(path)
    spec = ModelSpec.from_hf_config(config)
    size = checkpoint_bytes(path)
    positions = slot_positions or max_context_of(config, spec)
    return [
        stage_footprint(spec, mode, device, size, range(layout.first_layer, layout.end_layer), layout.has_embeddings,
                        layout.has_head, ranks, kv_requests, positions)  # fmt: skip
        for layout in stage_layouts(spec.num_layers, num_stages)
    ]


def stage_memory_of(engine_config: EngineConfig, stages: int, ranks: int, max_batch: int) -> list[int]:
    """What one rank of each stage of a pipelined replica declares: a batch per stage in flight
    (its lanes), each request with caches on every stage."""
    from pipeline.model import checkpoint
    from pipeline.model.linear import resolve_compute_mode

    path = checkpoint.resolve_checkpoint(engine_config.model, engine_config.cache_dir)
    mode = resolve_compute_mode(engine_config.dtype, engine_config.device)
    footprints = stage_footprints_of(
        path, stages, ranks, mode, engine_config.device, stages * max_batch, engine_config.kv_slot_positions
    )
    return [f.peak for f in footprints]
