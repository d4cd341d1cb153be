"""RMSNorm, optionally fused with the residual add that precedes it (vLLM style)."""

from __future__ import annotations

import torch
from torch import nn

from libkk.kernels.norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back like Hugging Face does.

    `forward(x)` returns norm(x). `forward(x, residual)` first adds the residual and returns
    `(norm(x + residual), x + residual)`, so a decoder layer carries the un-normed stream along
    without a separate add. CUDA tensors take one fused kernel (libkk.kernels.norm).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        dtype = x.dtype
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        # NOTE: HF casts back to the input dtype *before* the weight multiply; keep that order so
        # bf16 rounding matches too.
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        # NOTE: the add runs in the activation dtype, as in HF's `residual + hidden_states`.
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
