"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from libkk.kernels import silu_and_mul_ref


class SiluAndMul(nn.Module):
    """silu(gate) * up on a merged [.., 2 * d] input whose first half is gate, second half up.

    The torch reference: `LlamaMLP` sends CUDA inputs to `gate_up_silu` (product and
    activation in kernels), so this serves CPU tensors and autograd-recorded ones (the kernels
    have no backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
        return silu_and_mul_ref(x)
