"""Tensor-parallel state and collectives over torch.distributed (gloo on CPU, NCCL on CUDA)."""

from libkk.distributed.collectives import (
    all_gather_last_dim,
    all_reduce,
)
from libkk.distributed.parallel_state import (
    TPState,
    as_rank,
    destroy_tensor_parallel,
    get_tp_rank,
    get_tp_size,
    get_tp_state,
    init_tensor_parallel,
    release_captured_graphs,
    tp_active,
    track_captured_graph,
)
from libkk.distributed.startup import (
    current_phase,
    enter_phase,
    lockstep,
    set_peer_status,
    set_phase_listener,
)

__all__ = [
    "TPState",
    "all_gather_last_dim",
    "all_reduce",
    "as_rank",
    "current_phase",
    "destroy_tensor_parallel",
    "enter_phase",
    "get_tp_rank",
    "get_tp_size",
    "get_tp_state",
    "init_tensor_parallel",
    "lockstep",
    "release_captured_graphs",
    "set_peer_status",
    "set_phase_listener",
    "tp_active",
    "track_captured_graph",
]
