"""Model replicas as Ray actors: one single-process engine each, and the pool that starts them.

A replica takes prompt token ids and returns generated token ids with their decoding
statistics; tokenization, chunking and prompts stay with the caller, so a sharded
replica (a coordinator over pipeline stages) can take this one's place behind the
same `generate` call.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
import uuid
from dataclasses import replace

import ray
from ray.util.placement_group import remove_placement_group

from actors.metrics import ReplicaMetrics
from actors.profiler import start_profilers
from actors.resources import (
    ReplicaResources,
    check_memory,
    cpus_per_replica,
    node_memory,
    replica_footprint_of,
    stage_memory_of,
)
from actors.restart import exit_for_restart
from actors.shard import reserve, stage_bundles
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.stats import BusyClock
from pipeline.engine import REGISTRY, Engine, EngineConfig, StrategyConfig
from pipeline.errors import ConfigError, DeviceFault, is_device_fault
from pipeline.logs import configure_worker_logging
from pipeline.model.footprint import RUNTIME_BYTES
from profiling.calibration import store_calibrator
from profiling.microbench import SUSPECT_RESIDUAL

logger = logging.getLogger(__name__)

# A replica that dies is restarted (it reloads its model); its callers send its requests again
# (pipeline/summarization/dispatch.py), which replay: greedy and seeded decoding are deterministic.
# Not Ray: it would send a request that kills its replica back until every restart is spent.
MAX_RESTARTS = 10
MAX_TASK_RETRIES = 0
# A pool's replicas by name: unique per pool, so that pools of several jobs never meet.
REPLICA_NAME = "knapspec-replica-{pool}-{index}"


class EngineReplica:
    """One model replica in one worker process (wrapped by `ray.remote` in ReplicaPool).

    With `max_batch` > 1 it takes many `generate` calls at once (a threaded actor) and decodes
    them in one continuous batch, on one decode thread; transformers' `generate()` (`hf`) runs
    one call at a time.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        strategy: StrategyConfig,
        num_threads: int | None = None,
        max_batch: int = 1,
        declared_memory: int = 0,
    ) -> None:
        """`declared_memory`: what this replica asked Ray for (ReplicaPool), to set its peak beside."""
        import torch

        from pipeline.decoding.serving import BatchingThread

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        configure_worker_logging()
        started = time.perf_counter()
        self.calibration_dir = engine_config.calibration_dir
        self.engine = Engine(engine_config, calibrator=store_calibrator(engine_config.calibration_dir))
        self.strategy = strategy
        self.max_batch = max_batch
        if REGISTRY[strategy.name].searching:
            # Measured now, before any batch runs beside the timer.
            self.engine.latency  # noqa: B018
        self.lanes: list[BatchingThread] = []
        if REGISTRY[strategy.name].build is not None:
            self.lanes = [BatchingThread(self.engine.batcher(max_batch))]
        self._one_at_a_time = threading.Lock()
        self.declared_memory = declared_memory
        self.busy = BusyClock()
        self._start_metrics()
        self.load_s = time.perf_counter() - started

    def _start_metrics(self) -> None:
        """Ray metrics where this runs inside Ray (tests also build replicas in-process, without it)."""
        inside = ray.is_initialized()
        self.metrics = ReplicaMetrics(self.engine.name, self.strategy.name) if inside else None
        self.replica_name = (ray.get_runtime_context().get_actor_name() if inside else None) or str(os.getpid())

    def info(self) -> dict:
        import torch

        return {
            "model": self.engine.name,
            "mode": self.engine.mode.value,
            "max_context": self.engine.model.max_context,
            "threads": torch.get_num_threads(),
            "load_s": self.load_s,
            "max_batch": self.max_batch,
            "pid": os.getpid(),
            "calibration_residual": self._calibration_residual(),
        }

    def ping(self) -> int:  # answered while the process can: how callers tell a hung or restarting replica
        return os.getpid()

    def usage(self) -> dict:
        """The wall time this replica held requests and what it served (stats.ReplicaUsage.to_dict):
        its own throughput, which a batch's overlapping per-request decode times are not; and its
        process's peak resident memory beside what it declared."""
        return replace(self.busy.usage(), peak_rss=peak_rss(), declared_memory=self.declared_memory).to_dict()

    def _calibration_residual(self) -> float | None:
        """The worst fit residual of the stored table this replica's search uses (None: none used)."""
        from profiling.calibration import CalibrationStore
        from profiling.record import DEFAULT_LAYOUT, CalibrationKey

        if not REGISTRY[self.strategy.name].searching:
            return None
        try:
            key = CalibrationKey.for_model(self.engine.model, self.engine.name, layout=DEFAULT_LAYOUT)
            stored = CalibrationStore(self.calibration_dir).get(key)
        except Exception:  # a model whose stages run elsewhere, an unreadable store: nothing to say
            return None
        return max(stored.fit_residuals.values(), default=None) if stored is not None else None

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams) -> dict:
        import torch

        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        if self.metrics is not None:
            self.metrics.start(self.replica_name)
        self.busy.start()
        stats = None
        try:
            if self.lanes:
                lane = min(self.lanes, key=lambda lane: lane.batcher.num_requests)
                result = lane.generate(self.engine.request(prompt, self.strategy, max_new_tokens, params))
            else:
                with self._one_at_a_time:
                    result = self.engine.generate(prompt, self.strategy, max_new_tokens, params)
            stats = result.stats.to_dict()
        except Exception as e:
            if is_device_fault(e):
                exit_for_restart(e)
            raise
        finally:
            self.busy.finish(result.stats if stats is not None else None)
            if self.metrics is not None:
                self.metrics.finish(self.replica_name, stats)
        return {"token_ids": result.token_ids, "finish_reason": result.finish_reason, "stats": stats, "extra": result.extra}


