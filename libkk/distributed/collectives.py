"""Collectives of the tensor-parallel group; each is the identity at world size 1.

Tensors of the forward pass go through the device group (NCCL on CUDA, gloo on CPU). Step messages
do not: rank 0 writes them to each worker's socket (libkk/engine/executor.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from libkk.distributed.parallel_state import get_tp_state


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks; returns the sum (`x` itself at one rank).

    CUDA: a functional collective, which torch.compile traces into the model graph (no graph
    break) and a CUDA graph records with the rest of the forward. CPU (eager, gloo): in place.
    """
    state = get_tp_state()
    if state.world_size == 1:
        return x
    if x.is_cuda:
        # NOTE: imported here: it imports torch._dynamo (~1.4 s), which a CPU session never needs.
        from torch.distributed import _functional_collectives as funcol

        out = funcol.all_reduce(x, "sum", state.group)
        if isinstance(out, funcol.AsyncCollectiveTensor):  # eager: wait before the next op
            out = out.wait()
        return out
    x = x.contiguous()
    dist.all_reduce(x, group=state.group)
    return x


# NOTE: used on the logits after the forward and in the DFlash drafter, neither of them compiled.
def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenation of every rank's `x` along the last dim, in rank order: [..., n * world]."""
    state = get_tp_state()
    if state.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    dist.all_gather(parts, x, group=state.group)
    return torch.cat(parts, dim=-1)
