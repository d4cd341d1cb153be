"""Shared host tables: one mapped copy of the embedding per host, same answers, crash-safe."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from libkk import SamplingParams, Session
from libkk.cache import host_tables
from libkk.cache.host_tables import READY, TABLE, list_tables, shared_table
from libkk.cli import main
from libkk.fsutil import MANIFEST

PROMPT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SMALL = dict(max_model_len=128, num_gpu_blocks=16, progress=False)
CONFIG = b'{"test": 1}'
LOGGER = "libkk.cache.host_tables"


@pytest.fixture
def shm_root(tmp_path, monkeypatch):
    """A fresh root, on tmpfs where there is one (as in production)."""
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="libkk-test-", dir=shm if shm.is_dir() else tmp_path))
    monkeypatch.setenv(host_tables.ENV_ROOT, str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _mapping_of(tensor: torch.Tensor) -> tuple[str, str]:
    """(permissions, path) of the /proc/self/maps line holding the tensor's first byte."""
    ptr = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= ptr < end:
            return fields[1], fields[-1] if len(fields) > 5 else ""
    raise AssertionError("tensor memory is in no mapping")


def _table() -> torch.Tensor:
    return torch.arange(256 * 64, dtype=torch.float32).view(256, 64) / 7.0


def _entry(root: Path) -> Path:
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return folder


# ---- the real default model ---------------------------------------------------------------------


def test_shared_table_gives_the_same_tokens_and_serves_the_tied_head(shm_root, caplog):
    with Session(**SMALL) as plain:
        expected = plain.generate(PROMPT, GREEDY).token_ids
    caplog.set_level(logging.INFO, logger=LOGGER)
    for verb in ("writing", "mapping"):  # the first session builds the entry, the second maps it
        caplog.clear()
        with Session(shared_host_tables=True, **SMALL) as shared:
            model = shared.engine.model
            weight = model.model.embed_tokens.weight
            assert model.lm_head.weight is weight  # tied: the head reads the mapped table too
            perms, path = _mapping_of(weight)
            assert perms == "r--s" and path == str(_entry(shm_root) / TABLE)
            assert shared.generate(PROMPT, GREEDY).token_ids == expected
        assert any(r.message.startswith(verb) for r in caplog.records), caplog.text
    assert len(list_tables(shm_root)) == 1 and list_tables(shm_root)[0].ready


_CHILD = """
import sys
from libkk import SamplingParams, Session
with Session(max_model_len=128, num_gpu_blocks=16, progress=False, shared_host_tables=True) as s:
    out = s.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0))
    print(out.token_ids, flush=True)
    sys.stdin.readline()  # keep the mapping while the parent measures
"""


def _smaps(pid: int, needle: str) -> tuple[dict[str, int], dict[str, int]]:
    """(Rss and Pss in bytes of the mappings of `needle`, the same for the whole process)."""
    mapping = {"Rss": 0, "Pss": 0}
    current = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            current = needle in line
        elif current and fields[0].rstrip(":") in mapping:
            mapping[fields[0].rstrip(":")] += int(fields[1]) * 1024
    total = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("Rss", "Pss"):
            total[key] = int(line.split()[1]) * 1024
    return mapping, total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_two_processes_share_one_resident_copy(shm_root):
    with Session(**SMALL) as plain:
        expected = plain.generate(PROMPT, GREEDY).token_ids
        table_bytes = plain.engine.model.model.embed_tokens.weight.nbytes
    env = {**os.environ, host_tables.ENV_ROOT: str(shm_root)}
    children = []
    try:
        for _ in range(2):  # one after the other: the first writes, the second maps
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            children.append(child)
            assert child.stdout is not None
            assert child.stdout.readline().strip() == str(expected)
        table_path = str(_entry(shm_root) / TABLE)
        measured = [_smaps(c.pid, table_path) for c in children]
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.write("\n")
                child.stdin.flush()
            child.wait(timeout=60)
    for mapping, _ in measured:
        assert mapping["Rss"] > 0.9 * table_bytes  # the LM head touched every row
        assert mapping["Pss"] < 0.6 * table_bytes  # ... but each process is charged half
    pss = sum(m["Pss"] for m, _ in measured)
    assert abs(pss - table_bytes) < 0.1 * table_bytes, (pss, table_bytes)  # counted once
    print(json.dumps({"table_bytes": table_bytes, "measured": measured}))


