"""A tensor-parallel worker process (ranks 1..N-1): started by `TPExecutor` as a fresh interpreter
running `worker_entry`, it joins the group, builds its part of the model, its runner and proposer
as rank 0 does (libkk/engine/rank.py), then carries out every step and proposer call rank 0
sends over its socket until the stop message."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch

from libkk.cache.kv_cache import KVGroups
from libkk.config import EngineConfig
from libkk.distributed import (
    destroy_tensor_parallel,
    enter_phase,
    init_tensor_parallel,
    set_phase_listener,
)
from libkk.engine.executor import rank_device
from libkk.engine.rank import KVPlan, Rank, StartupPhases, build_rank, resolve_device
from libkk.engine.step_codec import StepDecoder
from libkk.engine.threads import physical_cores
from libkk.engine.tp_proposer import ProposerCalls, apply_proposer_call
from libkk.models.arch_config import ArchConfig
from libkk.runtime.heap import freeze_startup_objects


def _watch_parent(parent_pid: int) -> None:
    """Exits this worker when the process that started it is gone (killed, crashed)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


class _ReportedPhases(StartupPhases):
    """A worker's start-up phases: each is reported to rank 0 as it begins."""

    def begin(self, name: str) -> None:
        enter_phase(name)

    def end(self, name: str, excluding: float = 0.0) -> None:
        pass


def worker_entry() -> None:
    """`python -c` entry of a worker: its arguments come first over the socket (argv[1])."""
    conn = Connection(int(sys.argv[1]))
    _worker_main(*conn.recv(), conn=conn)


def _worker_main(
    rank: int,
    size: int,
    init_method: str,
    config_json: bytes,
    model_dir: str,
    parent_pid: int,
    *,
    conn: Connection,
) -> None:
    """Rank `rank`: join the group, load this rank's weights, then run every step rank 0 sends."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    # `kill -USR1 PID` prints every thread's stack to stderr: where a stuck worker waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = 0
    destroyed = True
    # Rank 0 names this worker's last phase when the start-up stops or fails.
    set_phase_listener(lambda phase: conn.send(("phase", phase)))
    try:
        config = msgspec.json.decode(config_json, type=EngineConfig)
        device = rank_device(resolve_device(config.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            # Its share of the cores unless the settings name a count.
            torch.set_num_threads(config.num_threads or max(1, physical_cores() // size))
        conn.send(("started",))
        enter_phase("join the group")
        init_tensor_parallel(rank, size, init_method, device, config.parallel.worker_timeout_s)

        def wait_for_plan(model: torch.nn.Module, arch: ArchConfig, groups: KVGroups) -> KVPlan:
            conn.send(("loaded",))
            enter_phase("wait for the KV cache plan")
            plan = conn.recv()
            return KVPlan(plan["num_blocks"], plan["max_len"])

        # The same model, KV cache, proposer and runner as rank 0, built the same way.
        worker = build_rank(config, device, Path(model_dir), wait_for_plan, _ReportedPhases())
        enter_phase("steps")
        set_phase_listener(None)
        if config.freeze_gc:
            freeze_startup_objects()  # this process's own heap; its exit releases it
        conn.send(("ready",))
        _serve(conn, worker, launch_only=config.scheduler.async_scheduling)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process exits
        code = 1
        try:
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            conn.send(("error", detail))
        except Exception:  # noqa: BLE001 - rank 0 may be gone
            pass
        if not isinstance(e, KeyboardInterrupt):
            traceback.print_exc()
    finally:
        set_phase_listener(None)
        destroyed = destroy_tensor_parallel()  # resets this rank's captured graphs first
        conn.close()
    if not destroyed:  # a thread is stuck destroying the group: interpreter exit could wait on it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _serve(conn: Connection, worker: Rank, launch_only: bool) -> None:
    """Carries out every step and proposer call rank 0 sends, until the stop message. Every
    rank samples each step's tokens on its own device (the same tokens: the same gathered
    logits and keyed noise); async scheduling (`launch_only`) feeds them to the next step."""
    runner, proposer = worker.runner, worker.proposer
    # Context hidden states of the steps since the last proposer calls, by request.
    aux_hidden: dict[str, tuple[int, torch.Tensor]] = {}
    steps = StepDecoder()
    while (msg := conn.recv()) is not None:
        if isinstance(msg, ProposerCalls):
            assert proposer is not None
            for call in msg.calls:
                hidden = None
                if call[0] == "add_context":
                    start, hidden = aux_hidden[call[1]]
                    assert start == call[2], (call, start)
                apply_proposer_call(proposer, call, hidden)
            aux_hidden.clear()
        elif launch_only:
            runner.launch(steps.decode(msg))
        else:
            aux_hidden.update(runner.launch(steps.decode(msg)).wait().aux_hidden)
