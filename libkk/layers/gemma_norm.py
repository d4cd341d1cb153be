"""Gemma's RMSNorm: scales by (1 + weight), in fp32, and casts back after the product."""

from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight) over the last dim, as transformers' Gemma3RMSNorm computes it.

    Unlike `RMSNorm` (Llama: the normed x is cast to the input dtype, then multiplied by the
    weight), the whole product runs in fp32 and only the result is cast back. The weight is
    stored as the checkpoint has it (zero-centred). Takes any leading shape ([T, hidden] or
    [T, heads, head_dim] for the per-head q/k norms). Plain torch on every device.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        out = out * (1.0 + self.weight.float())
        return out.type_as(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
