"""The autotune store of an artifact entry: Triton autotune choices as checksummed JSON lines.

Choices are appended one complete line at a time, each with its own checksum, under a flock of the
file itself, whether or not the entry is READY (tuning happens while it is built). A crash
mid-tune leaves a torn last line at worst: readers skip it, keep the finished choices, and the next
append starts on a fresh line. The file is outside the entry's manifest and a rebuild of the entry
keeps it: the choices depend only on what is in the key.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

logger = logging.getLogger("libkk")

AUTOTUNE = "autotune.jsonl"

Choices = dict[str, dict[str, dict[str, Any]]]  # kernel -> autotune key -> config


class _AutotuneLine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kernel: str
    key: str
    config: dict[str, Any]
    sha256: str


class AutotuneStore:
    """One entry's `autotune.jsonl`. Every method logs and degrades instead of raising."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"AutotuneStore({str(self.path)!r})"

    def record(self, kernel: str, key: str, config: dict[str, Any]) -> bool:
        """Appends one finished choice; `config` holds plain JSON values. False (logged) if it
        cannot; creates the entry's folder if needed."""
        body = {"kernel": kernel, "key": key, "config": config}
        line = msgspec.json.encode({**body, "sha256": _line_digest(body)}, order="sorted") + b"\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = b"\n" + line  # seal a torn last line so this one stays parseable
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)  # releases the flock
        except OSError as e:
            logger.warning("cannot record an autotune choice in %s: %s", self.path, e)
            return False
        return True

    def load(self) -> Choices:
        """kernel -> autotune key -> config, later lines winning; bad lines are skipped (logged)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            logger.warning("cannot read autotune choices in %s: %s", self.path, e)
            return {}
        choices, bad = _parse(raw)
        if bad:
            logger.warning(
                "%s: skipped %s; kept %d finished choices, the rest will be re-tuned",
                self.path,
                ", ".join(bad),
                sum(map(len, choices.values())),
            )
        return choices

    def compact(self) -> None:
        """Drops bad lines so they are not reported on every load. Called by the entry's builder,
        with the entry's lock held."""
        # NOTE: rewritten in place under the appenders' flock, not renamed: an appender waiting
        # on the old inode's lock would otherwise write into a file nobody reads.
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            lines = [ln for ln in f.read().split(b"\n") if ln.strip()]
            good = [ln for ln in lines if _decode_line(ln) is not None]
            if len(good) != len(lines):
                f.seek(0)
                f.write(b"".join(ln + b"\n" for ln in good))
                f.truncate()
                f.flush()
                os.fsync(f.fileno())


def _line_digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()[:16]


def _decode_line(line: bytes) -> _AutotuneLine | None:
    try:
        rec = msgspec.json.decode(line, type=_AutotuneLine)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    body = {"kernel": rec.kernel, "key": rec.key, "config": rec.config}
    return rec if _line_digest(body) == rec.sha256 else None


def _parse(raw: bytes) -> tuple[Choices, list[str]]:
    choices: Choices = {}
    bad: list[str] = []
    lines = raw.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = _decode_line(line)
        if rec is None:
            torn = number == len(lines)  # no newline after it: a write cut short
            bad.append(f"line {number} ({'truncated' if torn else 'bad checksum or JSON'})")
            continue
        choices.setdefault(rec.kernel, {})[rec.key] = rec.config
    return choices, bad
