"""The pair-major decode path of the W4A16 experts (tile config block_m = PAIR_MAJOR)."""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import check_device, jit, pdl_args, wait_for_previous
from ..split_join import arrival_counts, arrive, sum_partials
from .common import (
    GROUP,
    SILU,
    ExpertActivation,
    MoeTileConfig,
    _check_bias,
    _check_rows,
    _check_w4,
    _err,
    _gated,
    _global_scale,
    _routed,
    act_constexprs,
)
from .dequant import _e2m1_as_e4m3, _e2m1_pairs_as_f16, _ptx_decode, _scale_value

# --------------------------------------------------------------------------------------------------
# Pair-major decode path (tile config block_m = 1)
#
# With a few tokens, each (token, expert) pair is its own matrix-vector product: both grids run
# over (pair, N tile), reading the pair's expert id straight from topk_ids. No alignment, no
# tensor cores: each weight costs a multiply-add instead of a tensor-core operand round trip
# through shared memory. (The top-k sum is left to the consumer, `add_rms_norm` in a model: a
# down kernel summing a token's experts itself would give each program top_k times the serial
# weight stream, one token's layer then running on H / BLOCK_N programs.) Pairs that share an
# expert read its weights once each, so the sorted path wins once tokens share experts often;
# the tile tuner measures both. The weight tile is [BN, BK/2] bytes with K contiguous (rows of
# the checkpoint's layout), each scale group's partial sum is taken in fp32 and multiplied by its
# scale once. gate_up's grid has a third axis, its K split (`split_k`, joined as
# kernels/split_join.py describes). The two kernels take separate tiles (the config's down_*
# fields): gate_up's rows are as long as the hidden size, down's as the intermediate size.


