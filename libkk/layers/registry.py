"""Layers by int key, so that a compiled graph can name a layer in an opaque custom op's
arguments (ops take tensors and plain values, not modules)."""

from __future__ import annotations

import itertools
import weakref
from typing import Generic, TypeVar

T = TypeVar("T")


class LayerRegistry(Generic[T]):
    """Every layer of one kind in the process, by key. Keys follow construction order, so the
    model a process builds first gets the same keys (and compiled graphs that hit the on-disk
    caches) in every process. A layer leaves when it is garbage-collected."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._layers: dict[int, weakref.ref[T]] = {}
        self._next_key = itertools.count()

    def register(self, layer: T) -> int:
        key = next(self._next_key)
        self._layers[key] = weakref.ref(layer, lambda _: self._layers.pop(key, None))
        return key

    def get(self, key: int) -> T:
        layer = self._layers[key]()
        if layer is None:
            raise RuntimeError(f"{self.kind} {key} no longer exists")
        return layer
