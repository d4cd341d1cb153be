"""Tensor-parallel execution: rank 0 in the caller's process, ranks 1..N-1 in worker processes.

The workers run libkk/engine/tp_worker.py. Start-up (the Engine drives rank 0 through these
calls):

    executor = TPExecutor(config, model_dir, device)   spawn workers, join the group (rank 0)
    load_model(...)                                     every rank loads only its slices
    executor.plan_kv_cache(num_blocks, max_model_len)   rank 0 sizes the KV cache for all ranks
    ModelRunner(...)                                    every rank builds its runner (and graphs)
    runner = executor.wrap(runner)                      waits until every worker is ready

(libkk/engine/rank.py builds every rank the same way.) Each step, `TPModelRunner.launch` sends the plain-data SchedulerOutput to every worker over its
socket (`TPExecutor.send`: pickled once, then written to each; encoded as deltas against the
previous step, libkk/engine/step_codec.py), then every rank runs its ModelRunner on it; the
forward's collectives keep them in step. A socket, not a gloo broadcast of the object: the
broadcast's round trip was ~9x longer at batch 1 (benchmarks/step_messages.py).
Every rank computes the full-vocabulary logits (greedy rows: the argmax from vocabulary shards);
rank 0's sampled tokens are the step's result.

Speculation: every rank makes the same proposer calls in step (libkk/engine/tp_proposer.py), since
a model drafter's forward runs collectives (DFlash splits like the target). Rank 0's drafts are
the ones used.

Vocab-parallel drafting (`speculative.vocab_parallel_drafting`): each rank's DFlash proposer keeps
its vocabulary shard of sampled drafts' logits, and each rank's runner is given them
(`RunnerSpeculation.shard_drafts`), so every rank verifies the drafts from its own shards in
step (libkk/spec_decode/vocab_parallel.py); rank 0's verified tokens are the ones used.

Failure: a worker reports its exception over its pipe and exits; rank 0 checks the workers before
each step and converts a failed collective into `TensorParallelError` naming the worker, its exit
code and its error. Collectives time out after `parallel.worker_timeout_s`, so a worker that hangs
fails the Session instead of blocking it. After a failure the Session refuses further steps:
the ranks may no longer be in step. `shutdown` stops the workers (politely, then by signal).

Start-up and CUDA graphs: a worker reports each start-up phase it enters (libkk/distributed/startup.py)
over its pipe, and every wait of rank 0 for its workers ends after `parallel.worker_timeout_s`
with the phase each worker was in. NCCL collectives that a CUDA graph captured or replays are not
timed by the NCCL watchdog, so on CUDA a monitor thread aborts the NCCL group when a worker exits
during start-up or a step, or when a step makes no progress for `parallel.worker_timeout_s`; the
start-up's graph captures meet in lockstep over a gloo group that times out. At shutdown every rank
resets its captured graphs before destroying the group (NCCL waits for them forever otherwise).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from libkk.config import EngineConfig
from libkk.distributed import (
    current_phase,
    destroy_tensor_parallel,
    get_tp_size,
    get_tp_state,
    init_tensor_parallel,
    set_peer_status,
)
from libkk.engine.step_codec import StepEncoder
from libkk.engine.tp_proposer import TPProposer
from libkk.errors import ConfigError, TensorParallelError
from libkk.models.arch_config import ArchConfig
from libkk.models.loader import read_arch_config
from libkk.runtime.io import LaunchedStep, RunnerOutput, SchedulerOutput
from libkk.runtime.model_runner import ModelRunner
from libkk.spec_decode.base import Proposer

logger = logging.getLogger("libkk")

_POLL_S = 0.05
_STOP_GRACE_S = 10.0


def check_parallel_config(config: EngineConfig, device: torch.device) -> None:
    """Rejects settings that tensor parallelism does not support (yet)."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return
    unsupported = {
        # A draft model's own runner and the start-up cost profiles would run collectives on
        # rank 0 alone.
        "speculative.method='draft_model'": config.speculative.method == "draft_model",
        "speculative.adaptive_verification": config.speculative.adaptive_verification,
        "model.shared_host_tables": config.model.shared_host_tables,
        "cache.kv_offload_bytes": config.cache.kv_offload_bytes is not None,
    }
    for field, used in unsupported.items():
        if used:
            raise ConfigError(
                f"{field} is not supported with tensor_parallel_size={size} yet: "
                "expected tensor_parallel_size=1 or the setting left at its default"
            )
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(
            f"tensor_parallel_size={size} needs {size} CUDA devices; "
            f"{torch.cuda.device_count()} are visible"
        )


