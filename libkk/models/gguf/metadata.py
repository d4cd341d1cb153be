"""GGUF key/value metadata as plain Python values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from libkk.errors import CorruptCheckpointError, UnsupportedModelError


class Metadata:
    """GGUF key/value metadata as plain Python values (read without `ReaderField.contents`,
    which older gguf releases lack)."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        from gguf import GGUFValueType

        try:
            kind = field.types[0]
            if kind == GGUFValueType.ARRAY:
                if field.types[-1] == GGUFValueType.STRING:
                    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
                if len(field.types) != 2:
                    return None  # nested arrays: nothing libkk reads
                if not field.data:
                    return []
                return np.concatenate([field.parts[i] for i in field.data]).tolist()
            if kind == GGUFValueType.STRING:
                return bytes(field.parts[field.data[0]]).decode("utf-8")
            value = field.parts[field.data[0]][0].item()
            return bool(value) if kind == GGUFValueType.BOOL else value
        except (UnicodeDecodeError, IndexError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"GGUF {str(self.path)!r}: metadata key {key!r} cannot be decoded: {exc}"
            ) from exc

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CorruptCheckpointError(
                f"GGUF {str(self.path)!r} lacks the required metadata key {key!r}"
            )
        return value

    def int(self, key: str, default: int | None = None) -> int:
        """An integer key; a per-layer list (some llama.cpp exports) is refused."""
        value = self.get(key, default) if default is not None else self.require(key)
        if isinstance(value, list):
            raise UnsupportedModelError(
                f"GGUF metadata {key!r} is a per-layer list {value[:4]}...; only one value for "
                "all layers is supported"
            )
        return int(value)