# ---- the entry protocol (a small table) ---------------------------------------------------------


_KILLED_WRITER = """
import os, signal, sys, torch
from libkk.cache import host_tables

def write_half_then_die(path, data):
    with open(path.with_name(f".{path.name}.tmp-{os.getpid()}"), "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

host_tables.write_atomic = write_half_then_die
table = torch.arange(256 * 64, dtype=torch.float32).view(256, 64) / 7.0
host_tables.shared_table(b'{"test": 1}', "t.weight", table)
"""


def test_a_writer_killed_midway_leaves_nothing_trusted(shm_root, caplog):
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER], timeout=60)
    assert proc.returncode == -9
    folder = _entry(shm_root)
    assert not (folder / READY).exists() and any(folder.glob(".*.tmp-*"))
    assert not list_tables(shm_root)[0].ready
    caplog.set_level(logging.INFO, logger=LOGGER)
    table = _table()
    assert torch.equal(shared_table(CONFIG, "t.weight", table), table)
    assert "rebuilding" in caplog.text and "no READY" in caplog.text
    assert (folder / READY).exists() and not any(folder.glob(".*.tmp-*"))


def _corrupt_geometry(folder: Path) -> None:
    manifest = json.loads((folder / MANIFEST).read_bytes())
    manifest["shape"] = [64, 256]
    raw = json.dumps(manifest).encode()
    (folder / MANIFEST).write_bytes(raw)
    (folder / READY).write_text(hashlib.sha256(raw).hexdigest() + "\n")  # READY vouches for it


def _truncate(folder: Path) -> None:
    with open(folder / TABLE, "r+b") as f:
        f.truncate(100)


def _flip_a_byte(folder: Path) -> None:
    data = bytearray((folder / TABLE).read_bytes())
    data[-1] ^= 0xFF
    (folder / TABLE).write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_corrupt_geometry, "manifest describes"),
        (_truncate, "bytes, manifest says"),
        (_flip_a_byte, "sha256"),
        (lambda folder: (folder / READY).unlink(), "no READY"),
    ],
)
def test_a_damaged_entry_is_rebuilt_with_a_log_line(shm_root, caplog, damage, reason):
    table = _table()
    shared_table(CONFIG, "t.weight", table)
    damage(_entry(shm_root))
    caplog.set_level(logging.INFO, logger=LOGGER)
    mapped = shared_table(CONFIG, "t.weight", table)
    assert torch.equal(mapped, table)
    assert "rebuilding" in caplog.text and reason in caplog.text, caplog.text
    assert list_tables(shm_root)[0].ready


def test_the_mapping_is_read_only_and_keyed_by_content_and_dtype(shm_root):
    table = _table()
    mapped = shared_table(CONFIG, "t.weight", table)
    assert _mapping_of(mapped) == ("r--s", str(_entry(shm_root) / TABLE))  # shared, read-only
    shared_table(CONFIG, "t.weight", table.to(torch.bfloat16))  # another dtype: another entry
    shared_table(CONFIG, "t.weight", table + 1)  # other content: another entry
    assert len(list_tables(shm_root)) == 3


def test_cli_tables_list_and_prune(shm_root, capsys):
    table = _table()
    shared_table(CONFIG, "t.weight", table)
    shared_table(CONFIG, "t.weight", table + 1)
    broken = sorted(list_tables(shm_root), key=lambda e: e.key)[0].path
    (broken / READY).unlink()
    assert main(["tables", "list"]) == 0
    out = capsys.readouterr().out
    assert "ready  t.weight  256x64 float32" in out and "invalid: no READY" in out
    assert "2 entries" in out
    assert main(["tables", "prune"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert not broken.exists() and len(list_tables(shm_root)) == 1
    assert main(["tables", "prune", "--all"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert main(["tables", "list"]) == 0
    assert "no shared host tables" in capsys.readouterr().out
