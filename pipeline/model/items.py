"""The item numbering: a decoder of L layers is 2L items (sublayers), item 2i layer i's
attention and item 2i+1 its MLP (KnapSpec, Sec. 3). Everything that names an item by
number goes through these helpers, so the convention lives in one place."""

from __future__ import annotations

from collections.abc import Iterable


def num_items(num_layers: int) -> int:
    return 2 * num_layers


def attention_item(layer: int) -> int:
    return 2 * layer


def mlp_item(layer: int) -> int:
    return 2 * layer + 1


def layer_items(layer: int) -> tuple[int, int]:
    """(attention item, MLP item) of a layer."""
    return 2 * layer, 2 * layer + 1


def split_item(item: int) -> tuple[int, bool]:
    """(layer, is_mlp) of an item."""
    layer, kind = divmod(item, 2)
    return layer, bool(kind)


def is_attention(item: int) -> bool:
    return item % 2 == 0


def items_of_layers(layers: Iterable[int]) -> frozenset[int]:
    """Both items of every layer given: what a layer-granular skip set skips."""
    return frozenset(item for layer in layers for item in layer_items(layer))


def item_range(first_layer: int, end_layer: int) -> range:
    """The items of layers [first_layer, end_layer)."""
    return range(2 * first_layer, 2 * end_layer)


def count_kinds(items: Iterable[int]) -> tuple[int, int]:
    """(attention items, MLP items) among `items`."""
    items = list(items)
    num_attn = sum(1 for item in items if is_attention(item))
    return num_attn, len(items) - num_attn
