"""Dense linear layers, including the merged ones that stack several checkpoint tensors.

A merged layer (`qkv_proj`, `gate_up_proj`) owns one weight whose rows are the concatenation of
several Hugging Face tensors, so decode reads one weight per matmul. Each parameter carries:

- `weight_loader(param, loaded, name, shard_id)`: copies one checkpoint tensor into the parameter
  (or into the rows of one shard), checking shapes; `name` is the checkpoint name, for errors.
- `shard_ids`: the shard ids that must all be loaded before the parameter is complete
  (`frozenset({None})` for a plain parameter that is loaded whole).
- `tp_slices(shard_id) -> Slices | None`: under tensor parallelism, the part of a checkpoint tensor
  this rank holds (ranges along one dim, concatenated); None: the whole tensor. The loader reads
  only those ranges, so weight loaders always receive this rank's part.

Tensor parallelism (libkk.distributed): column-parallel layers split their output rows across ranks
(`ColumnParallelLinear`, `QKVLinear` by heads, `GateUpLinear` by intermediate), row-parallel layers
split their input columns and all-reduce the partial products (`RowParallelLinear`). At one rank
every layer is the plain one: no slices, no collective.

Parameters are allocated with `torch.empty` in the default dtype and device: the loader builds
models under `torch.device(...)` and a default-dtype context, then fills every parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from libkk.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from libkk.errors import ConfigError, CorruptCheckpointError
from libkk.kernels.gemv import linear as gemv_linear

WHOLE = frozenset({None})
# (dim, start, stop) ranges of a checkpoint tensor along one dim, concatenated in order.
Slices = list[tuple[int, int, int]]
SliceFn = Callable[[Hashable], "Slices | None"]


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
    """x W^T (+ b), as F.linear computes it, but faster for the few rows of a decode step.

    CUDA: the `libkk::linear` op (a Triton GEMV for one token, cuBLAS for more), unless autograd
    records the product (training a draft model): the op has no backward.
    NOTE: on CPU, MKL runs x @ W^T as a single-threaded gemv for one row and as a slower gemm for
    a few; the same product taken as (W @ x^T)^T ran 1.3-3x faster at 1-128 rows of SmolLM2's
    fp32 shapes on a 2-core machine, about even at 256-512 and 2x slower at 1.5K (prefill), so
    only decode-sized inputs take it. One row is doubled so it takes the gemm path too. Traced
    code (torch.compile) takes F.linear: its token count may be unbacked, not to branch on.
    """
    if takes_kernels(x, weight, bias):
        return gemv_linear(x, weight, bias)
    if (
        x.device.type != "cpu"
        or torch.compiler.is_compiling()
        or x.dim() != 2
        or x.shape[0] > _SMALL_ROWS
    ):
        return F.linear(x, weight, bias)
    rows = x if x.shape[0] > 1 else torch.cat([x, x])
    out = torch.mm(weight, rows.t()).t()[: x.shape[0]].contiguous()  # [num_tokens, out]
    return out if bias is None else out + bias


def takes_kernels(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether libkk's CUDA kernels serve an op on `x` and `params`: on CUDA, unless autograd
    records it (training a draft model; the kernels have no backward)."""
    if not x.is_cuda:
        return False
    tensors = (x, *params)
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def new_param(
    *shape: int,
    loader: WeightLoader | None = None,
    shard_ids: frozenset = WHOLE,
    tp_slices: SliceFn | None = None,
) -> nn.Parameter:
    """An uninitialized, frozen parameter in the default dtype/device, tagged for loading."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader or default_weight_loader  # type: ignore[attr-defined]
    param.shard_ids = shard_ids  # type: ignore[attr-defined]
    if tp_slices is not None:
        param.tp_slices = tp_slices  # type: ignore[attr-defined]
    return param


def tp_split(total: int, what: str, rank: int | None = None, size: int | None = None) -> range:
    """The part [start, stop) of `total` rows this rank holds; `total` must divide evenly."""
    rank = get_tp_rank() if rank is None else rank
    size = get_tp_size() if size is None else size
    if total % size:
        raise ConfigError(
            f"tensor_parallel_size={size} does not divide {what}={total}: "
            f"expected a tensor-parallel size that divides it"
        )
    per = total // size
    return range(rank * per, (rank + 1) * per)


def dim_slices(dim: int, part: range) -> SliceFn | None:
    """A `tp_slices` that takes `part` along `dim` of every shard; None at one rank."""
    if get_tp_size() == 1:
        return None
    return lambda shard_id: [(dim, part.start, part.stop)]


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


class ColumnParallelLinear(Linear):
    """A linear layer whose output rows are split across tensor-parallel ranks.

    Each rank computes its own `out_features / tp` outputs. By default nothing is gathered (the
    next layer is row-parallel or per-head); with `gather_output` every rank gets the full output
    (each element computed whole by one rank, so it equals the replicated layer's).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False
    ) -> None:
        part = tp_split(out_features, "out_features")
        super().__init__(in_features, len(part), bias)
        self.gather_output = gather_output
        slices = dim_slices(0, part)
        for param in (self.weight, self.bias):
            if param is not None and slices is not None:
                param.tp_slices = slices  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out / tp] or [T, out]
        out = linear(x, self.weight, self.bias)
        return all_gather_last_dim(out) if self.gather_output else out


