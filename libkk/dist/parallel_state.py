"""The tensor-parallel group of this process: world size, rank, the device and control groups.

One group per process (torch.distributed's default group): rank 0 is the caller's process, ranks
1..N-1 are the workers libkk starts. Before `init_tensor_parallel` (or after teardown) every query
answers as a single process (rank 0 of 1), so layers built without TP are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from libkk.errors import ConfigError


@dataclass(frozen=True)
class TPState:
    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl": the group tensors of the forward pass go through
    group: dist.ProcessGroup | None  # the device group (None at world size 1)
    # NOTE: step objects always travel over their own gloo group: pickled objects on NCCL would
    # be copied to the GPU and back on every step, and its timeout (idle time between steps) is
    # not the forward's (a rank that stops answering mid-step).
    control_group: dist.ProcessGroup | None


_SINGLE = TPState(rank=0, world_size=1, backend="none", group=None, control_group=None)
_state: TPState = _SINGLE


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
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout,
        **kwargs,
    )  # fmt: skip
    group = dist.group.WORLD
    # Workers wait on the control group between steps, for as long as the caller is idle.
    control = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    _state = TPState(
        rank=rank, world_size=world_size, backend=backend, group=group, control_group=control
    )
    return _state


def destroy_tensor_parallel() -> None:
    """Leaves the group (if any); afterwards this process is a single rank again."""
    global _state
    _state = _SINGLE
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may be gone already; nothing left to free
            pass


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    """Builds and loads layers as rank `rank` of `size` ranks, with no group: for what needs only
    the shard geometry (each rank's slices; loading runs no collective). No collective may run
    inside."""
    global _state
    previous = _state
    _state = TPState(rank=rank, world_size=size, backend="gloo", group=None, control_group=None)
    try:
        yield
    finally:
        _state = previous
