"""Shared host tables: one copy per host of a large read-only table that is only gathered from.

With `shared_host_tables=True` the embedding matrix lives in a shared-memory folder and every
process on the host maps the same file, so its pages are resident once (each process's Pss holds
1/n of it). One entry per table:

    <root>/<key>/
        lock            flock held while an entry is checked, built or removed
        table.bin       the raw bytes of the contiguous tensor (C order)
        manifest.json   fsutil manifest: size + sha256 of table.bin, plus name, shape, dtype
        READY           sha256 of manifest.json; written last

The root is `$LIBKK_SHM_DIR`, else `/dev/shm/libkk` (tmpfs: RAM, gone at reboot).

Key. sha256 of (config.json's content, the parameter name, shape, dtype, the sha256 of the table
bytes as loaded). Hashing the loaded tensor (~0.07 s for the default model's 113 MB fp32 table)
keys the entry on exactly what this process would use, whatever the checkpoint's file layout or
a dtype cast made of it, so a different checkpoint or dtype can never map a stale table.

Protocol. Everything happens under the entry's lock. A reader trusts an entry only if READY holds
the sha256 of manifest.json, every file matches the manifest (size + full sha256) and the manifest's
name, shape, dtype and sha256 are the ones expected; anything else is logged and rebuilt. A writer
writes table.bin (temporary name + fsync + rename: a process still mapping the old file keeps its
inode), then the manifest, then READY. A writer killed midway leaves no READY (its flock dies with
it), so the next process rebuilds.

The mapping is read-only (`PROT_READ`, `MAP_SHARED`): a stray write faults instead of corrupting
the table other processes read.

Use. On CPU the mapped tensor is the embedding, and for tied models also the LM head (zero
copy). On CUDA the embedding becomes a `HostRowsEmbedding` (libkk/layers/host_embedding.py): the
runner gathers each step's rows from the mapping into a pinned staging buffer and copies them to
a static device buffer before the forward, so compiled forwards and CUDA graphs read rows without
the table on the device (a tied LM head keeps its device copy: logits need the whole matrix).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch
from torch import nn

from libkk.errors import ConfigError
from libkk.fsutil import (
    MANIFEST,
    FileRecord,
    exclusive_lock,
    fsync_dir,
    verify_manifest,
    write_atomic,
    write_manifest,
)
from libkk.layers.embedding import VocabEmbedding
from libkk.layers.host_embedding import HostRowsEmbedding

logger = logging.getLogger(__name__)

ENV_ROOT = "LIBKK_SHM_DIR"
TABLE = "table.bin"
READY = "READY"
LOCK = "lock"
_KEY_VERSION = 1  # bump when the key's inputs or the entry layout change


def default_root() -> Path:
    """`$LIBKK_SHM_DIR`, else /dev/shm/libkk (else a temp folder where there is no /dev/shm)."""
    if env := os.environ.get(ENV_ROOT):
        return Path(env)
    shm = Path("/dev/shm")
    return shm / "libkk" if shm.is_dir() else Path(tempfile.gettempdir()) / "libkk-shm"


class TableManifest(msgspec.Struct, frozen=True, kw_only=True):
    """The fields an entry's manifest.json holds (fsutil's layout plus the table's geometry)."""

    manifest_version: int
    files: dict[str, FileRecord]
    name: str
    shape: list[int]
    dtype: str
    sha256: str  # of the table bytes; equal to files[TABLE].sha256
    created: float


