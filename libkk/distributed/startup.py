"""Start-up progress of a tensor-parallel rank: named phases, and lockstep checks between ranks.

Each rank enters named phases while it starts ("load weights", "decode graph q=1 size=8:
capture", ...). A worker reports each phase to rank 0 (its listener sends it over the worker's
pipe), so a start-up that stops names the phase every rank was in.

Before each CUDA graph capture the ranks meet in `lockstep`: over a gloo group whose collectives
time out after `parallel.worker_timeout_s`, every rank checks that all ranks are at the same phase.
Two ranks whose capture plans differ, or a rank that stops (stuck, or gone), then fail every rank
with the phase named, instead of leaving NCCL collectives (which a CUDA graph capture does not let
the NCCL watchdog time) waiting for each other forever.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from libkk.distributed.parallel_state import get_tp_state
from libkk.errors import TensorParallelError

_phase = "start"
_listener: Callable[[str], None] | None = None
_peer_status: Callable[[], str] | None = None


def set_phase_listener(listener: Callable[[str], None] | None) -> None:
    """`listener(phase)` is called on every phase this rank enters (None: no listener)."""
    global _listener
    _listener = listener


def set_peer_status(describe: Callable[[], str] | None) -> None:
    """`describe()` tells what is known of the other ranks (rank 0: its workers' last phases and
    exits); lockstep failures on this rank include it."""
    global _peer_status
    _peer_status = describe


def current_phase() -> str:
    return _phase


def enter_phase(phase: str) -> None:
    """Records that this rank starts `phase` and tells the listener."""
    global _phase
    _phase = phase
    if _listener is not None:
        _listener(phase)


def lockstep(phase: str) -> None:
    """Enters `phase`, then waits until every rank has entered the same phase.

    Raises TensorParallelError if another rank is at a different phase (the ranks would run
    different collectives), or if some rank does not arrive within the start-up timeout. No-op at
    one rank.
    """
    enter_phase(phase)
    state = get_tp_state()
    if state.world_size == 1 or state.startup_group is None:
        return
    phases: list[str | None] = [None] * state.world_size
    try:
        dist.all_gather_object(phases, phase, group=state.startup_group)
    except Exception as e:  # noqa: BLE001 - gloo reports a timeout or a lost peer as RuntimeError
        raise TensorParallelError(
            f"tensor-parallel start-up stopped at {phase!r} on rank {state.rank}: not every rank "
            f"reached it within {state.timeout_s:.0f}s (parallel.worker_timeout_s), or a rank "
            f"left ({type(e).__name__}: {e}){_peers()}"
        ) from e
    if any(p != phase for p in phases):
        at = ", ".join(f"rank {r} at {p!r}" for r, p in enumerate(phases))
        raise TensorParallelError(
            f"tensor-parallel ranks are out of step at start-up: {at}; every rank must capture "
            "the same graphs in the same order"
        )


def _peers() -> str:
    if _peer_status is None:
        return ""
    try:
        status = _peer_status()
    except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the failure itself
        status = f"(no status: {e})"
    return f"; {status}" if status else ""
