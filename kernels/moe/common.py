"""Shared pieces of the MoE kernels: formats, the error type, tile configs, input checks and the
W4A16 epilogues both expert paths (sorted and pair-major) round alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from libkk.errors import LibkkError

from .._jit import jit

FORMATS = ("nvfp4", "mxfp4")
GROUP = {"nvfp4": 16, "mxfp4": 32}
SCORING = ("softmax", "sigmoid")
GATED_ACTIVATIONS = ("silu", "clamped_swiglu")
_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class MoeKernelError(LibkkError, ValueError):
    """An input of a MoE op has the wrong shape, dtype or value."""


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int
    block_n: int
    block_k: int  # K elements per step (block_k / 2 packed bytes); a multiple of 32
    num_warps: int
    num_stages: int
    # Pair-major only: programs along gate_up's K per tile (more programs in flight for the few
    # pairs of a decode step); the tile's last one sums the partials in order.
    split_k: int = 1
    # Pair-major only: the down kernel's own rows per program, K step and warps (0: gate_up's).
    # gate_up reads the long rows of the hidden size, down the short rows of the intermediate
    # size, and the two want different tiles (benchmarks/moe_pair_tiles.py).
    down_block_n: int = 0
    down_block_k: int = 0
    down_num_warps: int = 0

    def down_tile(self) -> tuple[int, int, int]:
        """(block_n, block_k, num_warps) of the pair-major down kernel."""
        return (
            self.down_block_n or self.block_n,
            self.down_block_k or self.block_k,
            self.down_num_warps or self.num_warps,
        )


# Sorted path (experts' rows gathered into M tiles), measured on the H200 at the Qwen3-30B-A3B
# shape (benchmarks/moe.py --sweep). Decode: a 16-row tile (tl.dot's minimum) wastes the least,
# and narrow N tiles spread the few touched experts' weight stream over many SMs. Prefill: 64-row
# tiles; from 4096 tokens up, 128-square tiles reuse each dequantized weight tile over more rows
# (a layer at 4096 tokens: 1.33 against 1.39 ms; at 16384: 4.4 against 5.6 ms).
DECODE_CONFIG = MoeTileConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=3)
PREFILL_CONFIG = MoeTileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
LARGE_PREFILL_CONFIG = MoeTileConfig(block_m=128, block_n=128, block_k=128, num_warps=8,
                                     num_stages=3)  # fmt: skip
DECODE_MAX_TOKENS = 64
LARGE_PREFILL_MIN_TOKENS = 4096
# block_m of a W4A16 tile config that selects the pair-major decode path (no M tiles; see there).
PAIR_MAJOR = 1
# Up to 16 tokens the pair-major path runs by default: on the H200 at the Qwen3-30B-A3B shape it
# took half the sorted path's time at 1, 4 and 16 tokens (benchmarks/moe.py --sweep). Above, pairs
# share experts often enough that reading each touched expert once wins. At 1-2 tokens, where
# 8-16 pairs need many programs to fill the SMs: gate_up on one warp per 4 rows with 1024-element
# K steps (7.5 us at one token against 9.9 us for 8 rows, 256-element steps and 2 warps), down on
# 32-row tiles (4.6 against 5.3 us; benchmarks/moe_pair_tiles.py); 32-row tiles for both above.
PAIR_MAJOR_MAX_TOKENS = 16
PAIR_DECODE_NARROW = MoeTileConfig(block_m=PAIR_MAJOR, block_n=4, block_k=1024, num_warps=1,
                                   num_stages=1, down_block_n=32, down_block_k=256,
                                   down_num_warps=4)  # fmt: skip
PAIR_DECODE_CONFIG = MoeTileConfig(block_m=PAIR_MAJOR, block_n=32, block_k=256, num_warps=4,
                                   num_stages=3)  # fmt: skip


@dataclass(frozen=True)
class ExpertActivation:
    """The gated activation between an expert's two projections.

    "silu": silu(gate) * up. "clamped_swiglu" (gpt-oss): gate clamped above at `limit`, up to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in GATED_ACTIVATIONS:
            raise _err(
                f"expert activation {self.kind!r} is not one of {', '.join(GATED_ACTIVATIONS)}"
            )


SILU = ExpertActivation()


def expert_activation_ref(
    gate: torch.Tensor, up: torch.Tensor, act: ExpertActivation = SILU
) -> torch.Tensor:
    """The activation in torch, in the inputs' dtype (what the unfused model computes)."""
    if act.kind == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return gate * torch.sigmoid(gate * act.alpha) * (up + 1)


def default_tile_config(num_tokens: int) -> MoeTileConfig:
    """The W4A16 tiles run when nothing measured is installed for the layer's shape."""
    if num_tokens <= 2:
        return PAIR_DECODE_NARROW
    if num_tokens <= PAIR_MAJOR_MAX_TOKENS:
        return PAIR_DECODE_CONFIG
    if num_tokens <= DECODE_MAX_TOKENS:
        return DECODE_CONFIG
    return PREFILL_CONFIG if num_tokens < LARGE_PREFILL_MIN_TOKENS else LARGE_PREFILL_CONFIG


def _err(msg: str) -> MoeKernelError:
    return MoeKernelError(msg)


@dataclass(frozen=True)
class W4A8TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


W4A8_PREFILL_CONFIG = W4A8TileConfig(block_m=64, block_n=128, num_warps=8, num_stages=3)