@dataclass(frozen=True)
class TableInfo:
    """One entry as `libkk tables list` shows it."""

    key: str
    path: Path
    ready: bool
    problem: str | None  # None when ready
    size_bytes: int
    name: str | None
    shape: tuple[int, ...] | None
    dtype: str | None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw_bytes(table: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array, without a copy for a contiguous CPU tensor."""
    return table.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


def table_key(config_bytes: bytes, name: str, table: torch.Tensor, digest: str) -> str:
    parts = [
        str(_KEY_VERSION),
        hashlib.sha256(config_bytes).hexdigest(),
        name,
        ",".join(map(str, table.shape)),
        _dtype_name(table.dtype),
        digest,
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _read_manifest(folder: Path) -> tuple[TableManifest | None, str | None]:
    """The manifest of a READY, intact entry, else (None, why not)."""
    try:
        ready = (folder / READY).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None, "no READY marker (a writer did not finish)"
    except OSError as e:
        return None, f"unreadable READY: {e}"
    try:
        raw = (folder / MANIFEST).read_bytes()
    except OSError as e:
        return None, f"unreadable {MANIFEST}: {e}"
    if hashlib.sha256(raw).hexdigest() != ready:
        return None, f"READY does not match {MANIFEST}"
    try:
        manifest = msgspec.json.decode(raw, type=TableManifest)
    except msgspec.DecodeError as e:
        return None, f"unreadable {MANIFEST}: {e}"
    if problem := verify_manifest(folder):  # layout, then size + sha256 of every file
        return None, problem
    return manifest, None


def _geometry_problem(
    manifest: TableManifest, name: str, table: torch.Tensor, digest: str
) -> str | None:
    """None if a verified manifest describes the table this process would use, else why not."""
    expected = (name, list(table.shape), _dtype_name(table.dtype), digest)
    found = (manifest.name, manifest.shape, manifest.dtype, manifest.sha256)
    record = manifest.files.get(TABLE)
    if found == expected and record is not None and record.sha256 == digest:
        return None
    return f"manifest describes {found[:3]}, expected {expected[:3]} (or another checksum)"


def _write_entry(
    folder: Path, name: str, table: torch.Tensor, raw: np.ndarray, digest: str
) -> None:
    """Writes table.bin, the manifest and READY (last); the caller holds the entry's lock."""
    (folder / READY).unlink(missing_ok=True)  # nobody trusts the entry while it changes
    for stray in folder.glob(".*.tmp-*"):  # left by a writer that was killed mid-write
        stray.unlink(missing_ok=True)
    write_atomic(folder / TABLE, raw.tobytes())
    record = FileRecord(size=raw.nbytes, sha256=digest)
    manifest = write_manifest(
        folder,
        {TABLE: record},
        name=name,
        shape=list(table.shape),
        dtype=_dtype_name(table.dtype),
        sha256=digest,
        created=time.time(),
    )
    write_atomic(folder / READY, hashlib.sha256(manifest).hexdigest().encode() + b"\n")
    fsync_dir(folder)


def _map(path: Path, table: torch.Tensor) -> torch.Tensor:
    """A read-only, shared mapping of `path` viewed as a tensor like `table`."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        # NOTE: torch warns that the array is not writable; that is the point of mode="r".
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return flat.view(table.dtype).view(table.shape)


def shared_table(
    config_bytes: bytes, name: str, table: torch.Tensor, root: Path | None = None
) -> torch.Tensor:
    """A CPU tensor equal to `table`, mapped from this host's shared copy (built if absent).

    A stale, partial or mismatched entry is never used: it is rebuilt, with a log line.
    """
    raw = _raw_bytes(table)
    digest = hashlib.sha256(raw.data).hexdigest()
    folder = (root or default_root()) / table_key(config_bytes, name, table, digest)
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder / LOCK):
        manifest, problem = _read_manifest(folder)
        if manifest is not None:
            problem = _geometry_problem(manifest, name, table, digest)
        if problem is None:
            logger.info("mapping shared host table %s from %s", name, folder)
        else:
            if any(p.name != LOCK for p in folder.iterdir()):  # a previous attempt left files
                logger.warning("rebuilding shared host table %s in %s: %s", name, folder, problem)
            else:
                logger.info("writing shared host table %s to %s", name, folder)
            _write_entry(folder, name, table, raw, digest)
        return _map(folder / TABLE, table)


def share_embedding(
    model: nn.Module, model_dir: Path, device: torch.device, max_num_tokens: int
) -> int:
    """Serves the model's embedding matrix (and a head tied to it) from the host's shared copy.

    On CPU the embedding (and a tied head) read the mapping directly. On CUDA the embedding module
    is replaced by a `HostRowsEmbedding` that gathers each step's rows (at most `max_num_tokens`)
    from the mapping into a static device buffer; a tied head keeps its device copy, an untied
    model's device copy of the embedding is freed. Returns the table's bytes. Raises ConfigError
    where sharing does not apply.
    """
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, VocabEmbedding)]
    if not named:
        raise ConfigError(f"shared_host_tables: {type(model).__name__} has no embedding table")
    module_name, embedding = named[0]
    config_bytes = (Path(model_dir) / "config.json").read_bytes()
    weight = embedding.weight.data
    table = shared_table(config_bytes, f"{module_name}.weight", weight.cpu())
    if device.type == "cpu":
        embedding.use_table(table)
    else:
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, HostRowsEmbedding(table, device, max_num_tokens))
    return table.numel() * table.element_size()


# ---- maintenance --------------------------------------------------------------------------------


def list_tables(root: Path | None = None) -> list[TableInfo]:
    """Every entry under the root, ready or not (files hashed: a full check)."""
    root = root or default_root()
    if not root.is_dir():
        return []
    entries = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        manifest, problem = _read_manifest(folder)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        entries.append(
            TableInfo(
                key=folder.name,
                path=folder,
                ready=manifest is not None,
                problem=problem,
                size_bytes=size,
                name=manifest.name if manifest else None,
                shape=tuple(manifest.shape) if manifest else None,
                dtype=manifest.dtype if manifest else None,
            )
        )
    return entries


def prune_tables(root: Path | None = None, all_: bool = False) -> list[TableInfo]:
    """Removes invalid entries (every entry with `all_`); returns those removed.

    An entry being written or checked (lock held) is skipped. Removing a ready entry is safe for a
    process that still maps it: its pages stay until that process unmaps them.
    """
    removed = []
    for info in list_tables(root):
        if info.ready and not all_:
            continue
        with exclusive_lock(info.path / LOCK, timeout_s=0.0) as held:
            if not held:
                logger.info("skipping shared host table %s: in use by a writer", info.key)
                continue
            if not all_ and _read_manifest(info.path)[0] is not None:
                continue  # a writer finished it since it was listed
            (info.path / READY).unlink(missing_ok=True)  # first, so no reader trusts the rest
            shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info)
    return removed
