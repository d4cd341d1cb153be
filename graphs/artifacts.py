"""The artifact cache: compiled-graph artifacts on disk, keyed by everything that changes them.

Layout under the root (default `<libkk_cache_dir()>/artifacts`):

    <key>/                  one entry
        manifest.json       the `libkk.fsutil` manifest (every stored file's size and sha256)
                            plus the key inputs, created time, libkk version
        READY               sha256 of manifest.json; written last
        torch_compile.bin   bytes of `torch.compiler.save_cache_artifacts()` (the mega-cache)
        forward.bin         the model forward precompiled by torch's aot_compile: Dynamo's
                            bytecode and guards with Inductor's output (graphs/compile.py)
        autotune.jsonl      Triton autotune choices (`AutotuneStore`, autotune_store.py);
                            append-only, outside the READY protocol, kept by a rebuild
    <key>.lock              flock'd by the one process that builds or removes <key>/

The key (`ArtifactKey`, graphs/artifact_key.py) is also stored in the manifest.

Protocol. A reader trusts an entry only if READY holds the sha256 of manifest.json and every file
the manifest lists has the recorded size and sha256; anything else (no READY, a truncated file, a
flipped byte, an unparsable manifest) is logged and the entry is rebuilt, never loaded. A builder
takes `<key>.lock`, looks again (another process may have finished meanwhile), clears what is
there, writes each file to a temporary name + fsync + rename, then the manifest, then READY. A
process that cannot get the lock within the timeout carries on without the cache.

Typical use by the graph runtime:

    entry = ArtifactCache().entry(ArtifactKey.build(model_config, settings, device_name))
    if not load_compile_artifacts(entry):
        with entry.writer(model_name=name) as w:
            if w.reused:                  # another process built it while we waited
                load_compile_artifacts(entry)
            compile_and_capture()
            save_compile_artifacts(w)     # a no-op unless this process builds the entry
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from libkk.fsutil import (
    MANIFEST,
    FileRecord,
    exclusive_lock,
    fsync_dir,
    verify_layout,
    write_atomic,
    write_manifest,
)
from libkk.fsutil import verify_files as _verify_files
from libkk.models.default import libkk_cache_dir

from .artifact_key import ArtifactKey, canonical
from .autotune_store import AUTOTUNE, AutotuneStore, Choices

logger = logging.getLogger("libkk")

READY = "READY"
COMPILE_ARTIFACTS = "torch_compile.bin"
PRECOMPILED_FORWARD = "forward.bin"
DEFAULT_LOCK_TIMEOUT_S = 900.0  # a cold compile + capture of a large model takes minutes

_RESERVED = {MANIFEST, READY, AUTOTUNE}
_KEY_RE = re.compile(r"[0-9A-Za-z_-]{1,128}")
_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


def libkk_version() -> str:
    try:
        return importlib.metadata.version("libkk")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- manifest and entry info ------------------------------------------------------------------


class Manifest(msgspec.Struct, **_STRUCT):
    """An entry's manifest.json: the shared `fsutil` layout plus what built the entry."""

    manifest_version: int
    key: str
    inputs: ArtifactKey | None
    model_name: str | None
    created: float  # unix time
    libkk_version: str
    files: dict[str, FileRecord]


class EntryInfo(msgspec.Struct, **_STRUCT):
    key: str
    path: str
    ready: bool
    problem: str | None  # why the entry is not ready
    size_bytes: int
    created: float | None  # from the manifest
    last_used: float  # READY's mtime (touched on load), else the newest file's mtime
    model: str | None


# ---- one entry --------------------------------------------------------------------------------


