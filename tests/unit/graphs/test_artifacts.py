"""The artifact cache: key, READY protocol, corruption, concurrency, autotune store, prune, CLI."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import MappingProxyType

import msgspec
import pytest
import torch
from libkk.graphs import artifact_key as keys
from libkk.graphs.artifact_key import ArtifactKey, artifact_key, hash_source_tree
from libkk.graphs.artifacts import (
    AUTOTUNE,
    COMPILE_ARTIFACTS,
    MANIFEST,
    READY,
    ArtifactCache,
    ArtifactEntry,
    Manifest,
    load_compile_artifacts,
    save_compile_artifacts,
)

MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "rope_theta": 1e4}
SETTINGS = {"dtype": "bfloat16", "capture_sizes": [1, 2, 4, 8], "mode": "piecewise"}


@pytest.fixture
def cache(tmp_path: Path) -> ArtifactCache:
    return ArtifactCache(tmp_path / "artifacts", lock_timeout_s=10.0)


def _build(entry: ArtifactEntry, files: dict[str, bytes], model_name: str | None = None) -> str:
    with entry.writer(model_name=model_name) as w:
        state = w.state
        for name, data in files.items():
            w.put(name, data)
    return state


FILES = {"graph.bin": b"compiled" * 100, "extra.bin": b"\x00\x01" * 50}


# ---- the key ----------------------------------------------------------------------------------


def test_key_is_stable_across_orderings_and_container_types():
    a = artifact_key(MODEL_CONFIG, SETTINGS, "NVIDIA H200")
    reordered = dict(reversed(list(MODEL_CONFIG.items())))
    settings = MappingProxyType({**SETTINGS, "capture_sizes": (1, 2, 4, 8)})
    assert artifact_key(reordered, settings, "NVIDIA H200") == a
    assert len(a) == 32 and int(a, 16) >= 0
    key = ArtifactKey.build(MODEL_CONFIG, SETTINGS, None)
    assert key.device_name == "cpu" and key.torch == str(torch.__version__)
    assert key.cuda == torch.version.cuda
    # The inputs survive a manifest round trip and give the same digest.
    assert msgspec.json.decode(msgspec.json.encode(key), type=ArtifactKey).digest() == key.digest()


def test_key_changes_with_every_input(monkeypatch: pytest.MonkeyPatch):
    base = artifact_key(MODEL_CONFIG, SETTINGS, "NVIDIA H200")
    changed = {
        artifact_key({**MODEL_CONFIG, "hidden_size": 128}, SETTINGS, "NVIDIA H200"),
        artifact_key(MODEL_CONFIG, {**SETTINGS, "capture_sizes": [1, 2]}, "NVIDIA H200"),
        artifact_key(MODEL_CONFIG, SETTINGS, "NVIDIA H100 80GB HBM3"),
        artifact_key(MODEL_CONFIG, SETTINGS, None),
    }
    with monkeypatch.context() as m:
        m.setattr(keys, "source_hash", lambda: "0" * 64)
        changed.add(artifact_key(MODEL_CONFIG, SETTINGS, "NVIDIA H200"))
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "2.99.0")
        changed.add(artifact_key(MODEL_CONFIG, SETTINGS, "NVIDIA H200"))
    with monkeypatch.context() as m:
        m.setattr(keys, "triton_version", lambda: "9.9.9")
        changed.add(artifact_key(MODEL_CONFIG, SETTINGS, "NVIDIA H200"))
    with monkeypatch.context() as m:
        m.setattr(torch.version, "cuda", "13.9")
        changed.add(artifact_key(MODEL_CONFIG, SETTINGS, "NVIDIA H200"))
    assert base not in changed and len(changed) == 8
    assert artifact_key(MODEL_CONFIG, SETTINGS, "NVIDIA H200") == base  # patches undone


def test_key_rejects_values_it_cannot_canonicalize():
    with pytest.raises(TypeError, match="cannot go into an artifact key"):
        artifact_key(MODEL_CONFIG, {"fn": object()}, None)


def test_source_hash_follows_content_not_location(tmp_path: Path):
    def tree(root: Path, body: str) -> dict[Path, str]:
        (root / "pkg" / "__pycache__").mkdir(parents=True)
        (root / "pkg" / "mod.py").write_text(body)
        (root / "pkg" / "__pycache__" / "junk.py").write_text(str(root))
        (root / "pkg" / "data.txt").write_text(str(root))
        return {root / "pkg": "libkk.graphs"}

    one = hash_source_tree(tree(tmp_path / "a", "x = 1\n"))
    assert hash_source_tree(tree(tmp_path / "b", "x = 1\n")) == one  # moved, same content
    assert hash_source_tree(tree(tmp_path / "c", "x = 2\n")) != one  # edited
    assert hash_source_tree({tmp_path / "a" / "pkg": "libkk.kernels"}) != one  # renamed module


def test_source_hash_covers_graphs_and_kernels():
    roots = {Path(keys.__file__).resolve().parent: "libkk.graphs"}
    assert keys.source_hash() == keys.source_hash()  # cached, stable
    assert keys.source_hash() != hash_source_tree(roots)
    import libkk

    without_graphs = hash_source_tree({Path(libkk.__file__).resolve().parent: "libkk"})
    assert keys.source_hash() != without_graphs


# ---- the READY protocol -----------------------------------------------------------------------


def test_writer_stores_files_then_manifest_then_ready(cache: ArtifactCache):
    key = ArtifactKey.build(MODEL_CONFIG, SETTINGS, None)
    entry = cache.entry(key)
    assert not entry.is_ready() and entry.load_bytes("graph.bin") is None
    with entry.writer(model_name="tiny") as w:
        assert w.building and not w.reused
        assert w.put("graph.bin", FILES["graph.bin"])
        assert (entry.path / "graph.bin").exists()
        assert not (entry.path / READY).exists() and not entry.is_ready()
        with pytest.raises(ValueError):
            w.put(READY, b"")
    assert entry.is_ready()
    assert entry.load_bytes("graph.bin") == FILES["graph.bin"]
    assert entry.load_bytes("absent.bin") is None
    manifest = msgspec.json.decode((entry.path / MANIFEST).read_bytes(), type=Manifest)
    assert manifest.key == key.digest() and manifest.inputs == key
    assert manifest.model_name == "tiny" and manifest.libkk_version
    assert manifest.files["graph.bin"].size == len(FILES["graph.bin"])
    # A second writer finds it READY and builds nothing.
    assert _build(entry, {"graph.bin": b"other"}) == "reused"
    assert entry.load_bytes("graph.bin") == FILES["graph.bin"]


def test_an_exception_or_nothing_stored_leaves_the_entry_unready(cache: ArtifactCache):
    entry = cache.entry("abc123")
    with pytest.raises(RuntimeError), entry.writer() as w:
        w.put("graph.bin", b"half")
        raise RuntimeError("compile failed")
    assert not entry.is_ready()
    assert _build(entry, {}) == "build"
    assert not entry.is_ready()
    assert _build(entry, FILES) == "build" and entry.is_ready()
    assert not (entry.path / "graph.bin.tmp").exists()


def test_missing_ready_means_not_ready(cache: ArtifactCache, caplog: pytest.LogCaptureFixture):
    entry = cache.entry("abc123")
    _build(entry, FILES)
    (entry.path / READY).unlink()
    with caplog.at_level(logging.INFO, logger="libkk"):
        assert not entry.is_ready()
    assert "no READY marker" in caplog.text
    assert entry.load_bytes("graph.bin") is None


def test_truncated_file_is_detected_and_rebuilt(
    cache: ArtifactCache, caplog: pytest.LogCaptureFixture
):
    entry = cache.entry("abc123")
    _build(entry, FILES)
    path = entry.path / "graph.bin"
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="libkk"):
        assert not entry.is_ready()
    assert "graph.bin has 100 bytes" in caplog.text
    assert _build(entry, FILES) == "build"
    assert entry.is_ready() and entry.load_bytes("graph.bin") == FILES["graph.bin"]


def test_flipped_byte_is_detected_logged_and_rebuilt(
    cache: ArtifactCache, caplog: pytest.LogCaptureFixture
):
    entry = cache.entry("abc123")
    _build(entry, FILES)
    path = entry.path / "graph.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="libkk"):
        assert not entry.is_ready()
        assert entry.load_bytes("graph.bin") is None  # never the wrong bytes
    assert "does not match its sha256" in caplog.text and "will be rebuilt" in caplog.text
    assert not (entry.path / READY).exists()  # invalidated by the failed load
    assert _build(entry, FILES) == "build"
    assert entry.load_bytes("graph.bin") == FILES["graph.bin"]


@pytest.mark.parametrize("damage", ["garbage", "other-key", "ready-mismatch", "no-manifest"])
def test_damaged_manifest_or_marker_is_not_ready(cache: ArtifactCache, damage: str):
    entry = cache.entry("abc123")
    _build(entry, FILES)
    manifest = entry.path / MANIFEST
    if damage == "garbage":
        manifest.write_bytes(b'{"manifest_ver')
    elif damage == "other-key":
        manifest.write_bytes(manifest.read_bytes().replace(b"abc123", b"abc999"))
    elif damage == "ready-mismatch":
        (entry.path / READY).write_text("0" * 64)
    else:
        manifest.unlink()
    assert not entry.is_ready() and entry.manifest() is None
    assert entry.load_bytes("graph.bin") is None
    assert _build(entry, FILES) == "build" and entry.is_ready()


def _race(root: str, start: mp.synchronize.Barrier, results: mp.Queue) -> None:
    entry = ArtifactCache(Path(root), lock_timeout_s=30.0).entry("shared")
    start.wait()
    if entry.is_ready():
        results.put("reused")
        return
    with entry.writer() as w:
        if w.building:
            time.sleep(0.3)  # a slow compile: the others must wait, not build
            w.put("graph.bin", FILES["graph.bin"])
        results.put(w.state)


def test_concurrent_writers_build_once(cache: ArtifactCache):
    ctx = mp.get_context("fork")
    start, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(cache.root), start, results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    states = sorted(results.get(timeout=5) for _ in procs)
    assert states == ["build", "reused", "reused"]
    entry = cache.entry("shared")
    assert entry.is_ready() and entry.load_bytes("graph.bin") == FILES["graph.bin"]


def test_lock_timeout_proceeds_without_the_cache(
    cache: ArtifactCache, caplog: pytest.LogCaptureFixture
):
    entry = cache.entry("abc123")
    with entry.writer() as first:
        assert first.building
        first.put("graph.bin", FILES["graph.bin"])
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="libkk"), entry.writer(timeout_s=0.2) as w:
            assert w.state == "disabled" and not w.building and not w.reused
            assert not w.put("graph.bin", b"from the impatient one")
        assert 0.2 <= time.monotonic() - start < 5
        assert "continuing without the artifact cache" in caplog.text
    assert entry.load_bytes("graph.bin") == FILES["graph.bin"]


# ---- autotune store ---------------------------------------------------------------------------


def test_autotune_store_survives_a_torn_last_line(
    cache: ArtifactCache, caplog: pytest.LogCaptureFixture
):
    entry = cache.entry("abc123")
    assert entry.load_autotune() == {}
    # Before READY, with no entry folder yet: tuning happens while the entry is built.
    for m in (16, 32, 64):
        assert entry.record_autotune("matmul", f"M={m}", {"BLOCK_M": m, "num_warps": 4})
    entry.record_autotune("rmsnorm", "N=64", {"BLOCK": 64})
    entry.record_autotune("matmul", "M=16", {"BLOCK_M": 32, "num_warps": 8})  # re-tuned: wins
    store = entry.path / AUTOTUNE
    lines = store.read_bytes().splitlines(keepends=True)
    bad = lines[1].replace(b'"BLOCK_M":32', b'"BLOCK_M":33')  # valid JSON, wrong checksum
    store.write_bytes(b"".join([lines[0], bad, *lines[2:]]) + lines[0][:25])  # crash mid-write
    with caplog.at_level(logging.WARNING, logger="libkk"):
        choices = entry.load_autotune()
    assert choices == {
        "matmul": {
            "M=16": {"BLOCK_M": 32, "num_warps": 8},
            "M=64": {"BLOCK_M": 64, "num_warps": 4},
        },
        "rmsnorm": {"N=64": {"BLOCK": 64}},
    }
    assert "truncated" in caplog.text and "bad checksum" in caplog.text
    # The next append starts on a fresh line; the torn one stays skipped.
    entry.record_autotune("matmul", "M=32", {"BLOCK_M": 32, "num_warps": 4})
    assert entry.load_autotune()["matmul"]["M=32"] == {"BLOCK_M": 32, "num_warps": 4}
    # A rebuild keeps the finished choices and drops the bad lines.
    assert _build(entry, FILES) == "build"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="libkk"):
        assert len(entry.load_autotune()["matmul"]) == 3
    assert not caplog.text
    assert entry.is_ready()  # the store is outside the manifest: appending breaks nothing
    entry.record_autotune("matmul", "M=128", {"BLOCK_M": 128})
    assert entry.is_ready()


# ---- list and prune ---------------------------------------------------------------------------


def _age(entry: ArtifactEntry, days: float) -> None:
    t = time.time() - days * 86400
    for p in [entry.path, *entry.path.rglob("*")]:
        os.utime(p, (t, t))


def test_list_and_prune(cache: ArtifactCache):
    assert cache.list_entries() == [] and cache.prune(all_=True) == []
    fresh = cache.entry(ArtifactKey.build(MODEL_CONFIG, SETTINGS, None))
    _build(fresh, FILES)
    named = cache.entry("bbb")
    _build(named, FILES, model_name="SmolLM2")
    old = cache.entry("ccc")
    _build(old, FILES)
    _age(old, 10)
    broken = cache.entry("ddd")
    broken.record_autotune("k", "x", {"a": 1})  # a folder with no READY
    infos = {i.key: i for i in cache.list_entries()}
    assert set(infos) == {fresh.key, "bbb", "ccc", "ddd"}
    assert infos[fresh.key].ready and infos[fresh.key].model == "LlamaForCausalLM"
    assert infos["bbb"].model == "SmolLM2" and infos["bbb"].size_bytes > 1000
    assert infos["bbb"].created is not None and infos["ddd"].created is None
    assert not infos["ddd"].ready and "READY" in (infos["ddd"].problem or "")
    assert infos["ccc"].last_used < time.time() - 9 * 86400

    assert [i.key for i in cache.prune()] == ["ddd"]  # invalid only
    assert cache.prune(older_than_days=5) == []  # the old one is valid
    assert [i.key for i in cache.prune(older_than_days=5, invalid_only=False)] == ["ccc"]
    assert not old.path.exists() and not old.lock_path.exists()
    assert {i.key for i in cache.prune(all_=True)} == {fresh.key, "bbb"}
    assert cache.list_entries() == []


def test_prune_skips_an_entry_being_built(cache: ArtifactCache):
    entry = cache.entry("abc123")
    with entry.writer() as w:
        w.put("graph.bin", b"x")
        assert cache.prune(all_=True) == []
    assert entry.is_ready()
    assert [i.key for i in cache.prune(all_=True)] == ["abc123"]


def test_loading_a_used_entry_marks_it_recent(cache: ArtifactCache):
    entry = cache.entry("abc123")
    _build(entry, FILES)
    _age(entry, 10)
    assert entry.load_bytes("graph.bin") is not None
    assert cache.prune(older_than_days=5, invalid_only=False) == []


# ---- torch.compile artifacts ------------------------------------------------------------------


def test_compile_artifact_failures_fall_back(
    cache: ArtifactCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    entry = cache.entry("abc123")
    assert not load_compile_artifacts(entry)  # nothing stored yet
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    with entry.writer() as w:
        assert not save_compile_artifacts(w)
    assert not entry.is_ready()

    def boom(*_: object) -> None:
        raise RuntimeError("serializer broke")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", boom)
    with entry.writer() as w:
        assert not save_compile_artifacts(w)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"blob", _Info()))
    with entry.writer() as w:
        assert save_compile_artifacts(w)
    assert entry.load_bytes(COMPILE_ARTIFACTS) == b"blob"
    with entry.writer() as w:  # reused: nothing to save
        assert not save_compile_artifacts(w)

    for rejected in (boom, lambda data: None):
        monkeypatch.setattr(torch.compiler, "load_cache_artifacts", rejected)
        with caplog.at_level(logging.WARNING, logger="libkk"):
            assert not load_compile_artifacts(entry)
        assert not entry.is_ready()  # invalidated, so the next writer rebuilds it
        with entry.writer() as w:
            assert w.building and save_compile_artifacts(w)
    assert "load_cache_artifacts" in caplog.text


class _Info:
    artifacts = {"inductor": ["k1"]}


_ROUND_TRIP = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from libkk.graphs.artifacts import ArtifactCache, load_compile_artifacts, save_compile_artifacts

    mode, root = sys.argv[1], Path(sys.argv[2])
    entry = ArtifactCache(root).entry("roundtrip")
    loaded = load_compile_artifacts(entry) if mode == "load" else False
    f = torch.compile(lambda x: torch.sin(x) * 2 + x.cos())
    x = torch.linspace(-3, 3, 8)
    ok = torch.allclose(f(x), torch.sin(x) * 2 + x.cos())
    saved = False
    if mode == "save":
        with entry.writer() as w:
            saved = save_compile_artifacts(w)
    print(json.dumps({"ok": ok, "loaded": loaded, "saved": saved,
                      "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}))
    """
)