def peak_rss() -> int:
    """This process's peak resident memory, in bytes (Linux counts ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PipelineReplica(EngineReplica):
    """One model replica as a coordinator over pipeline stages (ShardActors).

    The draft/verify loop, the drafters and the search run here unchanged; the stages hold
    the layers and the KV caches. Requests decode in batches of up to `max_batch`, one batch
    per stage in flight ("lanes", each its own decode thread): while one lane's packed rows
    are in stage 1, another's are in stage 0. A request that loses a stage (it died and was
    restarted without its caches) is run again from the start: greedy and seeded decoding
    replay, so its output does not change.
    """

    RETRIES = 2

    def __init__(
        self,
        engine_config: EngineConfig,
        strategy: StrategyConfig,
        num_stages: int,
        stage_cpus: float,
        num_threads: int | None = None,
        group=None,
        tensor_parallel: int = 1,
        max_batch: int = 1,
    ) -> None:
        """`group`: a placement group with a bundle per stage (actors.shard.stage_bundles),
        reserved and removed by the caller, so it outlives this actor's restarts and dies with
        the pool; without one the stages reserve their own, removed by `shutdown`."""
        from actors.profiler import calibrate_pipeline
        from actors.shard import start_pipeline
        from pipeline.decoding.serving import BatchingThread
        from pipeline.engine import SEARCHING_STRATEGIES
        from pipeline.model import checkpoint
        from pipeline.model.linear import resolve_compute_mode

        configure_worker_logging()
        if REGISTRY[strategy.name].build is None:
            raise ConfigError(f"strategy {strategy.name!r} runs transformers in one process; it has no pipeline form")
        started = time.perf_counter()
        path = checkpoint.resolve_checkpoint(engine_config.model, engine_config.cache_dir)
        mode = resolve_compute_mode(engine_config.dtype, engine_config.device)
        self.ray_pipeline = start_pipeline(
            path,
            num_stages,
            mode,
            engine_config.device,
            num_cpus=stage_cpus,
            num_threads=num_threads,
            group=group,
            tensor_parallel=tensor_parallel,
            # One batch per stage in flight (the lanes), each request with caches on every stage.
            kv_requests=num_stages * max_batch,
            slot_positions=engine_config.kv_slot_positions,
        )
        self.pipeline, self.stages = self.ray_pipeline.model, self.ray_pipeline.handles
        if strategy.name in SEARCHING_STRATEGIES and engine_config.latency is None:
            # Each stage weighed by its own node's device table, plus the hop: the knapsack
            # skips a slow stage's items first and knows that a skipped middle stage saves its hop.
            latency = calibrate_pipeline(
                self.ray_pipeline,
                path,
                mode,
                engine_config.device,
                engine_config.calibration_dir,
                num_threads,
                tensor_parallel=tensor_parallel,
            )
            engine_config = replace(engine_config, latency=latency)
        self.engine = Engine(engine_config, model=self.pipeline)
        self.strategy = strategy
        self.max_batch = max_batch
        self.lanes = [BatchingThread(self.engine.batcher(max_batch), name=f"lane-{k}") for k in range(num_stages)]
        self.busy = BusyClock()
        self.declared_memory = RUNTIME_BYTES  # as ReplicaPool declares a coordinator
        self._start_metrics()
        self.load_s = time.perf_counter() - started
        self.num_threads = num_threads
        self.tensor_parallel = tensor_parallel
        self.retried = 0

    def info(self) -> dict:
        return {
            "model": self.engine.name,
            "mode": self.engine.mode.value,
            "max_context": self.engine.model.max_context,
            "threads": self.num_threads or 0,  # per stage
            "stages": len(self.stages),
            "max_batch": self.max_batch,
            "load_s": self.load_s,
            "retried_requests": self.retried,
            "pid": os.getpid(),
        }

    def _wait_for_stages(self, timeout_s: float = 300.0) -> None:
        """Until every stage answers: a restarting stage reloads its layers first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.get([stage.info.remote() for stage in self.stages], timeout=max(deadline - time.monotonic(), 1))
                return
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stage_handles(self) -> list:
        return list(self.stages)

    def shutdown(self) -> None:
        """Stop the stages (and their placement group, if they reserved it)."""
        self.ray_pipeline.shutdown()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams) -> dict:
        for attempt in range(self.RETRIES + 1):
            try:
                return super().generate(prompt_ids, max_new_tokens, params)
            except ray.exceptions.RayError as e:
                if self.tensor_parallel > 1:  # its group could not form again: start it all anew
                    exit_for_restart(DeviceFault(f"a tensor-parallel rank of this replica failed: {e}"))
                if attempt == self.RETRIES:
                    raise
                logger.warning(
                    "A pipeline stage failed (%s); running the request again from the start", type(e).__name__
                )
                self.retried += 1
                self._wait_for_stages()
        raise AssertionError("unreachable")


