"""RMSNorm, optionally fused with the residual add that precedes it (vLLM style)."""

from __future__ import annotations

import torch
from torch import nn

from libkk.kernels.norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from libkk.layers.linear import takes_kernels


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back like Hugging Face does.

    `forward(x)` returns norm(x). `forward(x, residual)` first adds the residual and returns
    `(norm(x + residual), x + residual)`, so a decoder layer carries the un-normed stream along
    without a separate add. CUDA tensors take one fused kernel (libkk.kernels.norm), CPU tensors its
    torch reference.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # CUDA: one kernel; CPU: the op's torch reference (HF's order of casts and adds). With a
        # residual, x may be [..., terms, hidden] (an MoE layer's top-k outputs): summed first.
        kernel = takes_kernels(x, residual, self.weight)
        if residual is None:
            return (rms_norm if kernel else rms_norm_ref)(x, self.weight, self.eps)
        return (add_rms_norm if kernel else add_rms_norm_ref)(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
