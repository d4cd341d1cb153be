"""The tensor-parallel group of this process: world size, rank, the device and start-up groups.

One group per process (torch.distributed's default group): rank 0 is the caller's process, ranks
1..N-1 are the workers libkk starts. Before `init_tensor_parallel` (or after teardown) every query
answers as a single process (rank 0 of 1), so layers built without TP are unchanged.

CUDA graphs that captured the group's collectives are tracked (`track_captured_graph`): NCCL
(2.26 on) will not destroy or abort a communicator while a CUDA graph that captured one of its
collectives is alive; it waits for that graph forever. `destroy_tensor_parallel` resets them first.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from libkk.errors import ConfigError


@dataclass(frozen=True)
class TPState:
    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl": the group tensors of the forward pass go through
    group: dist.ProcessGroup | None  # the device group (None at world size 1)
    # Start-up lockstep checks (libkk/distributed/startup.py) go over a gloo group of their own whose
    # collectives time out after `timeout_s`.
    startup_group: dist.ProcessGroup | None = None
    timeout_s: float = 0.0


logger = logging.getLogger(__name__)

_SINGLE = TPState(rank=0, world_size=1, backend="none", group=None)
_state: TPState = _SINGLE
# CUDA graphs that captured collectives of the current group (weak: a graph freed with its
# runner needs no reset).
_captured_graphs: weakref.WeakSet[Any] = weakref.WeakSet()


def get_tp_state() -> TPState:
    return _state


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.world_size


def tp_active() -> bool:
    return _state.world_size > 1


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
) -> TPState:
    """Joins the group of `world_size` processes at `init_method` (a tcp:// address).

    Blocks until every rank has joined or `timeout_s` passed. Collectives time out after
    `timeout_s` too, so a rank that stops answering fails the others instead of hanging them.
    """
    global _state
    if not 0 <= rank < world_size:
        raise ConfigError(f"tensor-parallel rank {rank} is outside 0..{world_size - 1}")
    if _state.world_size > 1 or dist.is_initialized():
        raise ConfigError(
            "a tensor-parallel group is already active in this process: close the other "
            "tensor-parallel Session first"
        )
    if world_size == 1:
        _state = _SINGLE
        return _state
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if backend == "nccl":
        # NCCL connects each algorithm's channels on its first use (since 2.22). A connect
        # mid-session talks to the peer on the host: with a dead peer it blocks the collective's
        # call, and the abort that should end the step waits behind it. Connect all at join.
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout,
        **kwargs,
    )  # fmt: skip
    group = dist.group.WORLD
    startup = dist.new_group(backend="gloo", timeout=timeout)
    if backend == "nccl":
        # One eager collective on every rank before anything is captured: a broken device group
        # fails here instead of in the first capture or step.
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe, group=group)
        if probe.item() != world_size:
            raise RuntimeError(
                f"the NCCL group's first all-reduce gave {probe.item()}, expected {world_size}"
            )
    _state = TPState(
        rank=rank,
        world_size=world_size,
        backend=backend,
        group=group,
        startup_group=startup,
        timeout_s=timeout_s,
    )
    return _state


def track_captured_graph(graph: Any) -> None:
    """Remembers a CUDA graph (anything with `reset()`) that captured collectives of the group,
    so that `destroy_tensor_parallel` releases it before the group. No-op without a group."""
    if _state.world_size > 1:
        _captured_graphs.add(graph)


def release_captured_graphs() -> int:
    """Resets every tracked graph that is still alive (it cannot replay afterwards); returns how
    many. A graph in flight is freed by CUDA once it completes."""
    graphs = list(_captured_graphs)
    _captured_graphs.clear()
    for graph in graphs:
        try:
            graph.reset()
        except Exception as e:  # noqa: BLE001 - e.g. a CUDA error after an abort: go on
            logger.warning("could not reset a captured CUDA graph: %s", e)
    return len(graphs)


DESTROY_TIMEOUT_S = 30.0


def destroy_tensor_parallel(timeout_s: float = DESTROY_TIMEOUT_S) -> bool:
    """Leaves the group (if any); afterwards this process is a single rank again.

    The CUDA graphs that captured the group's collectives are reset first (the runner that held
    them cannot replay them afterwards). Waits at most `timeout_s` for the group to be destroyed;
    returns False (with a warning) if it was not, True otherwise.
    """
    global _state
    _state = _SINGLE
    release_captured_graphs()
    if not dist.is_initialized():
        return True
    done = threading.Event()
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def destroy() -> None:
        try:
            if cuda_device is not None:  # a new thread starts on device 0
                torch.cuda.set_device(cuda_device)
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may be gone already; nothing left to free
            pass
        finally:
            done.set()

    # NOTE: in a thread, so that a communicator NCCL cannot destroy (a CUDA graph captured
    # elsewhere still references it, or a peer is stuck) leaves this process with a warning
    # instead of hanging its close.
    threading.Thread(target=destroy, name="libkk-tp-destroy", daemon=True).start()
    if done.wait(timeout_s):
        return True
    logger.warning(
        "the tensor-parallel group was not destroyed within %.0f s (a CUDA graph that captured "
        "its NCCL collectives may still be alive); continuing without it",
        timeout_s,
    )
    return False


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    """Builds and loads layers as rank `rank` of `size` ranks, with no group: for what needs only
    the shard geometry (each rank's slices; loading runs no collective). No collective may run
    inside."""
    global _state
    previous = _state
    _state = TPState(rank=rank, world_size=size, backend="gloo", group=None)
    try:
        yield
    finally:
        _state = previous
