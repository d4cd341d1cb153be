"""Tensor-parallel start-up checks and teardown on two gloo ranks (two processes, CPU).

- `lockstep` passes when every rank is at the same phase, and fails every rank with each rank's
  phase named when they differ (different capture plans), or with the phase and the timeout named
  when a rank never arrives;
- `destroy_tensor_parallel` resets the tracked CUDA graphs (NCCL cannot destroy a communicator
  that a live graph captured) before it destroys the group, past one whose reset fails, and
  returns.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

TIMEOUT_S = 3.0

# Each rank runs the same scenarios in order and prints one JSON line per scenario.
_RANK = r"""
import json, sys, time
import torch
from libkk.distributed import (
    destroy_tensor_parallel, init_tensor_parallel, lockstep, track_captured_graph,
)

rank, port, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])

def report(name, **kw):
    print(json.dumps({"scenario": name, **kw}), flush=True)

def attempt(phase):
    start = time.monotonic()
    try:
        lockstep(phase)
        return {"ok": True, "seconds": time.monotonic() - start}
    except Exception as e:
        return {"ok": False, "type": type(e).__name__, "message": str(e),
                "seconds": time.monotonic() - start}

init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout)
with torch.inference_mode():  # as DecodeGraphs.capture runs it
    report("same", **attempt("decode graph q=1 size=8: warm-up"))
report("differ", **attempt(f"decode graph plan (q, size): {[(1, 8), (1, 4 * (rank + 1))]}"))

class Graph:  # stands in for torch.cuda.CUDAGraph: only reset() is used
    resets = 0
    def reset(self):
        Graph.resets += 1

class Broken:  # a graph whose reset fails (a CUDA error after an abort) stops nothing
    def reset(self):
        raise RuntimeError("CUDA error")

kept = [Graph(), Broken(), Graph()]
for g in kept:
    track_captured_graph(g)
if rank == 1:  # never reaches the phase: rank 0 waits, then fails
    time.sleep(3 * timeout)
    report("stalled", ok=True)
else:
    report("stalled", **attempt("decode graph q=1 size=4: warm-up"))
start = time.monotonic()
destroyed = destroy_tensor_parallel(timeout_s=3 * timeout)
report("destroy", destroyed=destroyed, resets=Graph.resets, seconds=time.monotonic() - start)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    """Each rank's results, by scenario."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), str(port), str(TIMEOUT_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append({r["scenario"]: r for r in map(json.loads, out.splitlines())})
    finally:
        for p in procs:
            p.kill()
    return outs


def test_ranks_at_the_same_phase_pass(results):
    assert all(r["same"]["ok"] for r in results)


def test_different_capture_plans_fail_every_rank_naming_each_phase(results):
    for r in results:
        got = r["differ"]
        assert not got["ok"] and got["type"] == "TensorParallelError"
        assert "out of step at start-up" in got["message"]
        assert "rank 0 at 'decode graph plan (q, size): [(1, 8), (1, 4)]'" in got["message"]
        assert "rank 1 at 'decode graph plan (q, size): [(1, 8), (1, 8)]'" in got["message"]


def test_a_rank_that_never_arrives_fails_the_other_after_the_timeout(results):
    got = results[0]["stalled"]
    assert not got["ok"] and got["type"] == "TensorParallelError"
    assert "stopped at 'decode graph q=1 size=4: warm-up' on rank 0" in got["message"]
    assert "within 3s (parallel.worker_timeout_s)" in got["message"]
    assert TIMEOUT_S - 0.5 < got["seconds"] < 3 * TIMEOUT_S


def test_destroy_resets_the_tracked_graphs_first_and_returns(results):
    for r in results:
        got = r["destroy"]
        assert got["resets"] == 2
        assert got["seconds"] < 3 * TIMEOUT_S + 1.0


def test_graphs_are_tracked_only_under_a_group():
    from libkk.distributed import release_captured_graphs, track_captured_graph

    class Graph:
        def reset(self):
            raise AssertionError("a graph captured without a group was reset")

    graph = Graph()
    track_captured_graph(graph)
    assert release_captured_graphs() == 0
