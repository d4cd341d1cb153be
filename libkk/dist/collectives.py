"""Collectives of the tensor-parallel group; each is the identity at world size 1.

Tensors of the forward pass go through the device group (NCCL on CUDA, gloo on CPU); step objects
go through the gloo control group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from libkk.dist.parallel_state import get_tp_state


# NOTE: kept out of torch.compile's trace (a graph break, like attention): the in-place collective
# runs eagerly, and a FULL CUDA graph of the forward still records it (NCCL kernels are capturable).
@torch.compiler.disable
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks (in place when there are several ranks); returns the sum."""
    state = get_tp_state()
    if state.world_size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=state.group)
    return x


@torch.compiler.disable
def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenation of every rank's `x` along the last dim, in rank order: [..., n * world]."""
    state = get_tp_state()
    if state.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    dist.all_gather(parts, x, group=state.group)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank `src` sends a picklable object (plain step data) to every rank; all return it."""
    state = get_tp_state()
    if state.world_size == 1:
        return obj
    box = [obj if state.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=state.control_group)
    return box[0]
