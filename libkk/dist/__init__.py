"""Tensor-parallel state and collectives over torch.distributed (gloo on CPU, NCCL on CUDA)."""

from libkk.dist.collectives import (
    all_gather_last_dim,
    all_reduce,
    broadcast_object,
)
from libkk.dist.parallel_state import (
    TPState,
    as_rank,
    destroy_tensor_parallel,
    get_tp_rank,
    get_tp_size,
    get_tp_state,
    init_tensor_parallel,
    tp_active,
)

__all__ = [
    "TPState",
    "all_gather_last_dim",
    "all_reduce",
    "as_rank",
    "broadcast_object",
    "destroy_tensor_parallel",
    "get_tp_rank",
    "get_tp_size",
    "get_tp_state",
    "init_tensor_parallel",
    "tp_active",
]
