"""linear and gate_up_silu: dense projections of one token as a Triton GEMV, of a few tokens
(up to SKINNY_MAX_TOKENS, where ROUTE_SKINNY) as a Triton "skinny" GEMM; more go to cuBLAS.

A batch-1 decode step reads every weight once for one token. cuBLAS runs that product as a
tensor-core GEMM padded to 8 tokens, and for a tall K it splits K and launches a separate reduce
kernel; at the Qwen3-8B / 30B-A3B projection shapes on an H200 it reaches 45-85% of the copy
bandwidth. A GEMV that gives each program a few weight rows and streams K is faster at those
shapes (benchmarks/gemv.py). At two or more tokens the tensor cores' reuse of each weight tile
wins, so only one-token products take the kernel.

`gate_up_silu` fuses the MLP's activation: each program reads matching rows of the gate and the
up halves of a merged gate_up weight and writes silu(gate) * up, so the [1, 2I] product is never
stored. The gate and up sums round to the activation dtype first (as the separate matmul's output
does); silu and the product are fp32, rounded once (as Inductor's fused pointwise kernel does).

Split K: a tall K on few rows (the down projection) leaves too few programs to keep the memory
system busy; its programs then store fp32 partial sums, which each row block's last program adds
in a fixed order (kernels/split_join.py: deterministic, and no second kernel). Split programs
load their first weight tile before the programmatic-dependent-launch wait, while the kernel
before still runs (weights never depend on it).

A few tokens (a batch's decode step, a verification of drafts): cuBLAS pads M to its tile and,
at these shapes, splits K with a second reduce kernel, as at one token. The skinny kernel swaps
the operands: each program multiplies a [BLOCK_N, BLOCK_K] weight tile by the tokens' [BLOCK_K,
M_PAD] slice on the tensor cores (the weight rows fill the MMA's M side; M_PAD >= 16 tokens its N
side), so every weight byte is read once for all the tokens, K split and joined as above.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton.language as tl

from ._jit import INTERPRETED, check_device, jit, kernel_op, next_pow2, pdl_args, wait_for_previous
from .activation import silu_and_mul, silu_and_mul_ref
from .split_join import arrival_counts, arrive, sum_partials

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GemvConfig(NamedTuple):
    block_n: int  # weight rows per program
    block_k: int  # columns per load
    unroll: int  # loads in flight per loop iteration
    splits: int  # programs along K (> 1: partial sums, joined by the last)
    num_warps: int


def gemv_config(n: int, k: int, silu_mul: bool = False) -> GemvConfig:
    """Block sizes for an [n, k] weight, from the H200 sweep in benchmarks/gemv.py: about 32 KiB
    of weight per program, more rows per program for very wide outputs, K split when a plain
    grid would give too few programs (tall K, or narrow outputs), and wider steps for outputs
    of a router's size (2.85 against 3.17 µs at 128 x 2048). The fused gate/up kernel already
    has two tiles in flight per step: it does not unroll."""
    if silu_mul:
        return GemvConfig(16, 256, 1, 1, 4)
    if k >= 8192:  # down projections
        return GemvConfig(16, 256, 1, 4, 4)
    if n <= 4096 and k >= 4096:  # o_proj of 30B-A3B (2048 x 4096) and 8B (4096 x 4096)
        # 32 rows split along K, measured in the step: 2.35 against 2.41 ms (30B-A3B; before,
        # 16 rows split 4 ways) and 4.23 against 4.25 ms (8B; before, 4 rows unsplit)
        return GemvConfig(32, 256, 1, 8 if n <= 2048 else 4, 8)
    if n <= 256 and k >= 1024:  # a few dozen programs (MoE routers): more bytes in flight each
        return GemvConfig(4, 512, 2, 1, 4)
    if n >= 16384:  # merged gate_up, lm_head
        return GemvConfig(8, 256, 2, 1, 4)
    return GemvConfig(4, 256 if k >= 1024 else 128, 2, 1, 4)


@jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K] (SILU_MUL: [2N, K], gate rows then up rows)
    bias_ptr,  # [N] (SILU_MUL: [2N])
    out_ptr,  # [N]
    part_ptr,  # SPLITS > 1: fp32 [SPLITS, N] partial sums
    count_ptr,  # SPLITS > 1: int32 arrival count per row block, zero between launches
    N,
    K,
    k_per_split,
    stride_w,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    SPLITS: tl.constexpr,  # programs along K (grid axis 1)
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    acc_up = tl.zeros((BLOCK_N,), tl.float32)
    k_start = 0
    k_stop = K
    if SPLITS > 1:
        k_start = tl.program_id(1) * k_per_split
        k_stop = k_start + k_per_split
        # The first weight tile loads before the wait (weights never depend on the kernel
        # before): on the H200 this took the 8B down projection from 29.5 to 27.3 µs in a chain
        # of launches, where unsplit shapes gained nothing or lost (gate_up 48.6 -> 57.4 µs).
        ks = k_start + tl.arange(0, BLOCK_K)
        w, w_up = _weight_tiles(w_ptr, n, n_mask, ks, N, K, stride_w, SILU_MUL)
        wait_for_previous(PDL)
        acc, acc_up = _accumulate(acc, acc_up, w, w_up, x_ptr, ks, K, SILU_MUL)
        k_start += BLOCK_K
    else:
        wait_for_previous(PDL)
    for k0 in range(k_start, k_stop, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            ks = k0 + u * BLOCK_K + tl.arange(0, BLOCK_K)
            # The weight tiles are issued before x's load: with x first the kernel measured
            # 10-17% slower on the H200.
            w, w_up = _weight_tiles(w_ptr, n, n_mask, ks, N, K, stride_w, SILU_MUL)
            acc, acc_up = _accumulate(acc, acc_up, w, w_up, x_ptr, ks, K, SILU_MUL)
    last = True
    if SPLITS > 1:
        tl.store(part_ptr + tl.program_id(1) * N + n, acc, mask=n_mask)
        last = arrive(count_ptr, pid_n, SPLITS)
        if last:
            acc = sum_partials(part_ptr + n, N, n_mask, SPLITS)
    if last:
        out_ty = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        if SILU_MUL:
            if HAS_BIAS:
                acc_up += tl.load(bias_ptr + N + n, mask=n_mask, other=0.0).to(tl.float32)
            acc = _silu_mul_rounded(acc, acc_up, out_ptr)
        tl.store(out_ptr + n, acc.to(out_ty), mask=n_mask)


@jit
def _silu_mul_rounded(gate_sum, up_sum, out_ptr):
    """silu(gate) * up of fp32 sums, each sum rounded to the output dtype first (as a separate
    matmul's output would be), the activation in fp32."""
    out_ty = out_ptr.dtype.element_ty
    gate = gate_sum.to(out_ty).to(tl.float32)
    up = up_sum.to(out_ty).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@jit
def _weight_tiles(w_ptr, n, n_mask, ks, N, K, stride_w, SILU_MUL: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns ks, and with SILU_MUL the up rows' tile."""
    w_mask = n_mask[:, None] & (ks < K)[None, :]
    w = tl.load(w_ptr + n[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    w_up = w
    if SILU_MUL:
        w_up = tl.load(w_ptr + (n[:, None] + N) * stride_w + ks[None, :], mask=w_mask, other=0.0)
    return w, w_up


@jit
def _accumulate(acc, acc_up, w, w_up, x_ptr, ks, K, SILU_MUL: tl.constexpr):
    """The sums with one K step's tiles added (fp32)."""
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if SILU_MUL:
        acc_up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    return acc, acc_up


# The skinny kernel takes products of 2 to SKINNY_MAX_TOKENS tokens.
SKINNY_MAX_TOKENS = 32
# Whether linear and gate_up_silu route such products to it. Off on CUDA until benchmarks/gemv.py
# --tokens and decode.py --skinny show it ahead of cuBLAS there (not yet run on a GPU); on in the
# interpreter, where the tests check the routing.
ROUTE_SKINNY = INTERPRETED
_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


class SkinnyConfig(NamedTuple):
    block_n: int  # weight rows per program (the MMA's M side)
    block_k: int  # columns per step
    splits: int  # programs along K (> 1: partial sums, joined by the last)
    num_warps: int
    num_stages: int  # weight tiles in flight (software pipeline through shared memory)


def _skinny_m_pad(tokens: int) -> int:
    """The tokens' side of the MMA: a power of two, at least 16 (the smallest tl.dot takes)."""
    return max(16, next_pow2(tokens))


def skinny_config(n: int, k: int, tokens: int, silu_mul: bool = False) -> SkinnyConfig:
    """Block sizes for an [n, k] weight and a few tokens: 64 rows a program, K split until
    there are about two programs a multiprocessor on an H100 (132), each split keeping at least
    four K steps and the fp32 partial sums (written and read back: 8 * M_PAD bytes a weight row
    and split) under 1/16 of the weight's bytes. The fused gate/up kernel does not split (it has
    twice the rows)."""
    block_n, block_k = 64, 128
    blocks = -(-(n // 2 if silu_mul else n) // block_n)
    m_pad = _skinny_m_pad(tokens)
    splits = 1
    if not silu_mul:
        while (
            splits < 8
            and blocks * splits < 264
            and k // (2 * splits * block_k) >= 4
            and 2 * splits * 8 * m_pad <= k // 8  # partials of the doubled split vs 2k / 16
        ):
            splits *= 2
    return SkinnyConfig(block_n, block_k, splits, 4, 3)


@jit
def _skinny_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (SILU_MUL: [2N, K], gate rows then up rows)
    bias_ptr,  # [N] (SILU_MUL: [2N])
    out_ptr,  # [M, N]
    part_ptr,  # SPLITS > 1: fp32 [SPLITS, M_PAD, N] partial sums
    count_ptr,  # SPLITS > 1: int32 arrival count per row block, zero between launches
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_w,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, M_PAD)
    m_mask = m < M
    k_start = 0
    k_stop = K
    if SPLITS > 1:
        k_start = tl.program_id(1) * k_per_split
        k_stop = tl.minimum(k_start + k_per_split, K)
    wait_for_previous(PDL)
    acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)  # [weight rows, tokens]
    acc_up = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_stop
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + n[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        xt = tl.load(
            x_ptr + m[None, :] * stride_xm + ks[:, None],
            mask=k_mask[:, None] & m_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, M_PAD]
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            w_up = tl.load(
                w_ptr + (n[:, None] + N) * stride_w + ks[None, :], mask=w_mask, other=0.0
            )
            acc_up = tl.dot(w_up, xt, acc_up, input_precision=DOT_PRECISION)
    tile_mask = n_mask[:, None] & m_mask[None, :]
    last = True
    if SPLITS > 1:
        part = part_ptr + m[None, :] * N + n[:, None]  # [BLOCK_N, M_PAD]
        tl.store(part + tl.program_id(1) * M_PAD * N, acc, mask=tile_mask)
        last = arrive(count_ptr, pid_n, SPLITS)
        if last:
            acc = sum_partials(part, M_PAD * N, tile_mask, SPLITS)
    if last:
        out_ty = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if SILU_MUL:
            if HAS_BIAS:
                up_bias = tl.load(bias_ptr + N + n, mask=n_mask, other=0.0).to(tl.float32)
                acc_up += up_bias[:, None]
            acc = _silu_mul_rounded(acc, acc_up, out_ptr)
        tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(out_ty), mask=tile_mask)


def skinny_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny kernel takes this product (else cuBLAS): 2 to SKINNY_MAX_TOKENS
    half-precision tokens (fp32 too in the interpreter, whose half-precision dots are inexact)."""
    dtypes = _SKINNY_DTYPES + ((torch.float32,) if INTERPRETED else ())
    return _fits(x, weight, 2, SKINNY_MAX_TOKENS, dtypes)


def _fits(
    x: torch.Tensor,
    weight: torch.Tensor,
    min_tokens: int,
    max_tokens: int,
    dtypes: tuple[torch.dtype, ...],
) -> bool:
    """2-D operands of one dtype among `dtypes`, unit-stride rows, min to max tokens."""
    return (
        x.dim() == 2
        and min_tokens <= x.shape[0] <= max_tokens
        and x.dtype == weight.dtype
        and x.dtype in dtypes
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.stride(1) == 1
    )


def skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool,
    cfg: SkinnyConfig | None = None,
) -> torch.Tensor:
    """The skinny kernel's launch behind both ops, for a few tokens (`cfg` overrides the
    block sizes)."""
    tokens, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    cfg = cfg or skinny_config(weight.shape[0], k, tokens, silu_mul)
    splits = cfg.splits if not silu_mul else 1
    m_pad = _skinny_m_pad(tokens)
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    k_per_split = -(-k // (splits * cfg.block_k)) * cfg.block_k
    blocks = -(-n // cfg.block_n)
    part, counts = out, out  # unread with one split
    if splits > 1:
        part = torch.empty((splits, m_pad, n), dtype=torch.float32, device=x.device)
        counts = arrival_counts(x.device, blocks)
    has_bias = bias is not None
    _skinny_kernel[(blocks, splits)](
        x, weight, bias if has_bias else weight, out, part, counts, tokens, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=has_bias, SILU_MUL=silu_mul, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        M_PAD=m_pad, SPLITS=splits, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )  # fmt: skip
    return out


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMV kernel takes this product (else F.linear)."""
    return _fits(x, weight, 1, 1, _DTYPES)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool,
    cfg: GemvConfig | None = None,
) -> torch.Tensor:
    """The kernel launch behind both ops, for one token (`cfg` overrides the block sizes)."""
    k = x.shape[-1]
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    cfg = cfg or gemv_config(weight.shape[0], k, silu_mul)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    splits = cfg.splits if not silu_mul else 1
    if splits > 1 and cfg.unroll > 1:  # a split's unrolled steps would run into the next split
        raise ValueError(f"GEMV config {cfg}: split K takes unroll 1")
    k_per_split = -(-k // (splits * cfg.block_k)) * cfg.block_k
    blocks = -(-n // cfg.block_n)
    part, counts = out, out  # unread with one split
    if splits > 1:
        part = torch.empty((splits, n), dtype=torch.float32, device=x.device)
        counts = arrival_counts(x.device, blocks)
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight  # any pointer: unread without HAS_BIAS
    # NOTE: one stage: a software-pipelined loop stages each weight tile through shared memory,
    # which a GEMV (no reuse) only pays for (15-20% slower on the H200).
    _gemv_kernel[(blocks, splits)](
        x, weight, bias_arg, out, part, counts, n, k, k_per_split, weight.stride(0),
        HAS_BIAS=has_bias, SILU_MUL=silu_mul, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        UNROLL=cfg.unroll, SPLITS=splits, num_warps=cfg.num_warps, num_stages=1,
        **pdl_args(x.device),
    )  # fmt: skip
    return out


@kernel_op("libkk::linear", mutates_args=())
def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """x W^T (+ b): the GEMV kernel for one token, the skinny kernel for a few, F.linear
    otherwise."""
    check_device(x)
    if gemv_fits(x, weight):
        return gemv(x, weight, bias, silu_mul=False)
    if ROUTE_SKINNY and skinny_fits(x, weight):
        return skinny(x, weight, bias, silu_mul=False)
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@kernel_op("libkk::gate_up_silu", mutates_args=())
def gate_up_silu(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [2 * intermediate, in]: gate rows, then up rows
    bias: torch.Tensor | None = None,  # [2 * intermediate]
) -> torch.Tensor:  # [..., intermediate]
    """silu(x W_gate^T) * (x W_up^T): one GEMV or skinny kernel for one or a few tokens; more
    take cuBLAS and the one-pass activation kernel."""
    check_device(x)
    if gemv_fits(x, weight):
        return gemv(x, weight, bias, silu_mul=True)
    if ROUTE_SKINNY and skinny_fits(x, weight):
        return skinny(x, weight, bias, silu_mul=True)
    return silu_and_mul(F.linear(x, weight, bias))


@gate_up_silu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def gate_up_silu_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return silu_and_mul_ref(F.linear(x, weight, bias))