class ReplicaPool:
    """Starts `count` replicas, waits until each has loaded its model, and hands out their handles."""

    def __init__(
        self,
        count: int,
        engine_config: EngineConfig,
        strategy: StrategyConfig,
        resources: ReplicaResources = ReplicaResources(),
        start_timeout_s: float = 600.0,
    ) -> None:
        if count < 1:
            raise ConfigError(f"need at least one replica, got {count}")
        num_cpus = cpus_per_replica(count, resources)
        stages, ranks = resources.pipeline_parallel, resources.tensor_parallel
        if stages == 1 and ranks == 1:
            # What one replica holds at its peak, declared to Ray: it places a replica only where it
            # fits (a pipelined replica's stages declare theirs, below).
            footprint = replica_footprint_of(engine_config, resources.max_batch)
            check_memory(count, footprint, node_memory())
        self.groups: list = []
        self.profilers: dict = {}
        # Named, so that the summarize stage's actors take plain names, and one restarted by Ray
        # Data looks its replicas up again rather than relying on handles in its arguments.
        pool = uuid.uuid4().hex[:12]
        self.names = [REPLICA_NAME.format(pool=pool, index=i) for i in range(count)]
        if stages == 1 and ranks == 1:
            actor = ray.remote(EngineReplica)

            def start(name: str):
                return actor.options(
                    name=name,
                    num_cpus=num_cpus,
                    num_gpus=resources.num_gpus,
                    memory=footprint.peak,
                    max_restarts=MAX_RESTARTS,
                    max_task_retries=MAX_TASK_RETRIES,
                    # Calls wait in the batcher's queue (admitted as KV room frees), not in Ray's.
                    max_concurrency=2 * resources.max_batch + 1,
                ).remote(engine_config, strategy, resources.num_threads, resources.max_batch, footprint.peak)

            self.handles = [start(self.names[0])]
            if REGISTRY[strategy.name].searching and count > 1:
                # The first replica calibrates alone (a table timed beside another replica's
                # measurements would be noise) and stores its table; the others load it.
                ray.wait([self.handles[0].info.remote()], timeout=start_timeout_s)
            self.handles += [start(name) for name in self.names[1:]]
        else:
            # The coordinator keeps the loop's books and waits on its stages; they hold the CPUs.
            # One batch per stage in flight keeps all stages busy: while one batch's rows are in
            # stage 1, another's are in stage 0.
            actor = ray.remote(PipelineReplica)
            options = dict(
                num_cpus=0,
                memory=RUNTIME_BYTES,  # the weights and caches are the stages'; the loop's books are small
                max_restarts=MAX_RESTARTS,
                max_task_retries=MAX_TASK_RETRIES,
                max_concurrency=2 * stages * resources.max_batch + 1,
            )
            # Each replica's stages in a placement group of the pool's: it outlives a coordinator's
            # restart, and the pool removes it (a group reserved by an actor would outlive it).
            # One profiler per node, owned here so that it lives as long as the pool: replicas find
            # them by name, and a node's table is measured once for all of them.
            self.profilers = start_profilers()
            rank_cpus = num_cpus / (stages * ranks)
            memory = stage_memory_of(engine_config, stages, ranks, resources.max_batch)
            bundles = stage_bundles(stages, rank_cpus, engine_config.device, ranks, memory)
            what = f"({stages} pipeline stage(s) × {ranks} tensor-parallel rank(s))"
            self.groups = [reserve(bundles, "PACK", start_timeout_s, f"replica {i} {what}") for i in range(count)]
            self.handles = [
                actor.options(name=name, **options).remote(
                    engine_config, strategy, stages, rank_cpus, resources.num_threads, group, ranks, resources.max_batch
                )
                for name, group in zip(self.names, self.groups)
            ]
        ready, pending = ray.wait([h.info.remote() for h in self.handles], num_returns=count, timeout=start_timeout_s)
        if pending:
            self.shutdown()
            raise ConfigError(
                f"{len(pending)} of {count} replicas did not start within {start_timeout_s:.0f} s "
                f"(each asks for {num_cpus:g} CPUs and {resources.num_gpus} GPUs; "
                f"the cluster has {ray.available_resources()})"
            )
        self.infos = ray.get(ready)
        for info in self.infos:
            logger.info(
                "Replica ready: %s in %s mode, %d threads, loaded in %.1f s",
                info["model"],
                info["mode"],
                info["threads"],
                info["load_s"],
            )
        residuals = [r for r in (info.get("calibration_residual") for info in self.infos) if r is not None]
        if residuals and max(residuals) > SUSPECT_RESIDUAL:
            # Once per pool: every replica of a node reads the same stored table.
            logger.warning(
                "The stored latency table is inconsistent (a fit is off by %.0f%%; measured on a busy machine?): "
                "the searching strategies may choose worse drafts. Re-measure on an idle machine with "
                "`python jobs/calibrate.py --force`",
                100 * max(residuals),
            )

    @property
    def max_context(self) -> int:
        return self.infos[0]["max_context"]

    def shutdown(self) -> None:
        for handle in self.handles:
            ray.kill(handle)
        for group in self.groups:
            remove_placement_group(group)
        for profiler in self.profilers.values():
            ray.kill(profiler)
        self.handles, self.groups, self.profilers = [], [], {}
