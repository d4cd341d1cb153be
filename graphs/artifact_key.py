"""What the artifact cache is keyed by: everything that changes the compiled code.

`ArtifactKey` hashes: a format number; the model's config.json content as canonical JSON (sorted
keys); the graph-relevant settings the caller passes, canonicalized the same way; a sha256 over every .py file of the libkk, libkk.graphs and
libkk.kernels packages (module names + contents, computed once per process); the Python
major.minor; the CPU architecture; the torch, Triton and CUDA (`torch.version.cuda`) versions; the
GPU name ("cpu" without one). Weights are not in the key: the compiled code must not bake weights in
as constants (no Inductor freezing) unless the caller adds a weights hash to the settings.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch

from libkk.fsutil import sha256_file

KEY_FORMAT = 1  # bump when the entry layout or the meaning of a stored file changes
_SOURCE_PACKAGES = ("libkk", "libkk.graphs", "libkk.kernels")


# ---- the key ----------------------------------------------------------------------------------


class ArtifactKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything that changes the compiled code; `digest()` names the entry."""

    format: int
    model_config: dict[str, Any]
    graph_settings: dict[str, Any]
    libkk_source: str
    python: str
    machine: str
    torch: str
    triton: str | None
    cuda: str | None
    device_name: str

    @classmethod
    def build(
        cls,
        model_config: Mapping[str, Any],
        graph_settings: Mapping[str, Any],
        device_name: str | None,
    ) -> ArtifactKey:
        """`device_name`: the GPU's name (`torch.cuda.get_device_name`), None on CPU."""
        return cls(
            format=KEY_FORMAT,
            model_config=canonical(model_config),
            graph_settings=canonical(graph_settings),
            libkk_source=source_hash(),
            python=f"{sys.version_info.major}.{sys.version_info.minor}",
            machine=platform.machine(),
            torch=str(torch.__version__),
            triton=triton_version(),
            cuda=torch.version.cuda,
            device_name=device_name or "cpu",
        )

    def digest(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self, order="sorted")).hexdigest()[:32]


def artifact_key(
    model_config: Mapping[str, Any], graph_settings: Mapping[str, Any], device_name: str | None
) -> str:
    """The entry name for these inputs; see `ArtifactKey` for what goes in."""
    return ArtifactKey.build(model_config, graph_settings, device_name).digest()


def device_name_of(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


@functools.cache
def source_hash() -> str:
    """sha256 of libkk's Python source (graphs and kernels included), once per process."""
    roots: dict[Path, str] = {}
    for package in _SOURCE_PACKAGES:
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.setdefault(Path(location).resolve(), package)
    return hash_source_tree(roots)


def hash_source_tree(roots: Mapping[Path, str]) -> str:
    """sha256 over (module name, content) of every .py file under `roots` (folder -> package).

    Module names rather than paths, so the same source installed elsewhere hashes the same; a
    module reachable from two roots (graphs/ inside an installed libkk/) counts once.
    """
    files: dict[str, Path] = {}
    for root, package in sorted(roots.items()):
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            files.setdefault(".".join((package, *rel.with_suffix("").parts)), path)
    h = hashlib.sha256()
    for module in sorted(files):
        h.update(f"{module}\0{sha256_file(files[module])}\n".encode())
    return h.hexdigest()


@functools.cache
def triton_version() -> str | None:
    for dist in ("triton", "pytorch-triton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def canonical(value: Any) -> Any:
    """Plain JSON values (sorted keys), so equal settings give equal keys whatever their types."""

    def enc_hook(obj: Any) -> Any:
        if isinstance(obj, Mapping):
            return dict(obj)
        if isinstance(obj, (Path, torch.dtype, torch.device)):
            return str(obj)
        raise TypeError(f"a value of type {type(obj).__name__} cannot go into an artifact key")

    return msgspec.json.decode(msgspec.json.encode(value, order="sorted", enc_hook=enc_hook))
