"""How a pipeline reaches its stages: a link's `call` returns a value or a future of it, which
the next stage can take as an argument, so a forward chains stages without waiting in
between. `LocalLink` calls a StageModel in this process (tests, one machine); the Ray links
(`actors.shard.RayLink`, `TensorParallelLink`) call stage actors."""

from __future__ import annotations

from typing import Any, Protocol


class StageLink(Protocol):
    """How the pipeline reaches a stage: `call` returns a value or a future of it."""

    def call(self, method: str, *args: Any, num_returns: int = 1) -> Any: ...

    def get(self, value: Any) -> Any: ...


class LocalLink:
    """A stage in this process."""

    def __init__(self, stage) -> None:  # a StageModel
        self.stage = stage

    def call(self, method: str, *args: Any, num_returns: int = 1) -> Any:
        return getattr(self.stage, method)(*args)

    def get(self, value: Any) -> Any:
        return value
