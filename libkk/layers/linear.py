"""Dense linear layers, including the merged ones that stack several checkpoint tensors.

A merged layer (`qkv_proj`, `gate_up_proj`) owns one weight whose rows are the concatenation of
several Hugging Face tensors, so decode reads one weight per matmul. Each parameter carries:

- `weight_loader(param, loaded, name, shard_id)`: copies one checkpoint tensor into the parameter
  (or into the rows of one shard), checking shapes; `name` is the checkpoint name, for errors.
- `shard_ids`: the shard ids that must all be loaded before the parameter is complete
  (`frozenset({None})` for a plain parameter that is loaded whole).

Parameters are allocated with `torch.empty` in the default dtype and device: the loader builds
models under `torch.device(...)` and a default-dtype context, then fills every parameter.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from libkk.errors import CorruptCheckpointError

WHOLE = frozenset({None})


class WeightLoader(Protocol):
    def __call__(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: Hashable = None
    ) -> None: ...


def check_shape(name: str, expected: Sequence[int], got: Sequence[int]) -> None:
    if tuple(expected) != tuple(got):
        raise CorruptCheckpointError(
            f"tensor {name!r} has shape {tuple(got)}, expected {tuple(expected)}"
        )


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: Hashable = None
) -> None:
    """Copies a whole tensor into `param`, casting to its dtype and moving to its device."""
    if shard_id is not None:
        raise ValueError(f"{name!r}: parameter takes no shard, got shard {shard_id!r}")
    check_shape(name, param.shape, loaded.shape)
    param.data.copy_(loaded)


_SMALL_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), as F.linear computes it, but faster for the few rows of a CPU decode step.

    NOTE: on CPU, MKL runs x @ W^T as a single-threaded gemv for one row and as a slower gemm for
    a few; the same product taken as (W @ x^T)^T ran 1.3-3x faster at 1-128 rows of SmolLM2's
    fp32 shapes on a 2-core machine, about even at 256-512 and 2x slower at 1.5K (prefill), so
    only decode-sized inputs take it. One row is doubled so it takes the gemm path too.
    """
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] > _SMALL_ROWS:
        return F.linear(x, weight, bias)
    rows = x if x.shape[0] > 1 else torch.cat([x, x])
    out = torch.mm(weight, rows.t()).t()[: x.shape[0]].contiguous()  # [num_tokens, out]
    return out if bias is None else out + bias


def new_param(
    *shape: int, loader: WeightLoader | None = None, shard_ids: frozenset = WHOLE
) -> nn.Parameter:
    """An uninitialized, frozen parameter in the default dtype/device, tagged for loading."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader or default_weight_loader  # type: ignore[attr-defined]
    param.shard_ids = shard_ids  # type: ignore[attr-defined]
    return param


class Linear(nn.Module):
    """y = x W^T (+ b), weight [out_features, in_features] as in nn.Linear and the checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = new_param(out_features, in_features)
        self.bias = new_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """A linear layer whose output rows are several checkpoint tensors stacked in a fixed order.

    `shards` maps a shard id to its number of output rows, in stacking order.
    """

    def __init__(self, in_features: int, shards: dict[Hashable, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_offsets: dict[Hashable, tuple[int, int]] = {}
        start = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = (start, size)
            start += size
        ids = frozenset(shards)
        self.weight.weight_loader = self._load_shard  # type: ignore[attr-defined]
        self.weight.shard_ids = ids  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard  # type: ignore[attr-defined]
            self.bias.shard_ids = ids  # type: ignore[attr-defined]

    def _load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: Hashable = None
    ) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor
            default_weight_loader(param, loaded, name)
            return
        start, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, start, size)  # rows of this shard
        check_shape(name, target.shape, loaded.shape)
        target.copy_(loaded)


class QKVLinear(MergedLinear):
    """q, k and v projections in one weight: rows [q (H*D) | k (KV*D) | v (KV*D)]."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias)
        self.q_size = q_size
        self.kv_size = kv_size

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = super().forward(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class GateUpLinear(MergedLinear):
    """gate and up projections of a gated MLP in one weight: rows [gate (I) | up (I)].

    Shard 0 is gate, shard 1 is up, the order `SiluAndMul` expects.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, {0: intermediate_size, 1: intermediate_size}, bias)