def _check_w4(
    name: str,
    weight: torch.Tensor,  # [E, N, K/2] uint8
    scale: torch.Tensor,  # [E, N, K/G] uint8
    global_scale: torch.Tensor,  # [E, parts] fp32
    fmt: str,
    k: int,
    n: int,
    parts: int,
) -> None:
    if fmt not in FORMATS:
        raise _err(f"weight format {fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    if weight.dtype != torch.uint8 or weight.dim() != 3 or weight.shape[1:] != (n, k // 2):
        raise _err(
            f"{name} must be uint8 [E, {n}, {k // 2}] (two E2M1 per byte), got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    e = weight.shape[0]
    g = GROUP[fmt]
    if k % g:
        raise _err(f"{name}: K = {k} must be a multiple of the {fmt} block size {g}")
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (e, n, k // g):
        raise _err(
            f"{name} scales must be uint8 [{e}, {n}, {k // g}] (scale bytes), got "
            f"{scale.dtype} {tuple(scale.shape)}"
        )
    if global_scale.dtype != torch.float32 or tuple(global_scale.shape) != (e, parts):
        raise _err(
            f"{name} global scales must be fp32 [{e}, {parts}], got {global_scale.dtype} "
            f"{tuple(global_scale.shape)}"
        )
    if weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise _err(f"{name} weights and scales must be contiguous in their last dim")


def _check_rows(x: torch.Tensor, name: str, width: int) -> None:
    if x.dim() != 2 or x.shape[1] != width or x.dtype not in _ACT_DTYPES:
        raise _err(
            f"{name} must be float32/float16/bfloat16 [rows, {width}], got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if x.stride(-1) != 1:
        raise _err(f"{name} must be contiguous in its last dim")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@jit
def _global_scale(g_ptr, index, IS_NVFP4: tl.constexpr):
    """Global scale `index` of an NVFP4 weight (fp32); MXFP4 weights have none: 1.0."""
    scale = 1.0
    if IS_NVFP4:
        scale = tl.load(g_ptr + index)
    return scale


@jit
def _silu_mul(acc_gate, acc_up, DT: tl.constexpr):
    """SiLU(gate) * up in DT from fp32 accumulators, each projection rounded to DT first, as the
    unfused linear and the dequantized reference round them."""
    gate = acc_gate.to(DT).to(tl.float32)
    up = acc_up.to(DT).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
    return (act * up).to(DT)


# ACT constexpr of the W4A16 kernels: index into GATED_ACTIVATIONS.
ACT_SILU = 0
ACT_CLAMPED_SWIGLU = 1


def expert_activation(kind: str, alpha: float, limit: float) -> ExpertActivation:
    """The activation a custom op's flat arguments name (raises MoeKernelError if unknown)."""
    return ExpertActivation(kind, float(alpha), float(limit))


def act_constexprs(act: ExpertActivation) -> dict[str, int | float]:
    """The kernels' ACT/ALPHA/LIMIT constexprs. SiLU ignores alpha and limit, so it passes fixed
    values: one compiled SiLU kernel whatever they hold."""
    if act.kind == "silu":
        return {"ACT": ACT_SILU, "ALPHA": 0.0, "LIMIT": 0.0}
    return {"ACT": ACT_CLAMPED_SWIGLU, "ALPHA": act.alpha, "LIMIT": act.limit}


def _check_bias(name: str, bias: torch.Tensor | None, e: int, n: int, dtype: torch.dtype) -> None:
    if bias is None:
        return
    if bias.dtype != dtype or tuple(bias.shape) != (e, n) or bias.stride(-1) != 1:
        raise _err(
            f"{name} must be {dtype} [{e}, {n}] contiguous in its last dim (the activations' "
            f"dtype), got {bias.dtype} {tuple(bias.shape)}"
        )


@jit
def _rounded(v, DT: tl.constexpr):
    """v (fp32) rounded to DT and back: one torch op's result in DT."""
    return v.to(DT).to(tl.float32)


@jit
def _clamped_swiglu(acc_gate, acc_up, DT: tl.constexpr, ALPHA: tl.constexpr,
                    LIMIT: tl.constexpr):  # fmt: skip
    """The clamped SwiGLU in DT from fp32 accumulators, rounding after each step as
    `expert_activation_ref`'s torch ops do in DT."""
    gate = tl.minimum(_rounded(acc_gate, DT), LIMIT)
    up = tl.minimum(tl.maximum(_rounded(acc_up, DT), -LIMIT), LIMIT)
    gate = _rounded(gate, DT)  # the clamps give a rounded limit
    up = _rounded(up, DT)
    scaled = _rounded(gate * ALPHA, DT)
    sig = _rounded(1.0 / (1.0 + tl.exp(-scaled)), DT)
    glu = _rounded(gate * sig, DT)
    return (glu * _rounded(up + 1.0, DT)).to(DT)


@jit
def _gated(acc_gate, acc_up, DT: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
           LIMIT: tl.constexpr):  # fmt: skip
    """The expert activation (ACT, see ACT_SILU) in DT from the two projections' fp32 sums."""
    if ACT == 1:  # ACT_CLAMPED_SWIGLU
        h = _clamped_swiglu(acc_gate, acc_up, DT, ALPHA, LIMIT)
    else:
        h = _silu_mul(acc_gate, acc_up, DT)
    return h


@jit
def _routed(acc, routing_weight, DT: tl.constexpr):
    """An expert's output in DT times its fp32 routing weight, rounded to DT again: the
    reference's roundings before the top-k sum."""
    return (acc.to(DT).to(tl.float32) * routing_weight).to(DT)