@pytest.mark.slow
def test_torch_compile_round_trip_through_a_fresh_process(tmp_path: Path):
    """Compile in one process, store; hot-load in another whose Inductor caches lack the graph.

    Both processes share one Inductor cache folder kept between runs (so C++ headers and kernels
    are not rebuilt each time) with its graph caches removed first: a hit in the second process
    can only come from the loaded artifacts.
    """
    inductor = Path(tempfile.gettempdir()) / f"libkk-test-inductor-{os.getuid()}"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}

    def run(mode: str) -> dict:
        for sub in ("fxgraph", "aotautograd"):
            shutil.rmtree(inductor / sub, ignore_errors=True)
        try:
            done = subprocess.run(
                [sys.executable, "-c", _ROUND_TRIP, mode, str(tmp_path / "artifacts")],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            pytest.skip("torch.compile of a tiny function took over 300 s on this machine")
        if done.returncode != 0:
            pytest.skip(f"torch.compile does not work on this CPU: {done.stderr[-800:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    saved = run("save")
    assert saved["ok"] and saved["saved"] and saved["misses"] >= 1
    loaded = run("load")
    assert loaded["ok"] and loaded["loaded"]
    assert loaded["hits"] >= 1 and loaded["misses"] == 0


# ---- CLI --------------------------------------------------------------------------------------


def test_cli_list_and_prune(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    from libkk.cli import main

    monkeypatch.setenv("LIBKK_CACHE_DIR", str(tmp_path))
    assert main(["cache", "list"]) == 0
    assert "no compiled-graph artifacts" in capsys.readouterr().out
    cache = ArtifactCache()
    assert cache.root == tmp_path / "artifacts"
    _build(cache.entry("aaa111"), FILES, model_name="SmolLM2")
    old = cache.entry("bbb222")
    _build(old, FILES)
    _age(old, 30)
    cache.entry("ccc333").record_autotune("k", "x", {"a": 1})

    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "KEY" in out and "aaa111" in out and "SmolLM2" in out and "3 entries" in out
    assert "invalid: no READY marker" in out

    assert main(["cache", "prune"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert main(["cache", "prune", "--older-than", "7"]) == 0
    assert "bbb222" in capsys.readouterr().out
    assert [i.key for i in cache.list_entries()] == ["aaa111"]
    assert main(["cache", "prune", "--all"]) == 0
    assert cache.list_entries() == []


def test_cli_warm_loads_the_model_through_a_session(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    import libkk.api.session as session_module
    from libkk.cli import main

    seen = {}

    class FakeSession:
        def __init__(self, model=None, *, config):
            seen.update(
                model=model or config.model.model,
                device=config.device,
                seqs=config.scheduler.max_num_seqs,
            )
            runner = type("R", (), {"compile_cache": "off"})()
            self.engine = type("E", (), {"device": torch.device("cpu"), "runner": runner})()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(session_module, "Session", FakeSession)
    assert main(["cache", "warm", "/models/x", "--device", "cpu", "--set", "max_num_seqs=4"]) == 0
    assert seen == {"model": "/models/x", "device": "cpu", "seqs": 4}
    assert "warmed /models/x on cpu in" in (out := capsys.readouterr().out)
    assert "(artifact cache: off)" in out
