"""How a model is cut into pipeline stages: contiguous layer ranges, a stage's layout, and
which checkpoint tensors a stage reads.

Items and layers keep the whole model's numbering (pipeline.model.items); a stage's own
model numbers its layers from 0, and `StageLayout.local_item` converts between the two.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.errors import ConfigError
from pipeline.model.items import item_range

LAYER_PREFIX = "model.layers."


def partition_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges [first, end), as even as possible, earlier stages one layer
    longer when it does not divide (the last stage also runs the LM head)."""
    if not 1 <= num_stages <= num_layers:
        raise ConfigError(f"cannot cut {num_layers} layers into {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    bounds = list(itertools.accumulate([base + (i < extra) for i in range(num_stages)], initial=0))
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class StageLayout:
    index: int
    num_stages: int
    first_layer: int
    end_layer: int

    @property
    def has_embeddings(self) -> bool:
        return self.index == 0

    @property
    def has_head(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def items(self) -> range:
        return item_range(self.first_layer, self.end_layer)

    def local_item(self, item: int) -> int:
        """The number of one of this stage's items in the stage's own model (layers from 0)."""
        return item - self.items.start


def stage_layouts(num_layers: int, num_stages: int) -> list[StageLayout]:
    """The layouts of `num_stages` stages over `num_layers` layers (see partition_layers)."""
    return [
        StageLayout(i, num_stages, first, end) for i, (first, end) in enumerate(partition_layers(num_layers, num_stages))
    ]


def stage_tensor_filter(layout: StageLayout, tie_word_embeddings: bool) -> Callable[[str], bool]:
    """Which checkpoint tensors a stage reads: its layers, and the embeddings / head it runs."""

    def keep(name: str) -> bool:
        if name.startswith(LAYER_PREFIX):
            layer = int(name[len(LAYER_PREFIX) :].split(".", 1)[0])
            return layout.first_layer <= layer < layout.end_layer
        if name == "model.embed_tokens.weight":
            return layout.has_embeddings or (layout.has_head and tie_word_embeddings)
        if name in ("model.norm.weight", "lm_head.weight"):
            return layout.has_head
        return False

    return keep
