"""A model's layers by index, so that a compiled graph can name a layer in an opaque custom op's
arguments (ops take tensors and plain values, not modules).

Indices are per model and per kind, in module order: every instance of a model numbers its layers
alike, so one compiled graph (and the on-disk artifacts) serves any instance, and the op finds
the instance being run through the forward context, never another session's model.
"""

from __future__ import annotations

from torch import nn

UNNUMBERED = -1


class IndexedLayer(nn.Module):
    """A layer a compiled graph calls through an opaque op: `layer_kind` names its table,
    `layer_key` its index there (UNNUMBERED until its model's `ModelLayers` is built)."""

    layer_kind: str = ""
    layer_key: int = UNNUMBERED


class ModelLayers:
    """The indexed layers of one model, per kind in module order; numbers them when built."""

    def __init__(self, model: nn.Module) -> None:
        self._layers: dict[str, list[IndexedLayer]] = {}
        for module in model.modules():
            if isinstance(module, IndexedLayer):
                table = self._layers.setdefault(module.layer_kind, [])
                module.layer_key = len(table)
                table.append(module)

    def get(self, kind: str, key: int) -> IndexedLayer:
        table = self._layers.get(kind, [])
        if not 0 <= key < len(table):
            raise RuntimeError(f"the running model has no {kind} layer {key}")
        return table[key]


def model_layers(model: nn.Module) -> ModelLayers:
    """The model's table, built (and its layers numbered) at the first call."""
    layers = model.__dict__.get("_indexed_layers")
    if layers is None:
        layers = ModelLayers(model)
        model.__dict__["_indexed_layers"] = layers
    return layers
