"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up on a merged [.., 2 * d] input whose first half is gate, second half up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