def start_executor(
    config: EngineConfig, model_dir: Path, device: torch.device
) -> TPExecutor | None:
    """The workers of a tensor-parallel engine (None at one rank).

    NOTE: the tensor-parallel group is per process and layers are built for it, so while one
    tensor-parallel engine lives in a process no other engine can be built there.
    """
    if get_tp_size() > 1:
        raise ConfigError(
            "a tensor-parallel Session is open in this process: close it before starting "
            "another Session (one tensor-parallel group per process)"
        )
    if config.parallel.tensor_parallel_size == 1:
        return None
    return TPExecutor(config, model_dir, device)


def check_model_split(arch: ArchConfig, size: int) -> None:
    """Rejects a model whose heads or widths do not split across `size` ranks, before any worker
    starts (the layers check the same when they are built)."""
    if size == 1:
        return
    widths = {"num_attention_heads": arch.num_heads}
    if not arch.is_moe or len(arch.moe_layers) < arch.num_layers:  # some dense MLP layers
        widths["intermediate_size"] = arch.intermediate_size
    if arch.is_moe:
        widths["moe_intermediate_size"] = arch.moe_intermediate_size
    for name, value in widths.items():
        if value % size:
            raise ConfigError(
                f"tensor_parallel_size={size} does not divide the model's {name}={value}: "
                "expected a tensor-parallel size that divides it"
            )
    kv = arch.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(
            f"tensor_parallel_size={size} and the model's num_key_value_heads={kv}: expected a "
            "size that divides the KV heads, or a multiple of them (KV heads replicated)"
        )