class ArtifactEntry:
    """One key's folder. Every method logs and degrades instead of raising on a bad cache."""

    def __init__(
        self, root: Path, key: str, inputs: ArtifactKey | None, lock_timeout_s: float
    ) -> None:
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"artifact key {key!r} must match {_KEY_RE.pattern}")
        self.root = root
        self.key = key
        self.inputs = inputs
        self.path = root / key
        self.lock_path = root / f"{key}.lock"
        self.lock_timeout_s = lock_timeout_s
        self.autotune = AutotuneStore(self.path / AUTOTUNE)

    def __repr__(self) -> str:
        return f"ArtifactEntry({str(self.path)!r})"

    # ---- reading

    def problem(self, verify_files: bool = True) -> str | None:
        """None if the entry is READY and intact, else why not ("missing" if never built).

        `verify_files=False` checks READY and the manifest only, not the files' sha256.
        """
        manifest, problem = self._ready_manifest()
        if manifest is not None and verify_files:
            try:
                problem = _verify_files(self.path, manifest.files)
            except OSError as e:  # a file removed while being checked (prune)
                problem = f"unreadable: {e}"
        return problem

    def is_ready(self) -> bool:
        """READY exists, the manifest parses and every listed file matches it; logs why not."""
        problem = self.problem()
        if problem is not None:
            self._log_problem(problem)
        return problem is None

    def manifest(self) -> Manifest | None:
        """The manifest of a READY entry (files not hashed), else None."""
        return self._ready_manifest()[0]

    def _ready_manifest(self) -> tuple[Manifest | None, str | None]:
        try:
            if not self.path.is_dir():
                return None, "missing"
            try:
                ready = (self.path / READY).read_text(encoding="ascii").strip()
            except FileNotFoundError:
                return None, "no READY marker (incomplete, or being built)"
            raw = (self.path / MANIFEST).read_bytes()
            if hashlib.sha256(raw).hexdigest() != ready:
                return None, f"READY does not match {MANIFEST}"
            manifest = msgspec.json.decode(raw, type=Manifest)
        except FileNotFoundError as e:
            return None, f"{Path(e.filename or '?').name} is missing"
        except (OSError, UnicodeDecodeError, msgspec.DecodeError, msgspec.ValidationError) as e:
            return None, f"unreadable: {type(e).__name__}: {e}"
        if manifest.key != self.key:
            return None, f"{MANIFEST} is for another key"
        problem = verify_layout(manifest.manifest_version, manifest.files)
        return (None, problem) if problem else (manifest, None)

    def load_bytes(self, name: str) -> bytes | None:
        """A stored file's bytes, checked against its size and sha256; None if absent or bad.

        A bad file invalidates the entry, so the next writer rebuilds it.
        """
        manifest, problem = self._ready_manifest()
        if manifest is None:
            self._log_problem(problem or "")
            return None
        record = manifest.files.get(name)
        if record is None:
            logger.debug("artifact entry %s holds no %s", self.key, name)
            return None
        try:
            data = (self.path / name).read_bytes()
        except OSError as e:
            data, why = None, f"{name} is unreadable: {e}"
        else:
            why = record.verify(name, data)
        if why is not None:
            self.invalidate(why)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path / READY)  # last use, for `prune --older-than`
        return data

    def _log_problem(self, problem: str) -> None:
        if problem == "missing":
            logger.debug("artifact entry %s does not exist yet", self.key)
        elif problem.startswith("no READY"):
            logger.info("artifact entry %s is not ready: %s", self.key, problem)
        else:
            logger.warning(
                "artifact entry %s is invalid (%s); it will be rebuilt", self.path, problem
            )

    # ---- writing

    @contextlib.contextmanager
    def writer(
        self, *, timeout_s: float | None = None, model_name: str | None = None
    ) -> Iterator[EntryWriter]:
        """Build this entry under its lock; see `EntryWriter` for the three outcomes.

        The manifest and READY are written when the block ends without an exception and at least
        one file was put; an exception leaves the entry unready for the next writer to clear.
        """
        timeout = self.lock_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        with contextlib.ExitStack() as stack:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                held = stack.enter_context(exclusive_lock(self.lock_path, timeout))
                why = f"another process held {self.lock_path} for {timeout:.0f} s"
            except OSError as e:
                held, why = False, f"cannot lock {self.lock_path}: {e}"
            if not held:
                logger.warning("%s; continuing without the artifact cache", why)
                yield EntryWriter(self, "disabled", model_name)
                return
            waited = time.monotonic() - start
            if waited > 1.0:
                logger.info("waited %.1f s for artifact entry %s", waited, self.key)
            problem = self.problem()
            if problem is None:
                yield EntryWriter(self, "reused", model_name)
                return
            if problem != "missing":
                self._log_problem(problem)
            writer = EntryWriter(self, "build", model_name)
            try:
                self._clear()
            except OSError as e:
                logger.warning("cannot clear artifact entry %s (%s); not caching", self.path, e)
                writer.state = "disabled"
            yield writer
            writer._commit()

    def invalidate(self, reason: str) -> bool:
        """Removes READY so the next writer rebuilds; skipped while another process builds."""
        logger.warning("artifact entry %s is invalid (%s); it will be rebuilt", self.path, reason)
        try:
            with exclusive_lock(self.lock_path, 0.0) as held:
                if not held:
                    return False
                (self.path / READY).unlink(missing_ok=True)
        except OSError as e:
            logger.warning("cannot invalidate artifact entry %s: %s", self.path, e)
            return False
        return True

    def _clear(self) -> None:
        """Everything but the autotune store goes; READY first, so no reader trusts a half-cleared
        entry. Called with the lock held."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / READY).unlink(missing_ok=True)
        (self.path / MANIFEST).unlink(missing_ok=True)
        for child in self.path.iterdir():
            if child.name == AUTOTUNE:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink(missing_ok=True)
        self.autotune.compact()

    # ---- autotune store (outside the READY protocol)

    def record_autotune(self, kernel: str, key: str, config: Mapping[str, Any]) -> bool:
        """Appends one finished choice; works before READY. False (logged) if it cannot."""
        return self.autotune.record(kernel, key, canonical(config))

    def load_autotune(self) -> Choices:
        """kernel -> autotune key -> config, later lines winning; bad lines are skipped (logged)."""
        return self.autotune.load()

    # ---- info

    def info(self) -> EntryInfo:
        problem = self.problem()
        manifest = None
        with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
            manifest = msgspec.json.decode((self.path / MANIFEST).read_bytes(), type=Manifest)
        size, last_used = 0, 0.0
        for p in self.path.rglob("*") if self.path.is_dir() else ():
            with contextlib.suppress(OSError):
                st = p.lstat()
                size += st.st_size if p.is_file() else 0
                last_used = max(last_used, st.st_mtime)
        if problem is None:
            with contextlib.suppress(OSError):
                last_used = (self.path / READY).stat().st_mtime  # touched by load_bytes
        return EntryInfo(
            key=self.key,
            path=str(self.path),
            ready=problem is None,
            problem=problem,
            size_bytes=size,
            created=manifest.created if manifest else None,
            last_used=last_used,
            model=_model_name(manifest),
        )


class EntryWriter:
    """What `ArtifactEntry.writer()` yields. `state` is one of:

    - "build": this process holds the lock and builds the entry; `put` stores files.
    - "reused": another process finished the entry while this one waited; load it instead.
    - "disabled": no lock (timeout) or an I/O error; `put` does nothing, compile without caching.
    """

    def __init__(
        self,
        entry: ArtifactEntry,
        state: Literal["build", "reused", "disabled"],
        model_name: str | None,
    ) -> None:
        self.entry = entry
        self.state = state
        self.model_name = model_name
        self._files: dict[str, FileRecord] = {}

    @property
    def building(self) -> bool:
        return self.state == "build"

    @property
    def reused(self) -> bool:
        return self.state == "reused"

    def put(self, name: str, data: bytes) -> bool:
        """Stores one file (temp + fsync + rename); False if this writer does not build."""
        if name in _RESERVED or name.startswith(".") or "/" in name or name in ("", ".."):
            raise ValueError(f"{name!r} cannot be stored in an artifact entry")
        if not self.building:
            return False
        try:
            write_atomic(self.entry.path / name, data)
        except OSError as e:
            logger.warning("cannot write %s into %s (%s); not caching", name, self.entry.path, e)
            self.state = "disabled"
            return False
        self._files[name] = FileRecord.of_bytes(data)
        return True

    def _commit(self) -> None:
        if not self.building:
            return
        entry = self.entry
        if not self._files:
            logger.info("nothing was stored in artifact entry %s; it stays unready", entry.key)
            return
        try:
            raw = write_manifest(
                entry.path,
                self._files,
                key=entry.key,
                inputs=entry.inputs,
                model_name=self.model_name,
                created=time.time(),
                libkk_version=libkk_version(),
            )
            fsync_dir(entry.path)
            write_atomic(entry.path / READY, hashlib.sha256(raw).hexdigest().encode() + b"\n")
            fsync_dir(entry.path)
        except OSError as e:
            logger.warning("cannot finish artifact entry %s: %s", entry.path, e)
            (entry.path / READY).unlink(missing_ok=True)
            return
        logger.info(
            "artifact entry %s ready: %d files, %.1f MiB",
            entry.key,
            len(self._files),
            sum(r.size for r in self._files.values()) / 2**20,
        )


def _model_name(manifest: Manifest | None) -> str | None:
    if manifest is None:
        return None
    if manifest.model_name:
        return manifest.model_name
    config = manifest.inputs.model_config if manifest.inputs else {}
    name = config.get("_name_or_path") or next(iter(config.get("architectures") or []), None)
    return str(name) if name else None


# ---- the cache --------------------------------------------------------------------------------


class ArtifactCache:
    """All entries under one root; `entry(key)` for one, `list_entries` and `prune` for all."""

    def __init__(
        self, root: Path | None = None, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    ) -> None:
        self.root = Path(root) if root is not None else libkk_cache_dir() / "artifacts"
        self.lock_timeout_s = lock_timeout_s

    def entry(self, key: str | ArtifactKey) -> ArtifactEntry:
        """The entry for `key`: an `ArtifactKey` (its inputs go in the manifest) or its digest."""
        if isinstance(key, ArtifactKey):
            return ArtifactEntry(self.root, key.digest(), key, self.lock_timeout_s)
        return ArtifactEntry(self.root, key, None, self.lock_timeout_s)

    def list_entries(self) -> list[EntryInfo]:
        if not self.root.is_dir():
            return []
        return [
            ArtifactEntry(self.root, p.name, None, self.lock_timeout_s).info()
            for p in sorted(self.root.iterdir())
            if p.is_dir() and _KEY_RE.fullmatch(p.name)
        ]

    def prune(
        self, older_than_days: float | None = None, all_: bool = False, invalid_only: bool = True
    ) -> list[EntryInfo]:
        """Removes the entries that pass both filters and returns them.

        Validity: with `invalid_only` only entries that are not ready, else any. Age: with
        `older_than_days` only entries last used longer ago, else any. `all_` removes every entry.
        Entries whose lock another process holds (being built) are skipped.
        """
        cutoff = None if older_than_days is None else time.time() - older_than_days * 86400.0
        removed = []
        for info in self.list_entries():
            if not all_:
                if invalid_only and info.ready:
                    continue
                if cutoff is not None and info.last_used > cutoff:
                    continue
            entry = self.entry(info.key)
            try:
                with exclusive_lock(entry.lock_path, 0.0) as held:
                    if not held:
                        logger.info("not pruning %s: another process is building it", entry.path)
                        continue
                    shutil.rmtree(entry.path, ignore_errors=True)
                    entry.lock_path.unlink(missing_ok=True)  # safe: exclusive_lock checks the inode
            except OSError as e:
                logger.warning("cannot prune %s: %s", entry.path, e)
                continue
            removed.append(info)
        return removed


# ---- torch.compile artifacts ------------------------------------------------------------------


def save_compile_artifacts(writer: EntryWriter) -> bool:
    """Stores `torch.compiler.save_cache_artifacts()` (every Inductor / AOTAutograd / autotune
    artifact this process compiled or loaded) in the entry; False (logged) if nothing was stored.
    """
    if not writer.building:
        return False
    try:
        result = torch.compiler.save_cache_artifacts()
    except Exception as e:  # torch internals: a cache must never crash a run
        logger.warning("torch.compiler.save_cache_artifacts failed: %s: %s", type(e).__name__, e)
        return False
    if result is None:
        logger.warning("torch.compile produced no cache artifacts to store in %s", writer.entry.key)
        return False
    data, info = result
    counts = {kind: len(keys) for kind, keys in info.artifacts.items()}
    logger.info("storing %d bytes of torch.compile artifacts %s", len(data), counts)
    return writer.put(COMPILE_ARTIFACTS, data)


def load_compile_artifacts(entry: ArtifactEntry) -> bool:
    """Hot-loads the entry's torch.compile artifacts into torch's caches; call before compiling.

    False if there are none or torch rejects them; a rejected entry is invalidated to be rebuilt.
    """
    data = entry.load_bytes(COMPILE_ARTIFACTS)
    if data is None:
        return False
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # torch internals: a cache must never crash a run
        entry.invalidate(f"torch.compiler.load_cache_artifacts failed: {type(e).__name__}: {e}")
        return False
    if info is None:
        entry.invalidate("torch.compiler.load_cache_artifacts could not read the artifacts")
        return False
    counts = {kind: len(keys) for kind, keys in info.artifacts.items()}
    logger.info("loaded torch.compile artifacts from %s %s", entry.key, counts)
    return True
