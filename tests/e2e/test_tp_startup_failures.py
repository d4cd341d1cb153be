"""A tensor-parallel Session whose worker stops making progress during start-up fails with the
phase the worker was in, after `worker_timeout_s`, instead of hanging (CPU, gloo, two ranks).

The worker is made to stall by a `sitecustomize` module on its PYTHONPATH (each worker is a fresh
interpreter), which replaces one start-up call with a long sleep.
"""

from __future__ import annotations

import gc
import os
import time

import pytest

from libkk import Session
from libkk.errors import TensorParallelError

TIMEOUT_S = 4.0

_STALL = """
import os, time
where = os.environ.get("LIBKK_TEST_STALL")
if where == "load":
    import libkk.models.loader as loader
    loader.load_model = lambda *args, **kwargs: time.sleep(3600)
elif where == "runner":
    from libkk.runtime.model_runner import ModelRunner
    ModelRunner.__init__ = lambda self, *args, **kwargs: time.sleep(3600)
if where:
    with open(os.environ["LIBKK_TEST_STALL_PID"], "w") as f:
        f.write(str(os.getpid()))
"""


@pytest.mark.parametrize(
    ("where", "phase", "awaited"),
    [("load", "load weights", "loaded"), ("runner", "build the runner", "ready")],
)
def test_a_worker_stalled_at_startup_fails_the_session_naming_its_phase(
    tiny_qwen3_dir, tmp_path, monkeypatch, where, phase, awaited
):
    (tmp_path / "sitecustomize.py").write_text(_STALL)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("LIBKK_TEST_STALL", where)
    pid_file = tmp_path / "worker.pid"
    monkeypatch.setenv("LIBKK_TEST_STALL_PID", str(pid_file))
    start = time.monotonic()
    with pytest.raises(TensorParallelError) as excinfo:
        Session(
            str(tiny_qwen3_dir),
            tensor_parallel_size=2,
            worker_timeout_s=TIMEOUT_S,
            progress=False,
            max_num_seqs=2,
            max_model_len=128,
            num_gpu_blocks=32,
        )
    elapsed = time.monotonic() - start
    message = str(excinfo.value)
    assert f"rank(s) 1 not {awaited} after {TIMEOUT_S:.0f}s" in message
    assert f"its last start-up phase: '{phase}'" in message
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 60.0
    # The failed start drops its executor, which stops the stalled worker.
    pid = int(pid_file.read_text())
    del excinfo
    gc.collect()
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the stalled worker (pid {pid}) still runs after the failed start")