class RowParallelLinear(Linear):
    """A linear layer whose input columns are split across ranks; partial products are summed.

    Takes this rank's `in_features / tp` inputs (the output of a column-parallel layer or of this
    rank's attention heads) and returns the full output on every rank. The bias is added once,
    after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        part = tp_split(in_features, "in_features")
        super().__init__(len(part), out_features, bias)
        self.full_in_features = in_features
        slices = dim_slices(1, part)
        if slices is not None:
            self.weight.tp_slices = slices  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        if get_tp_size() == 1:
            return linear(x, self.weight, self.bias)
        out = all_reduce(linear(x, self.weight))  # [num_tokens, out]
        return out if self.bias is None else out + self.bias


class MergedLinear(Linear):
    """A linear layer whose output rows are several checkpoint tensors stacked in a fixed order.

    `shards` maps a shard id to its number of output rows, in stacking order. Under tensor
    parallelism `parts` maps a shard id to the rows of its checkpoint tensor this rank holds
    (`shards` then holds the local row counts); an already-merged checkpoint tensor is read as
    the concatenation of every shard's part.
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[Hashable, int],
        bias: bool = False,
        parts: dict[Hashable, tuple[int, range]] | None = None,
    ) -> None:
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
        if parts is not None and get_tp_size() > 1:
            self._parts = parts  # shard id -> (row offset in a merged tensor, rows of this rank)
            for param in (self.weight, self.bias):
                if param is not None:
                    param.tp_slices = self._tp_slices  # type: ignore[attr-defined]

    def _tp_slices(self, shard_id: Hashable) -> Slices:
        if shard_id is not None:
            _, part = self._parts[shard_id]
            return [(0, part.start, part.stop)]
        return [(0, off + p.start, off + p.stop) for off, p in self._parts.values()]

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


def head_partition(num_heads: int, num_kv_heads: int) -> tuple[range, range]:
    """This rank's query heads and KV heads.

    Query heads split evenly; KV heads split evenly when there are at least as many as ranks,
    else each rank keeps the one KV head its query heads attend to (replicated on tp / KV ranks).
    """
    size, rank = get_tp_size(), get_tp_rank()
    heads = tp_split(num_heads, "num_attention_heads")
    if num_kv_heads >= size:
        return heads, tp_split(num_kv_heads, "num_key_value_heads")
    if size % num_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size={size} and num_key_value_heads={num_kv_heads}: with fewer KV "
            "heads than ranks, the tensor-parallel size must be a multiple of the KV head count"
        )
    kv = rank * num_kv_heads // size
    return heads, range(kv, kv + 1)


class QKVLinear(MergedLinear):
    """q, k and v projections in one weight: rows [q (H*D) | k (KV*D) | v (KV*D)].

    Under tensor parallelism it holds this rank's heads only (`num_heads`, `num_kv_heads` are the
    local counts).
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        heads, kv_heads = head_partition(num_heads, num_kv_heads)
        q_size, kv_size = len(heads) * head_dim, len(kv_heads) * head_dim
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        q_rows = range(heads.start * head_dim, heads.stop * head_dim)
        kv_rows = range(kv_heads.start * head_dim, kv_heads.stop * head_dim)
        parts = {"q": (0, q_rows), "k": (full_q, kv_rows), "v": (full_q + full_kv, kv_rows)}
        super().__init__(hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias, parts)
        self.num_heads = len(heads)
        self.num_kv_heads = len(kv_heads)
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

    Shard 0 is gate, shard 1 is up, the order `SiluAndMul` expects. Under tensor parallelism each
    rank holds rows [gate part | up part] of its `intermediate / tp` slice.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        part = tp_split(intermediate_size, "intermediate_size")
        parts = {0: (0, part), 1: (intermediate_size, part)}
        super().__init__(hidden_size, {0: len(part), 1: len(part)}, bias, parts)


def shard_expert_weights(w13: nn.Parameter, w2: nn.Parameter, intermediate_size: int) -> None:
    """Tags stacked expert weights (w13 [E, 2I/tp, H], w2 [E, H, I/tp]) with the parts of the
    checkpoint tensors this rank reads: its slice of every expert's intermediate dimension.

    Per-expert tensors (shard id (expert, part)) are [I, H] for gate/up and [H, I] for down;
    already-stacked ones (shard id None) are [E, 2I, H] and [E, H, I].
    """
    if get_tp_size() == 1:
        return
    part = tp_split(intermediate_size, "moe_intermediate_size")
    size = intermediate_size

    def w13_slices(shard_id: Hashable) -> Slices:
        if shard_id is None:
            return [(1, part.start, part.stop), (1, size + part.start, size + part.stop)]
        return [(0, part.start, part.stop)]

    def w2_slices(shard_id: Hashable) -> Slices:
        return [(2 if shard_id is None else 1, part.start, part.stop)]

    w13.tp_slices = w13_slices  # type: ignore[attr-defined]
    w2.tp_slices = w2_slices  # type: ignore[attr-defined]
