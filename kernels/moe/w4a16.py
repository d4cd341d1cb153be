"""The sorted W4A16 expert GEMMs (bf16/fp16/fp32 activations against 4-bit weights), the fused
layer op and their torch references."""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import check_device, jit, kernel_op
from .common import (
    GROUP,
    PAIR_MAJOR,
    SILU,
    ExpertActivation,
    MoeTileConfig,
    _check_bias,
    _check_rows,
    _check_w4,
    _err,
    _gated,
    _global_scale,
    _precision,
    _routed,
    act_constexprs,
    default_tile_config,
    expert_activation,
    expert_activation_ref,
)
from .dequant import _ptx_decode, _w4_tile
from .pairs import _fused_moe_w4a16_pairs
from .routing import _check_tiles, _tile_pairs, moe_align_block_size
from .tiles import MoeShape, has_tile_choices, tile_choice

# --------------------------------------------------------------------------------------------------
# Fused expert GEMMs


@jit
def _w4_step(w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K: tl.constexpr,
             GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """One K step of a W4 tile: its K indices kx [BK] and their mask, pointers to its packed
    bytes [BK/2, BN], pointers to its scale bytes [BK/G, BN], and the masks of both tiles.

    Byte offsets as k0/2 + j (not kx/2) let the compiler see each thread's bytes contiguous, and
    with EVEN_K (BLOCK_K divides K) the weight mask varies along N only: the packed bytes then
    load as wide vectors along K."""
    j = tl.arange(0, BLOCK_K // 2)
    g = tl.arange(0, BLOCK_K // GROUP)
    kx = k0 + tl.arange(0, BLOCK_K)
    w_ptrs = w_base + n[None, :] * stride_wn + (k0 // 2 + j)[:, None]
    s_ptrs = s_base + n[None, :] * stride_sn + (k0 // GROUP + g)[:, None]
    if EVEN_K:
        wmask = nmask[None, :]
        smask = nmask[None, :]
    else:
        wmask = ((k0 + 2 * j) < K)[:, None] & nmask[None, :]
        smask = ((k0 + g * GROUP) < K)[:, None] & nmask[None, :]
    return kx, kx < K, w_ptrs, s_ptrs, wmask, smask


@jit
def _interleave_k(even, odd):
    """[BK/2, BN] even and odd K rows -> the [BK, BN] tile, rows in K order.

    One dot over the whole step then reads the activations as they lie: splitting them into
    even and odd columns instead (two dots) made every activation load a stride-2 gather that
    the pipeliner cannot stage, which held the sorted path at 5% of the matmul rate."""
    BK2: tl.constexpr = even.shape[0]
    BN: tl.constexpr = even.shape[1]
    return tl.reshape(tl.permute(tl.join(even, odd), (0, 2, 1)), [2 * BK2, BN])


@jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    b_ptr,  # HAS_BIAS: [E, 2N] gate then up biases, x's dtype
    out_ptr,
    sorted_ptr,
    expert_ptr,
    npad_ptr,
    num_pairs,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask, so weight loads vectorize along K
    USE_PTX: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # common.ACT_SILU | ACT_CLAMPED_SWIGLU
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(npad_ptr):
        return
    expert, pair, valid, n, nmask = _tile_pairs(
        sorted_ptr, expert_ptr, num_pairs, N, BLOCK_M, BLOCK_N
    )
    DT: tl.constexpr = x_ptr.dtype.element_ty
    token = (pair // TOP_K).to(tl.int64)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    g_gate = _global_scale(g_ptr, expert * 2, IS_NVFP4)
    g_up = _global_scale(g_ptr, expert * 2 + 1, IS_NVFP4)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kx, kmask, wg_ptrs, sg_ptrs, wmask, smask = _w4_step(
            w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K, GROUP, BLOCK_K, EVEN_K
        )
        ge, go = _w4_tile(wg_ptrs, sg_ptrs, g_gate, wmask, smask, DT, IS_NVFP4, GROUP, USE_PTX)
        ue, uo = _w4_tile(wg_ptrs + N * stride_wn, sg_ptrs + N * stride_sn, g_up, wmask, smask,
                          DT, IS_NVFP4, GROUP, USE_PTX)  # fmt: skip
        x = tl.load(x_ptr + token[:, None] * stride_xt + kx[None, :],
                    mask=valid[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        acc_g = tl.dot(x, _interleave_k(ge, go), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, _interleave_k(ue, uo), acc_u, input_precision=PRECISION)
    if HAS_BIAS:  # added to the fp32 sums, rounded once with them (as F.linear's epilogue)
        b_row = b_ptr + expert * stride_be + n
        acc_g += tl.load(b_row, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + N, mask=nmask, other=0.0).to(tl.float32)[None, :]
    h = _gated(acc_g, acc_u, DT, ACT, ALPHA, LIMIT)
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + n[None, :]
    tl.store(out_ptrs, h, mask=valid[:, None] & nmask[None, :])


@jit
def _down_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    b_ptr,  # HAS_BIAS: [E, N] down biases, a's dtype
    rw_ptr,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    npad_ptr,
    num_pairs,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask, so weight loads vectorize along K
    USE_PTX: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(npad_ptr):
        return
    expert, pair, valid, n, nmask = _tile_pairs(
        sorted_ptr, expert_ptr, num_pairs, N, BLOCK_M, BLOCK_N
    )
    DT: tl.constexpr = a_ptr.dtype.element_ty
    pair64 = pair.to(tl.int64)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    gscale = _global_scale(g_ptr, expert, IS_NVFP4)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kx, kmask, w_ptrs, s_ptrs, wmask, smask = _w4_step(
            w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K, GROUP, BLOCK_K, EVEN_K
        )
        we, wo = _w4_tile(w_ptrs, s_ptrs, gscale, wmask, smask, DT, IS_NVFP4, GROUP, USE_PTX)
        a = tl.load(a_ptr + pair64[:, None] * stride_at + kx[None, :],
                    mask=valid[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, _interleave_k(we, wo), acc, input_precision=PRECISION)
    if HAS_BIAS:  # added to the fp32 sums, rounded once with them (as F.linear's epilogue)
        bias = tl.load(b_ptr + expert * stride_be + n, mask=nmask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    rw = tl.load(rw_ptr + pair64, mask=valid, other=0.0)  # fp32 routing weight of each pair
    y = _routed(acc, rw[:, None], DT)
    out_ptrs = out_ptr + pair64[:, None] * stride_ot + n[None, :]
    tl.store(out_ptrs, y, mask=valid[:, None] & nmask[None, :])


@kernel_op("libkk::moe_w4a16_gate_up", mutates_args=("out",))
def moe_w4a16_gate_up(
    x: torch.Tensor,  # [num_tokens, K]
    w13: torch.Tensor,  # [E, 2I, K/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, K/G] uint8
    w13_global: torch.Tensor,  # [E, 2] fp32 (gate, up); ignored for MXFP4
    sorted_ids: torch.Tensor,  # [P] int32 from moe_align_block_size
    expert_ids: torch.Tensor,  # [P / block_m] int32
    num_post_pad: torch.Tensor,  # [1] int32
    out: torch.Tensor,  # [num_tokens * top_k, I], x's dtype; every pair row is written
    top_k: int,
    fmt: str,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    w13_bias: torch.Tensor | None = None,  # [E, 2I] x's dtype (gate then up)
    act_kind: str = "silu",  # an ExpertActivation's fields
    alpha: float = 1.702,
    limit: float = 7.0,
) -> None:
    """out[pair] = act(x[token] @ gate^T + b_gate, x[token] @ up^T + b_up) with the pair's
    expert's weights and biases; act: SiLU(gate) * up, or the clamped SwiGLU (`act_kind`)."""
    k = x.shape[-1]
    inter = w13.shape[1] // 2
    act = expert_activation(act_kind, alpha, limit)
    _check_rows(x, "x", k)
    _check_w4("w13", w13, w13_scale, w13_global, fmt, k, 2 * inter, 2)
    _check_bias("w13_bias", w13_bias, w13.shape[0], 2 * inter, x.dtype)
    _check_rows(out, "out", inter)
    if out.dtype != x.dtype or out.shape[0] != x.shape[0] * top_k:
        raise _err(f"out must be {x.dtype} [{x.shape[0] * top_k}, {inter}], got {out.shape}")
    _check_tiles(sorted_ids, expert_ids, block_m, block_k)
    check_device(x)
    if out.shape[0] == 0:
        return
    grid = (expert_ids.shape[0], -(-inter // block_n))
    _gate_up_kernel[grid](
        x,
        w13,
        w13_scale,
        w13_global,
        w13_global if w13_bias is None else w13_bias,  # unread without biases
        out,
        sorted_ids,
        expert_ids,
        num_post_pad,
        out.shape[0],
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        0 if w13_bias is None else w13_bias.stride(0),
        out.stride(0),
        N=inter,
        K=k,
        TOP_K=top_k,
        GROUP=GROUP[fmt],
        IS_NVFP4=fmt == "nvfp4",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        USE_PTX=_ptx_decode(block_n, block_k, num_warps),
        PRECISION=_precision(x.dtype),
        HAS_BIAS=w13_bias is not None,
        **act_constexprs(act),
        num_warps=num_warps,
        num_stages=num_stages,
    )


@moe_w4a16_gate_up.register_fake
def _(x, w13, w13_scale, w13_global, sorted_ids, expert_ids, num_post_pad, out, *args,
      **kwargs) -> None:  # fmt: skip
    return None


@kernel_op("libkk::moe_w4a16_down", mutates_args=("out",))
def moe_w4a16_down(
    a: torch.Tensor,  # [num_pairs, I] from moe_w4a16_gate_up
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/G] uint8
    w2_global: torch.Tensor,  # [E, 1] fp32; ignored for MXFP4
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    sorted_ids: torch.Tensor,  # [P] int32
    expert_ids: torch.Tensor,  # [P / block_m] int32
    num_post_pad: torch.Tensor,  # [1] int32
    out: torch.Tensor,  # [num_pairs, H], a's dtype; every pair row is written
    fmt: str,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    w2_bias: torch.Tensor | None = None,  # [E, H] a's dtype
) -> None:
    """out[pair] = (a[pair] @ w2[expert]^T + w2_bias[expert]) * topk_weights.flat[pair]."""
    k = a.shape[-1]
    hidden = w2.shape[1]
    _check_rows(a, "a", k)
    _check_w4("w2", w2, w2_scale, w2_global, fmt, k, hidden, 1)
    _check_bias("w2_bias", w2_bias, w2.shape[0], hidden, a.dtype)
    _check_rows(out, "out", hidden)
    if out.dtype != a.dtype or out.shape[0] != a.shape[0]:
        raise _err(f"out must be {a.dtype} [{a.shape[0]}, {hidden}], got {out.shape}")
    if topk_weights.dtype != torch.float32 or topk_weights.numel() != a.shape[0]:
        raise _err(
            f"topk_weights must be fp32 with {a.shape[0]} elements, got {topk_weights.dtype} "
            f"{tuple(topk_weights.shape)}"
        )
    _check_tiles(sorted_ids, expert_ids, block_m, block_k)
    check_device(a)
    if out.shape[0] == 0:
        return
    grid = (expert_ids.shape[0], -(-hidden // block_n))
    _down_kernel[grid](
        a,
        w2,
        w2_scale,
        w2_global,
        w2_global if w2_bias is None else w2_bias,  # unread without biases
        topk_weights.contiguous(),
        out,
        sorted_ids,
        expert_ids,
        num_post_pad,
        a.shape[0],
        a.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        0 if w2_bias is None else w2_bias.stride(0),
        out.stride(0),
        N=hidden,
        K=k,
        GROUP=GROUP[fmt],
        IS_NVFP4=fmt == "nvfp4",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        USE_PTX=_ptx_decode(block_n, block_k, num_warps),
        PRECISION=_precision(a.dtype),
        HAS_BIAS=w2_bias is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@moe_w4a16_down.register_fake
def _(a, w2, w2_scale, w2_global, topk_weights, sorted_ids, expert_ids, num_post_pad, out, *args,
      **kwargs):  # fmt: skip
    return None


def fused_moe_w4a16(
    x: torch.Tensor,  # [num_tokens, H]
    w13: torch.Tensor,  # [E, 2I, H/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, H/G] uint8
    w13_global: torch.Tensor,  # [E, 2] fp32
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/G] uint8
    w2_global: torch.Tensor,  # [E, 1] fp32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64
    fmt: str,
    config: MoeTileConfig | None = None,
    *,
    w13_bias: torch.Tensor | None = None,  # [E, 2I] x's dtype (gate then up)
    w2_bias: torch.Tensor | None = None,  # [E, H] x's dtype
    activation: ExpertActivation = SILU,
) -> torch.Tensor:  # [num_tokens, H]
    """The whole expert computation of one layer on 4-bit weights; no host synchronisation:
    `fused_moe_w4a16_routed`, then the top-k sum (torch's, accumulating in fp32). Biases are
    added after each projection (before the activation and before the routing weight)."""
    return fused_moe_w4a16_routed(
        x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt,
        config, w13_bias=w13_bias, w2_bias=w2_bias, activation=activation,
    ).sum(dim=1)  # fmt: skip


def fused_moe_w4a16_routed(
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
    config: MoeTileConfig | None = None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
) -> torch.Tensor:  # [num_tokens, top_k, H]
    """`fused_moe_w4a16` before its top-k sum: each (token, expert) pair's output times its
    routing weight, left for a consumer that sums them itself (`add_rms_norm` takes the terms)."""
    args = (x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt)
    if config is None:
        if torch.compiler.is_compiling():
            # The tiles depend on the token count: picked at run time inside an opaque op, so
            # the trace neither branches on the count nor is specialised per token bucket.
            return fused_moe_w4a16_measured(
                *args, w13_bias, w2_bias, activation.kind, activation.alpha, activation.limit
            )
        top_k = topk_ids.shape[1]
        shape = MoeShape(fmt, "w4a16", w13.shape[0], x.shape[-1], w13.shape[1] // 2, top_k)
        if has_tile_choices(shape):
            config = tile_choice(shape, topk_ids.shape[0])
    cfg = config or default_tile_config(topk_ids.shape[0])
    return _routed_pair_outputs(*args, cfg, w13_bias, w2_bias, activation)


def _routed_pair_outputs(
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
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    act: ExpertActivation,
) -> torch.Tensor:  # [num_tokens, top_k, H]
    """Each (token, expert) pair's output times its routing weight, on the path `cfg` selects.

    The options (biases, activation) reach the ops as keywords, and only where set: a SiLU layer
    without biases calls them with their plain arguments."""
    if cfg.block_m == PAIR_MAJOR:
        opts: dict = {}
        if w13_bias is not None or w2_bias is not None or act != SILU:
            opts = dict(w13_bias=w13_bias, w2_bias=w2_bias, act=act)
        return _fused_moe_w4a16_pairs(
            x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt,
            cfg, **opts,
        )  # fmt: skip
    gate_up_opts: dict = {}
    if w13_bias is not None or act != SILU:
        gate_up_opts = dict(w13_bias=w13_bias, act_kind=act.kind, alpha=act.alpha, limit=act.limit)
    down_opts = {} if w2_bias is None else {"w2_bias": w2_bias}
    num_tokens, top_k = topk_ids.shape
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    sorted_ids, expert_ids, npad = moe_align_block_size(topk_ids, w13.shape[0], cfg.block_m)
    inter = torch.empty(num_tokens * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    moe_w4a16_gate_up(
        x, w13, w13_scale, w13_global, sorted_ids, expert_ids, npad, inter, top_k, fmt, *tiles,
        **gate_up_opts,
    )  # fmt: skip
    y = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    moe_w4a16_down(
        inter, w2, w2_scale, w2_global, topk_weights, sorted_ids, expert_ids, npad, y, fmt, *tiles,
        **down_opts,
    )  # fmt: skip
    return y.view(num_tokens, top_k, -1)


@kernel_op("libkk::fused_moe_w4a16_measured", mutates_args=())
def fused_moe_w4a16_measured(
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
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act_kind: str = "silu",  # an ExpertActivation's fields
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:  # [num_tokens, top_k, H]
    """`fused_moe_w4a16_routed` with the installed tile choice for this call's token count, as
    one op that torch.compile does not look into."""
    num_tokens, top_k = topk_ids.shape
    shape = MoeShape(fmt, "w4a16", w13.shape[0], x.shape[-1], w13.shape[1] // 2, top_k)
    cfg = tile_choice(shape, num_tokens) or default_tile_config(num_tokens)
    return _routed_pair_outputs(
        x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt, cfg,
        w13_bias, w2_bias, expert_activation(act_kind, alpha, limit),
    )  # fmt: skip


@fused_moe_w4a16_measured.register_fake
def _(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt,
      *args, **kwargs):  # fmt: skip
    return x.new_empty(x.shape[0], topk_ids.shape[1], w2.shape[1])


# --------------------------------------------------------------------------------------------------
# Torch references

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_w4_ref(
    weight: torch.Tensor,  # [E, N, K/2] uint8
    scale: torch.Tensor,  # [E, N, K/G] uint8
    global_scale: torch.Tensor,  # [E, parts] fp32; row block p of N/parts rows uses column p
    fmt: str,
    dtype: torch.dtype,
) -> torch.Tensor:  # [E, N, K]
    """Stacked 4-bit weights -> dtype, with the same fp32 steps as libkk.quant.formats."""
    e, n, half = weight.shape
    g = GROUP[fmt]
    table = torch.tensor(_E2M1, dtype=torch.float32, device=weight.device)
    codes = torch.stack((weight & 15, weight >> 4), dim=-1).reshape(e, n, 2 * half)
    values = table[codes.long()].reshape(e, n, 2 * half // g, g)
    if fmt == "nvfp4":
        parts = global_scale.shape[1]
        glob = global_scale.repeat_interleave(n // parts, dim=1)  # [E, N]
        step = scale.view(torch.float8_e4m3fn).float() * glob[..., None]
    else:
        exps = scale.to(torch.int32) - 127
        step = torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps)
        step = torch.where(scale == 255, torch.full_like(step, float("nan")), step)
    return (values * step[..., None]).reshape(e, n, 2 * half).to(dtype)


def _expert_of_pairs(
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_pairs: int, block_m: int
) -> torch.Tensor:  # [num_pairs] int64 (-1 for a pair not listed)
    sid = sorted_ids.long().cpu()
    slot_expert = expert_ids.long().cpu().repeat_interleave(block_m)
    keep = sid < num_pairs
    expert = torch.full((num_pairs,), -1, dtype=torch.int64)
    expert[sid[keep]] = slot_expert[keep]
    return expert


def moe_w4a16_gate_up_ref(
    x, w13, w13_scale, w13_global, sorted_ids, expert_ids, num_post_pad, out,
    top_k, fmt, block_m, block_n=0, block_k=0, num_warps=0, num_stages=0,
    w13_bias=None, act_kind="silu", alpha=1.702, limit=7.0,
) -> None:  # fmt: skip
    """Torch reference of `moe_w4a16_gate_up` on the dequantized weights."""
    num_pairs = out.shape[0]
    inter = w13.shape[1] // 2
    act = expert_activation(act_kind, alpha, limit)
    expert = _expert_of_pairs(sorted_ids, expert_ids, num_pairs, block_m)
    for e in expert.unique().tolist():
        if e < 0:
            continue
        pairs = torch.nonzero(expert == e).flatten().to(x.device)
        w = dequantize_w4_ref(w13[e : e + 1], w13_scale[e : e + 1], w13_global[e : e + 1], fmt,
                              x.dtype)[0]  # fmt: skip
        b = None if w13_bias is None else w13_bias[e]
        h = torch.nn.functional.linear(x[pairs // top_k], w, b)  # [count, 2I]
        out[pairs] = expert_activation_ref(h[:, :inter], h[:, inter:], act)


def moe_w4a16_down_ref(
    a, w2, w2_scale, w2_global, topk_weights, sorted_ids, expert_ids, num_post_pad, out,
    fmt, block_m, block_n=0, block_k=0, num_warps=0, num_stages=0, w2_bias=None,
) -> None:  # fmt: skip
    """Torch reference of `moe_w4a16_down` on the dequantized weights."""
    num_pairs = out.shape[0]
    expert = _expert_of_pairs(sorted_ids, expert_ids, num_pairs, block_m)
    rw = topk_weights.reshape(-1)
    for e in expert.unique().tolist():
        if e < 0:
            continue
        pairs = torch.nonzero(expert == e).flatten().to(a.device)
        w = dequantize_w4_ref(w2[e : e + 1], w2_scale[e : e + 1], w2_global[e : e + 1], fmt,
                              a.dtype)[0]  # fmt: skip
        y = torch.nn.functional.linear(a[pairs], w, None if w2_bias is None else w2_bias[e])
        out[pairs] = (y.float() * rw[pairs, None]).to(out.dtype)


def fused_moe_w4a16_ref(
    x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt,
    config: MoeTileConfig | None = None, *, w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None, activation: ExpertActivation = SILU,
) -> torch.Tensor:  # fmt: skip
    """Torch reference of `fused_moe_w4a16`: dequantize, then the plain per-expert MLP loop
    (each projection an unfused `F.linear` with its bias, rounded to x's dtype)."""
    num_tokens, top_k = topk_ids.shape
    w13_d = dequantize_w4_ref(w13, w13_scale, w13_global, fmt, x.dtype)
    w2_d = dequantize_w4_ref(w2, w2_scale, w2_global, fmt, x.dtype)
    inter = w13.shape[1] // 2
    y = torch.zeros(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    flat = topk_ids.reshape(-1).long()
    rw = topk_weights.reshape(-1)
    for e in flat.unique().tolist():
        pairs = torch.nonzero(flat == e).flatten()
        b13 = None if w13_bias is None else w13_bias[e]
        b2 = None if w2_bias is None else w2_bias[e]
        h = torch.nn.functional.linear(x[pairs // top_k], w13_d[e], b13)
        act = expert_activation_ref(h[:, :inter], h[:, inter:], activation)
        yy = torch.nn.functional.linear(act, w2_d[e], b2)
        y[pairs] = (yy.float() * rw[pairs, None]).to(x.dtype)
    return y.view(num_tokens, top_k, -1).sum(dim=1)