@jit
def _w4_row_dots(packed, sbyte, xe, xo, gscale, IS_NVFP4: tl.constexpr, GROUP: tl.constexpr,
                 USE_PTX: tl.constexpr):  # fmt: skip
    """[BN] fp32: each row of a [BN, BK/2] packed weight tile (scale bytes [BN, BK/G]) dotted with
    the step's even and odd activations xe, xo [BK/2] (fp32)."""
    if USE_PTX:
        lo, hi = _e2m1_pairs_as_f16(packed)
    else:
        lo = _e2m1_as_e4m3(packed)
        hi = _e2m1_as_e4m3(packed >> 4)
    prod = lo.to(tl.float32) * xe[None, :] + hi.to(tl.float32) * xo[None, :]  # values * 2^-6
    BN: tl.constexpr = prod.shape[0]
    NG: tl.constexpr = sbyte.shape[1]
    per_group = tl.sum(tl.reshape(prod, [BN, NG, GROUP // 2]), axis=2) * 64.0  # [BN, BK/G]
    if IS_NVFP4:
        step = sbyte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * gscale
    else:
        step = _scale_value(sbyte.to(tl.int32), IS_NVFP4)
    return tl.sum(per_group * step, axis=1)


@jit
def _w4_step_ptrs(w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """One K step of a pair-major product: pointers to the packed bytes [BN, BK/2] and the scale
    bytes [BN, BK/G], and their masks."""
    j = tl.arange(0, BLOCK_K // 2)
    g = tl.arange(0, BLOCK_K // GROUP)
    w_ptrs = w_base + n[:, None] * stride_wn + (k0 // 2 + j)[None, :]
    s_ptrs = s_base + n[:, None] * stride_sn + (k0 // GROUP + g)[None, :]
    if EVEN_K:
        wmask = nmask[:, None]
        smask = nmask[:, None]
    else:
        wmask = nmask[:, None] & ((k0 + 2 * j) < K)[None, :]
        smask = nmask[:, None] & ((k0 + g * GROUP) < K)[None, :]
    return w_ptrs, s_ptrs, wmask, smask


@jit
def _x_step(x_row, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of the activations: even and odd elements [BK/2], fp32."""
    kk = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, [BLOCK_K // 2, 2]))


@jit
def _pair_tile(ids_ptr, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (token, expert) pair (grid axis 0), its expert, and its N rows (axis 1)
    with their mask."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, expert, n, n < N


@jit
def _gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    b_ptr,  # HAS_BIAS: [E, 2N] gate then up biases, x's dtype
    ids_ptr,  # [num_pairs] expert of each (token, k) pair: topk_ids flattened
    out_ptr,
    part_ptr,  # SPLIT_K > 1: fp32 [num_pairs, SPLIT_K, 2, N] partial gate and up sums
    count_ptr,  # SPLIT_K > 1: int32 [num_pairs * N tiles] arrivals, zero between launches
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_ot,
    N: tl.constexpr,  # intermediate size I (w13 has 2N rows: gate then up)
    K: tl.constexpr,  # hidden size
    TOP_K: tl.constexpr,
    GROUP: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # every step of every split is whole
    SPLIT_K: tl.constexpr,  # programs along K (grid axis 2)
    USE_PTX: tl.constexpr,
    PDL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # common.ACT_SILU | ACT_CLAMPED_SWIGLU
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    wait_for_previous(PDL)
    pair, expert, n, nmask = _pair_tile(ids_ptr, N, BLOCK_N)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    # this program's K range: whole steps, the last split's possibly past K (masked)
    K_PER_SPLIT: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
    k_first = 0
    if SPLIT_K > 1:
        k_first = tl.program_id(2) * K_PER_SPLIT
    x_row = x_ptr + (pair // TOP_K) * stride_xt
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    g_gate = _global_scale(g_ptr, expert * 2, IS_NVFP4)
    g_up = _global_scale(g_ptr, expert * 2 + 1, IS_NVFP4)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_first + kk
        w_ptrs, s_ptrs, wmask, smask = _w4_step_ptrs(
            w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K, GROUP, BLOCK_K, EVEN_K
        )
        # The weight streams' loads are issued before the activations' (as in kernels/gemv.py,
        # where x first measured 10-17% slower on the H200).
        gate_w = tl.load(w_ptrs, mask=wmask, other=0)
        up_w = tl.load(w_ptrs + N * stride_wn, mask=wmask, other=0)
        gate_s = tl.load(s_ptrs, mask=smask, other=0)
        up_s = tl.load(s_ptrs + N * stride_sn, mask=smask, other=0)
        xe, xo = _x_step(x_row, k0, K, BLOCK_K)
        acc_g += _w4_row_dots(gate_w, gate_s, xe, xo, g_gate, IS_NVFP4, GROUP, USE_PTX)
        acc_u += _w4_row_dots(up_w, up_s, xe, xo, g_up, IS_NVFP4, GROUP, USE_PTX)
    if SPLIT_K > 1:
        tile = pair * tl.num_programs(1) + tl.program_id(1)
        rows = part_ptr + pair * (SPLIT_K * 2 * N) + n
        tl.store(rows + tl.program_id(2) * (2 * N), acc_g, mask=nmask)
        tl.store(rows + tl.program_id(2) * (2 * N) + N, acc_u, mask=nmask)
        if arrive(count_ptr, tile, SPLIT_K):
            acc_g = sum_partials(rows, 2 * N, nmask, SPLIT_K)
            acc_u = sum_partials(rows + N, 2 * N, nmask, SPLIT_K)
            h = _pair_act(acc_g, acc_u, b_ptr, expert, stride_be, n, nmask, N, DT, HAS_BIAS, ACT,
                          ALPHA, LIMIT)  # fmt: skip
            tl.store(out_ptr + pair * stride_ot + n, h, mask=nmask)
    else:
        h = _pair_act(acc_g, acc_u, b_ptr, expert, stride_be, n, nmask, N, DT, HAS_BIAS, ACT,
                      ALPHA, LIMIT)  # fmt: skip
        tl.store(out_ptr + pair * stride_ot + n, h, mask=nmask)


@jit
def _pair_act(acc_g, acc_u, b_ptr, expert, stride_be, n, nmask, N: tl.constexpr,
              DT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
              LIMIT: tl.constexpr):  # fmt: skip
    """A pair's gate_up output [BN] from its whole fp32 sums: the biases added to the sums (one
    rounding with them, as F.linear's epilogue), then the activation."""
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be + n
        acc_g += tl.load(b_row, mask=nmask, other=0.0).to(tl.float32)
        acc_u += tl.load(b_row + N, mask=nmask, other=0.0).to(tl.float32)
    return _gated(acc_g, acc_u, DT, ACT, ALPHA, LIMIT)


@jit
def _down_gemv_kernel(
    a_ptr,  # [num_pairs, K] from the gate_up kernel
    w_ptr,
    s_ptr,
    g_ptr,
    b_ptr,  # HAS_BIAS: [E, N] down biases, a's dtype
    ids_ptr,
    rw_ptr,  # [num_pairs] fp32 routing weights
    out_ptr,  # [num_pairs, N]: each pair's output times its routing weight
    stride_at,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_ot,
    N: tl.constexpr,  # hidden size
    K: tl.constexpr,  # intermediate size
    GROUP: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
    PDL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    wait_for_previous(PDL)
    pair, expert, n, nmask = _pair_tile(ids_ptr, N, BLOCK_N)
    DT: tl.constexpr = a_ptr.dtype.element_ty
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    gscale = _global_scale(g_ptr, expert, IS_NVFP4)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_ptrs, s_ptrs, wmask, smask = _w4_step_ptrs(
            w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K, GROUP, BLOCK_K, EVEN_K
        )
        packed = tl.load(w_ptrs, mask=wmask, other=0)  # weights before activations, as above
        sbyte = tl.load(s_ptrs, mask=smask, other=0)
        ae, ao = _x_step(a_ptr + pair * stride_at, k0, K, BLOCK_K)
        acc += _w4_row_dots(packed, sbyte, ae, ao, gscale, IS_NVFP4, GROUP, USE_PTX)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair * stride_ot + n, _routed(acc, tl.load(rw_ptr + pair), DT), mask=nmask)


def _fused_moe_w4a16_pairs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fmt: str,
    cfg: MoeTileConfig,
    w13_bias: torch.Tensor | None = None,  # [E, 2I] x's dtype
    w2_bias: torch.Tensor | None = None,  # [E, H] x's dtype
    act: ExpertActivation = SILU,
) -> torch.Tensor:
    """Each (token, expert) pair's routed output [num_tokens, top_k, H] on the pair-major path
    (cfg.block_m == 1)."""
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[-1]
    inter = w13.shape[1] // 2
    _check_rows(x, "x", hidden)
    _check_w4("w13", w13, w13_scale, w13_global, fmt, hidden, 2 * inter, 2)
    _check_w4("w2", w2, w2_scale, w2_global, fmt, inter, hidden, 1)
    _check_bias("w13_bias", w13_bias, w13.shape[0], 2 * inter, x.dtype)
    _check_bias("w2_bias", w2_bias, w2.shape[0], hidden, x.dtype)
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise _err(
            f"topk_weights must be fp32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
            f"{tuple(topk_weights.shape)}"
        )
    check_device(x)
    if num_tokens == 0:
        return torch.empty(0, top_k, hidden, dtype=x.dtype, device=x.device)
    ids = topk_ids.contiguous().view(-1)
    a = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    common = dict(GROUP=GROUP[fmt], IS_NVFP4=fmt == "nvfp4", num_stages=cfg.num_stages,
                  **pdl_args(x.device))  # fmt: skip
    pairs, tiles, splits = num_tokens * top_k, -(-inter // cfg.block_n), cfg.split_k
    part, counts = a, ids  # unread with one split
    if splits > 1:
        part = torch.empty(pairs, splits, 2, inter, dtype=torch.float32, device=x.device)
        counts = arrival_counts(x.device, pairs * tiles)
    # Without biases the global scales stand in for them (unread).
    b13 = w13_global if w13_bias is None else w13_bias
    b2 = w2_global if w2_bias is None else w2_bias
    _gate_up_gemv_kernel[(pairs, tiles, splits)](
        x, w13, w13_scale, w13_global, b13, ids, a, part, counts,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        b13.stride(0), a.stride(0), N=inter, K=hidden, TOP_K=top_k,
        HAS_BIAS=w13_bias is not None, **act_constexprs(act),
        EVEN_K=hidden % (splits * cfg.block_k) == 0, SPLIT_K=splits, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        USE_PTX=_ptx_decode(cfg.block_n, cfg.block_k, cfg.num_warps), **common,
    )  # fmt: skip
    down_n, down_k, down_warps = cfg.down_tile()
    _down_gemv_kernel[(pairs, -(-hidden // down_n))](
        a, w2, w2_scale, w2_global, b2, ids, topk_weights.contiguous().view(-1), y,
        a.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        b2.stride(0), y.stride(0), HAS_BIAS=w2_bias is not None, N=hidden, K=inter,
        EVEN_K=inter % down_k == 0, BLOCK_N=down_n, BLOCK_K=down_k, num_warps=down_warps,
        USE_PTX=_ptx_decode(down_n, down_k, down_warps), **common,
    )  # fmt: skip
    return y.view(num_tokens, top_k, -1)
