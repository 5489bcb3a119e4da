"""Pipeline stages as Ray actors: a ShardActor holds one StageModel, a RayLink reaches it.

A forward over the pipeline submits stage k+1's call with stage k's result as an object
reference, so Ray moves the hidden states from actor to actor without a round trip
through the coordinator; only the last stage's output is waited for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from pipeline.errors import ConfigError
from pipeline.linear import ComputeMode
from pipeline.model_spec import ModelSpec
from pipeline.staged_model import PipelineModel, StageLayout, StageModel, partition_layers
from pipeline.sublayer_model import max_context_of, prefill_chunk_for

logger = logging.getLogger(__name__)

# A stage that dies is restarted (it reloads its layers). Its requests' caches are gone
# then; the coordinator's retry re-prefills them.
MAX_RESTARTS = 2


class ShardActor:
    """One pipeline stage in one worker process (wrapped by `ray.remote` in start_pipeline)."""

    def __init__(
        self, path: str, layout: StageLayout, mode: str, device: str, num_threads: int | None, sublayer_delay_s: float = 0.0
    ) -> None:
        import torch

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        started = time.perf_counter()
        self.stage = StageModel(Path(path), layout, ComputeMode(mode), device, sublayer_delay_s)
        self.load_s = time.perf_counter() - started

    def info(self) -> dict:
        layout = self.stage.layout
        return {
            "stage": layout.index,
            "layers": (layout.first_layer, layout.end_layer),
            "loaded_bytes": self.stage.loaded_bytes,
            "load_s": self.load_s,
        }


class RayLink:
    """Reaches a ShardActor; results stay object references until someone gets them."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def call(self, method: str, *args: Any, num_returns: int = 1) -> Any:
        return getattr(self.handle, method).options(num_returns=num_returns).remote(*args)

    def get(self, value: Any) -> Any:
        return ray.get(value) if isinstance(value, ray.ObjectRef) else value


_STAGE_METHODS = (
    "forward", "new_cache", "free", "copy_cache", "embed_tokens", "logits",
    "run_item_branches", "knapsack_rows", "calibrate", "echo",
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


def start_pipeline(
    path: Path,
    num_stages: int,
    mode: ComputeMode,
    device: str = "cpu",
    num_cpus: float = 1.0,
    num_threads: int | None = None,
    start_timeout_s: float = 600.0,
    delays: Sequence[float] | None = None,
) -> tuple[PipelineModel, list]:
    """Start one ShardActor per stage and return the pipeline over them, with the handles.
    `delays` (tests) makes stage k's device slower: see StageModel's `sublayer_delay_s`."""
    from pipeline import checkpoint

    config = checkpoint.load_config(path)
    spec = ModelSpec.from_hf_config(config)
    layouts = [
        StageLayout(i, num_stages, first, end) for i, (first, end) in enumerate(partition_layers(spec.num_layers, num_stages))
    ]
    actor = ray.remote(_actor_class()).options(
        num_cpus=num_cpus, num_gpus=1 if device == "cuda" else 0, max_restarts=MAX_RESTARTS
    )
    delays = delays or [0.0] * num_stages
    handles = [
        actor.remote(str(path), layout, mode.value, device, num_threads, delay) for layout, delay in zip(layouts, delays)
    ]
    ready, pending = ray.wait([h.info.remote() for h in handles], num_returns=len(handles), timeout=start_timeout_s)
    if pending:
        for h in handles:
            ray.kill(h)
        raise ConfigError(
            f"{len(pending)} of {num_stages} pipeline stages did not start within {start_timeout_s:.0f} s "
            f"(each asks for {num_cpus:g} CPUs; the cluster has {ray.available_resources()})"
        )
    for info in ray.get(ready):
        logger.info("Stage %d: layers %s, %.1f MB read in %.1f s", info["stage"], info["layers"],
                    info["loaded_bytes"] / 1e6, info["load_s"])
    max_context = max_context_of(config, spec)
    model = PipelineModel([RayLink(h) for h in handles], layouts, spec, max_context, prefill_chunk_for(spec), device)
    return model, handles
