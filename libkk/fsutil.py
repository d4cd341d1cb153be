"""File-system pieces shared by libkk's on-disk caches: checksums, atomic writes, manifests, locks.

A manifest is `manifest.json` inside the folder it vouches for: `manifest_version`, `files` (name ->
size and sha256 of every file it covers) and whatever fields its writer adds beside them. A folder
is trusted only if every listed file has the recorded size and sha256.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from libkk.errors import CorruptCheckpointError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1  # bump when the `files` layout changes

_CHUNK = 8 << 20  # bytes hashed at a time


def read_json(path: Path) -> Any:
    """The JSON in `path` (a checkpoint's config file); CorruptCheckpointError if unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{str(path)!r} is not readable JSON: {e}") from None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Makes the creations and renames inside `path` durable; best effort (some filesystems
    cannot fsync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` to a temporary sibling, fsyncs it and renames it onto `path`, so a reader
    sees the old file or the whole new one. The directory is left to the caller (`fsync_dir`)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---- the checksummed manifest -----------------------------------------------------------------


class FileRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One file in a manifest's `files`."""

    size: int
    sha256: str

    @classmethod
    def of_bytes(cls, data: bytes) -> FileRecord:
        return cls(size=len(data), sha256=hashlib.sha256(data).hexdigest())

    @classmethod
    def of_file(cls, path: Path) -> FileRecord:
        return cls(size=path.stat().st_size, sha256=sha256_file(path))

    def verify(self, name: str, data: bytes) -> str | None:
        """None if `data` is the content this record describes, else why not."""
        return self._size_problem(name, len(data)) or self._digest_problem(
            name, hashlib.sha256(data).hexdigest()
        )

    def _size_problem(self, name: str, size: int) -> str | None:
        if size == self.size:
            return None
        return f"{name} has {size} bytes, manifest says {self.size}"

    def _digest_problem(self, name: str, digest: str) -> str | None:
        if digest == self.sha256:
            return None
        return f"{name} does not match its sha256 in {MANIFEST}"


class _Layout(msgspec.Struct):
    """What every manifest holds; the fields its writer adds are ignored here."""

    manifest_version: int
    files: dict[str, FileRecord]


def write_manifest(folder: Path, files: Mapping[str, FileRecord], **fields: Any) -> bytes:
    """Writes `folder/manifest.json` atomically: `fields` (the writer's own, msgspec-encodable),
    `manifest_version` and `files`, as indented JSON with sorted keys. Returns the bytes written,
    for a marker that vouches for the manifest itself."""
    manifest = {**fields, "manifest_version": MANIFEST_VERSION, "files": dict(files)}
    raw = msgspec.json.format(msgspec.json.encode(manifest, order="sorted"), indent=2)
    write_atomic(folder / MANIFEST, raw)
    return raw


def verify_manifest(folder: Path) -> str | None:
    """None if `folder` matches its manifest, else a short reason why not ("missing" if there is
    no such folder). See `verify_files` for the cost."""
    if not folder.is_dir():
        return "missing"
    try:
        manifest = msgspec.json.decode((folder / MANIFEST).read_bytes(), type=_Layout)
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, msgspec.DecodeError) as e:
        return f"unreadable {MANIFEST}: {type(e).__name__}: {e}"
    return verify_layout(manifest.manifest_version, manifest.files) or verify_files(
        folder, manifest.files
    )


def verify_layout(manifest_version: int, files: Mapping[str, FileRecord]) -> str | None:
    """None if a parsed manifest has this module's layout and lists at least one file."""
    if manifest_version != MANIFEST_VERSION:
        return f"{MANIFEST} has an unknown layout"
    if not files:
        return f"{MANIFEST} lists no files"
    return None


def verify_files(folder: Path, files: Mapping[str, FileRecord]) -> str | None:
    """None if every file in `files` is in `folder` with its recorded size and sha256.

    Sizes first: a truncated or missing file is found without hashing anything. NOTE: then the
    full sha256 of every file (~0.35 s for the ~540 MB fp32 default model from the page cache,
    ~0.8 s from disk); size checks alone would miss a file corrupted in place.
    """
    for name, record in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if problem := record._size_problem(name, path.stat().st_size):
            return problem
    for name, record in files.items():
        if problem := record._digest_problem(name, sha256_file(folder / name)):
            return problem
    return None


# ---- the lock ---------------------------------------------------------------------------------


@contextlib.contextmanager
def exclusive_lock(path: Path, timeout_s: float | None = None) -> Iterator[bool]:
    """Holds an exclusive flock on the lock file `path` (created if absent) for the block.

    Yields True while held. With `timeout_s`, yields False if another process held the lock that
    long; the block then runs without it and decides what to do. None waits as long as it takes.
    A holder may unlink `path` (to remove what it guards): acquiring checks that the locked file
    is still the one at `path`, since a lock on an unlinked inode would exclude nobody.
    """
    fd = _acquire(path, timeout_s)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _acquire(path: Path, timeout_s: float | None) -> int | None:
    """An fd holding the flock on the file now at `path`, or None after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = 0.01
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if deadline is None else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if deadline is None or e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        else:
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)
            continue
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)