def message_frame(message: Any) -> bytes:
    """`message` pickled and framed as `multiprocessing.connection.Connection.send` frames it (a
    4-byte big-endian length first), so a worker reads it with `Connection.recv`."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!i", len(data)) + data


def write_frame(sock: socket.socket, frame: bytes) -> None:
    """Writes a frame to a worker's socket with MSG_NOSIGNAL: a worker that is gone raises
    BrokenPipeError here. A plain write would raise SIGPIPE, and a C host that embeds Python
    keeps SIGPIPE's default action (the C ABI installs no signal handlers): it would die."""
    sock.sendall(frame, socket.MSG_NOSIGNAL)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TPExecutor:
    """Rank 0's handle on the workers: start, per-step messages, liveness, shutdown."""

    def __init__(self, config: EngineConfig, model_dir: Path, device: torch.device) -> None:
        check_parallel_config(config, device)
        check_model_split(read_arch_config(model_dir), config.parallel.tensor_parallel_size)
        self.size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.worker_timeout_s
        self.failure: str | None = None
        self.proposer: TPProposer | None = None
        self._closed = False
        self._ready = False  # every worker is in its step loop (a stop message reaches it)
        self._steps = StepEncoder()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        config_json = msgspec.json.encode(config)
        self.procs: list[_WorkerProcess] = []
        self.pipes: list[Connection] = []
        self._senders: list[socket.socket] = []  # the same sockets, to write (`write_frame`)
        self._errors: dict[int, str] = {}
        self._phases: dict[int, str] = {}  # each worker's last reported start-up phase
        self._received: dict[int, set[str]] = {}  # the kinds of message each worker sent
        self._pipe_lock = threading.Lock()  # the monitor drains the pipes during start-up too
        for rank in range(1, self.size):
            args = (rank, self.size, init_method, config_json, str(model_dir), os.getpid())
            proc, pipe = _WorkerProcess.start(args)
            self.procs.append(proc)
            self.pipes.append(pipe)
            sender = socket.socket(fileno=os.dup(pipe.fileno()))
            sender.setblocking(True)  # (a host's socket.setdefaulttimeout must not change it)
            self._senders.append(sender)
        _LIVE.add(self)
        # CUDA: a collective waiting for a dead peer never returns (the kernel spins), and one in
        # a CUDA graph is not timed by the NCCL watchdog; a monitor aborts the NCCL group when a
        # worker exits during start-up or a step, or a step stalls, so it fails instead.
        self._in_step = threading.Event()
        self._step_started = 0.0
        self._aborted: str | None = None
        # Weak references: an Engine that fails to start drops its executor, whose __del__
        # stops the workers.
        ref = weakref.ref(self)
        set_peer_status(lambda: executor.describe_workers() if (executor := ref()) else "")
        if device.type == "cuda":
            threading.Thread(
                target=_monitor_loop, args=(ref,), name="libkk-tp-monitor", daemon=True
            ).start()
        try:
            self._wait_for("started", deadline=time.monotonic() + self.timeout_s)
            if device.type == "cuda":
                torch.cuda.set_device(0)
            init_tensor_parallel(0, self.size, init_method, rank_device(device, 0), self.timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up -------------------------------------------------------------------------

    def plan_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Waits until every worker has loaded its weights, then sends the KV cache size (every
        rank allocates the same block count: block ids are shared). A worker gets
        `parallel.worker_timeout_s` more than this rank took to load its own."""
        self._wait_for("loaded", deadline=time.monotonic() + self.timeout_s)
        self._guard(lambda: self.send({"num_blocks": num_blocks, "max_len": max_model_len}))

    def wrap(self, runner: ModelRunner) -> TPModelRunner:
        """Waits until every worker built its runner (compiled and captured as this rank did,
        within `parallel.worker_timeout_s` of it); returns rank 0's step entry."""
        self._wait_for("ready", deadline=time.monotonic() + self.timeout_s)
        self._ready = True
        return TPModelRunner(runner, self)

    def wrap_proposer(self, proposer: Proposer) -> TPProposer:
        """Rank 0's proposer: its calls are made on every rank, in step (call after `wrap`)."""
        self.proposer = TPProposer(proposer, self)
        return self.proposer

    # ---- steps ----------------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raises TensorParallelError if a worker exited or reported an error."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self._closed:
            raise TensorParallelError("the tensor-parallel workers were shut down")
        for rank, (proc, pipe) in enumerate(zip(self.procs, self.pipes, strict=True), start=1):
            self._drain(rank, pipe)
            if proc.exitcode is not None or rank in self._errors:
                self._fail(rank, "")

    def launch_step(self, runner: ModelRunner, sched_out: SchedulerOutput) -> _WatchedLaunch:
        """Sends the step to every worker, then launches it here. Waiting for rank 0's tokens
        is watched like the step: the device may be waiting on a peer that died."""
        return _WatchedLaunch(self._step(runner.launch, sched_out), self)

    def _step(self, run: Callable[[SchedulerOutput], Any], sched_out: SchedulerOutput) -> Any:
        """Sends the step to every worker, then runs it here (`run`), as a watched step."""
        if self.proposer is not None:
            self.proposer.flush()  # calls queued since the last propose go first
        self.check_alive()

        def step() -> Any:
            self.send(self._steps.encode(sched_out))
            return run(sched_out)

        return self.in_step(step)

    def send(self, message: Any) -> None:
        """Sends every worker a message (a step, proposer calls, the KV cache plan, or None to
        stop), in order; each worker's loop receives it from its socket."""
        frame = message_frame(message)
        for sock in self._senders:
            write_frame(sock, frame)

    def in_step(self, fn: Any) -> Any:
        """Runs `fn` (a message sent and the collectives after it) as a step: watched by the
        monitor, any failure converted into TensorParallelError."""
        self._step_started = time.monotonic()
        self._in_step.set()
        try:
            out = self._guard(fn)
        finally:
            self._in_step.clear()
        if self._aborted is not None:  # the step "finished" on an aborted group: not trusted
            self.failure = self._aborted
            raise TensorParallelError(self.failure)
        return out

    def _monitor_once(self) -> None:
        """One look of the monitor thread (`_monitor_loop`): aborts the NCCL group if needed."""
        if self._aborted is not None or (self._ready and not self._in_step.is_set()):
            return
        reason = self._monitor_reason()
        if reason is None:
            return
        self._aborted = f"{reason}; the session cannot continue: close it and start a new one"
        logger.error("%s", self._aborted)
        group = get_tp_state().group
        if group is None:  # not joined yet: the join itself times out
            return
        try:  # unblocks this rank's pending NCCL collectives
            dist.distributed_c10d._abort_process_group(group)
        except Exception as e:  # noqa: BLE001 - best effort; the step may still time out
            logger.warning("could not abort the NCCL group: %s", e)

    def _monitor_reason(self) -> str | None:
        """Why the NCCL group must be aborted now (None: it need not): a worker exited during
        start-up or a step, or the step in progress made no progress for the timeout."""
        in_step = self._in_step.is_set()
        if not self._ready:
            self._drain_all()  # the main thread is compiling or capturing: keep phases current
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is None:
                continue
            if in_step:
                return (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode} during a step"
                )
            return (
                f"tensor-parallel worker rank {rank} exited during start-up, rank 0 being at "
                f"{current_phase()!r}: {self.describe_workers()}"
            )
        # NOTE: a step whose collectives a CUDA graph replays has no NCCL timeout of its own.
        stalled = time.monotonic() - self._step_started
        if in_step and self._ready and stalled > self.timeout_s:
            return (
                f"a tensor-parallel step made no progress for {stalled:.0f}s "
                f"(parallel.worker_timeout_s={self.timeout_s:.0f}); {self.describe_workers()}"
            )
        return None

    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure leaves the ranks out of step
            # Give a dying worker a moment to exit, so the message names it.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                if any(p.exitcode is not None for p in self.procs):
                    break
                time.sleep(_POLL_S)
            for rank, (proc, pipe) in enumerate(zip(self.procs, self.pipes, strict=True), 1):
                self._drain(rank, pipe)
                if proc.exitcode is not None or rank in self._errors:
                    self._fail(rank, f" (rank 0 saw {type(e).__name__}: {e})")
            self.failure = (
                f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e}); the ranks "
                "may be out of step, so the session cannot continue: close it"
            )
            raise TensorParallelError(self.failure) from e

    def _fail(self, rank: int, context: str) -> None:
        proc = self.procs[rank - 1]
        if proc.exitcode is None:
            proc.join(0.5)
        code = proc.exitcode
        status = "is alive" if code is None else f"exited with code {code}"
        error = self._errors.get(rank)
        detail = f": {error}" if error else ""
        self.failure = (
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) {status}{detail}{context}; "
            "the session cannot continue: close it and start a new one"
        )
        raise TensorParallelError(self.failure)

    # ---- messages from workers ------------------------------------------------------------

    def _drain(self, rank: int, pipe: Connection) -> None:
        """Reads every message the worker sent so far: its phases, errors and start-up marks."""
        with self._pipe_lock:
            try:
                while pipe.poll():
                    msg = pipe.recv()
                    if msg[0] == "error":
                        self._errors[rank] = msg[1]
                    elif msg[0] == "phase":
                        self._phases[rank] = msg[1]
                    self._received.setdefault(rank, set()).add(msg[0])
            except (EOFError, OSError):
                pass

    def _drain_all(self) -> None:
        for rank, pipe in enumerate(self.pipes, start=1):
            if not pipe.closed:
                self._drain(rank, pipe)

    def _phase_of(self, rank: int) -> str:
        phase = self._phases.get(rank)
        return f" (its last start-up phase: {phase!r})" if phase else ""

    def describe_workers(self) -> str:
        """Each worker's state as rank 0 knows it: alive or its exit, its last start-up phase
        and its reported error."""
        self._drain_all()
        parts = []
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.exitcode
            status = "alive" if code is None else f"exited with code {code}"
            error = self._errors.get(rank)
            detail = f", error: {error}" if error else ""
            parts.append(
                f"worker rank {rank} (pid {proc.pid}) {status}{self._phase_of(rank)}{detail}"
            )
        return "; ".join(parts)

    def _wait_for(self, what: str, deadline: float | None) -> None:
        """Waits until every worker sent `what`; fails on an exit, an error or the deadline."""
        pending = set(range(1, self.size))
        while pending:
            for rank in sorted(pending):
                pipe, proc = self.pipes[rank - 1], self.procs[rank - 1]
                self._drain(rank, pipe)  # the monitor thread may have drained it already
                if what in self._received.get(rank, ()):
                    pending.discard(rank)
                if rank in self._errors or (rank in pending and proc.exitcode is not None):
                    self._fail(rank, f" while waiting for it to be {what}{self._phase_of(rank)}")
            if pending and deadline is not None and time.monotonic() > deadline:
                ranks = ", ".join(map(str, sorted(pending)))
                phases = "".join(f"; rank {r}{self._phase_of(r)}" for r in sorted(pending))
                self.failure = (
                    f"tensor-parallel worker rank(s) {ranks} not {what} after "
                    f"{self.timeout_s:.0f}s (parallel.worker_timeout_s){phases}"
                )
                raise TensorParallelError(self.failure)
            if pending:
                time.sleep(_POLL_S)

    # ---- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops every worker (a stop message, then SIGTERM, then SIGKILL) and leaves the group.
        Idempotent; after it no worker process of this executor exists."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        healthy = self.failure is None and all(p.exitcode is None for p in self.procs)
        healthy = healthy and self._ready
        if healthy and self.procs and _group_joined():
            try:
                self.send(None)  # workers leave their loop and exit
            except Exception as e:  # noqa: BLE001 - fall through to signals
                logger.debug("stop message failed: %s", e)
                healthy = False
        if healthy:
            # Together with the workers: NCCL's teardown of a communicator can wait for its
            # peers' teardown, so a worker would not exit while this rank waits to join it.
            destroy_tensor_parallel()
        deadline = time.monotonic() + (_STOP_GRACE_S if healthy else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
                proc.join(2.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join(2.0)
        for pipe in self.pipes:
            pipe.close()
        for sock in self._senders:
            sock.close()
        set_peer_status(None)
        destroy_tensor_parallel()  # (a no-op if done above) resets this rank's graphs first

    def __del__(self) -> None:  # an Engine that failed to start drops its executor
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class TPModelRunner:
    """Rank 0's runner under tensor parallelism: sends each step, then runs it locally.

    Every other attribute is the wrapped ModelRunner's.
    """

    # Every rank samples each step with rank 0's grammar masks, sent with the step: a mask
    # must be known at launch.
    defers_grammar_masks = False

    def __init__(self, runner: ModelRunner, executor: TPExecutor) -> None:
        self.runner = runner
        self.executor = executor

    def launch(self, sched_out: SchedulerOutput) -> _WatchedLaunch:
        return self.executor.launch_step(self.runner, sched_out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class _WatchedLaunch:
    """Rank 0's launched step under tensor parallelism: `wait` runs as a step of the executor.
    Every other attribute is the LaunchedStep's."""

    def __init__(self, launched: LaunchedStep, executor: TPExecutor) -> None:
        self.launched = launched
        self.executor = executor

    def wait(self) -> RunnerOutput:
        return self.executor.in_step(self.launched.wait)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.launched, name)


class _WorkerProcess:
    """A worker: a fresh interpreter running `worker_entry` (not multiprocessing's spawn, which
    re-runs the caller's main module), with a socket pair for its start-up and error messages."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid

    @classmethod
    def start(cls, args: tuple) -> tuple[_WorkerProcess, Connection]:
        ours, theirs = socket.socketpair()
        # The parent's import path, as multiprocessing's spawn passes it: `python -c` would put
        # the working directory first, where a source checkout's `libkk/` (without the
        # `libkk.kernels` and `libkk.graphs` packages it maps in) would shadow the installed one.
        code = (
            f"import sys; sys.path[:] = {sys.path!r}; "
            "from libkk.engine.tp_worker import worker_entry; worker_entry()"
        )
        popen = subprocess.Popen(
            [_python_executable(), "-c", code, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            close_fds=True,
        )
        theirs.close()
        write_frame(ours, message_frame(args))
        return cls(popen), Connection(ours.detach())

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()


_LIVE: weakref.WeakSet[TPExecutor] = weakref.WeakSet()


def _monitor_loop(ref: weakref.ref[TPExecutor]) -> None:
    while True:
        time.sleep(0.2)
        executor = ref()
        if executor is None or executor._closed:
            return
        executor._monitor_once()
        del executor  # no strong reference while sleeping


@atexit.register
def _stop_all() -> None:
    for executor in list(_LIVE):
        executor.shutdown()


def _group_joined() -> bool:
    return get_tp_size() > 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python_executable() -> str:
    """The interpreter workers start with: sys.executable, unless this process embeds Python
    (the C ABI), where it may be the host program."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    for candidate in (getattr(sys, "_base_executable", ""), sys.exec_prefix + "/bin/python3"):
        name = os.path.basename(candidate or "")
        if name.startswith("python") and os.access(candidate, os.X_OK):
            return candidate
    return sys.executable
