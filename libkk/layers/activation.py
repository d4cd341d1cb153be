"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from libkk.kernels import silu_and_mul, silu_and_mul_ref
from libkk.layers.linear import takes_kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up on a merged [.., 2 * d] input whose first half is gate, second half up.
    CUDA tensors take one kernel (libkk.kernels.activation), CPU tensors its torch reference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
        return (silu_and_mul if takes_kernels(x) else silu_and_mul_ref)(x)
