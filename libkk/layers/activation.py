"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from libkk.kernels import silu_and_mul_ref


class SiluAndMul(nn.Module):
    """silu(gate) * up on a merged [.., 2 * d] input whose first half is gate, second half up.

    The torch reference: `LlamaMLP` sends CUDA inputs to `gate_up_silu` (product and
    activation in kernels), so this serves CPU tensors and autograd-recorded ones (the kernels
    have no backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
        return silu_and_mul_ref(x)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up on a merged [.., 2 * d] input (first half gate, second half up):
    transformers' `gelu_pytorch_tanh` gated MLP (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
