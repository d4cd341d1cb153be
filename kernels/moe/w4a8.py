"""W4A8: FP8 e4m3 activations against the packed 4-bit weights (prefill rows, opt-in)."""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import check_device, jit, kernel_op
from .common import (
    GROUP,
    W4A8_PREFILL_CONFIG,
    W4A8TileConfig,
    _check_rows,
    _check_w4,
    _err,
    _global_scale,
)
from .dequant import _e2m1_e4m3_bits, _scale_value
from .routing import _check_tiles, _tile_pairs, moe_align_block_size
from .tiles import MoeShape, tile_choice
from .w4a16 import dequantize_w4_ref

#
# Activations are quantized with one per-tensor scale s (x_q = e4m3(clamp(x / s, +-448))), the 4-bit
# weights are expanded in the kernel to e4m3 without their scales (every E2M1 value times 2^-6 is
# exactly an e4m3 value; each partial product is multiplied back by 2^6), and each fp8 `tl.dot`
# covers exactly one scale group, so its partial product is multiplied by that group's scale in
# fp32 and added to an fp32 accumulator:
#     y = s * sum_g (x_q[g] . e2m1[g]) * scale_g * global
# fp8 dots need K >= 32 (Hopper wgmma and Ada mma read 32 bytes of K), so a K step is 32 elements:
# one MXFP4 group, or two NVFP4 groups run as two dots with the other group's weight rows zeroed
# (twice the tensor-core work for NVFP4, but exact; an NVFP4 scale is not a power of two, so it
# cannot be folded into e4m3 weights). Short fp8 dots, promoted to fp32 after each group, also avoid
# the limited accumulator precision of long fp8 tensor-core reductions.
#
# gate_up writes the intermediate already quantized with the down projection's scale (e4m3 codes
# rounded to nearest even by integer arithmetic, identical in the interpreter and on the GPU; the
# interpreter's own fp32 -> fp8 cast rounds wrongly), so the down kernel reads one byte per value.

FP8_MAX = 448.0
W4A8_BLOCK_K = 32  # K elements per fp8 dot: the minimum fp8 dot depth and one MXFP4 group


def quantize_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, K] -> float8_e4m3fn x / scale, clamped to +-448 and rounded to nearest even.

    `scale` is a one-element fp32 tensor on x's device (no host read). The clamp comes first
    because torch turns values past the e4m3 range into NaN instead of saturating."""
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise _err(f"scale must be one fp32 value, got {scale.dtype} {tuple(scale.shape)}")
    q = (x.float() / scale.reshape(())).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn)


@jit
def _fp32_to_e4m3_bits(v):
    """fp32 -> e4m3fn byte (int32), round to nearest even, saturating at +-448; NaN -> 0x7F."""
    u = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = u.to(tl.float32, bitcast=True)
    a = tl.where(a > 448.0, 448.0, a)  # FP8_MAX (a literal: kernels read no Python globals)
    u = a.to(tl.int32, bitcast=True)
    # normal (|v| >= 2^-6): drop 20 mantissa bits with RNE, rebias the exponent 127 -> 7
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: adding 2^14 (ulp 2^-9, e4m3's subnormal step) rounds to nearest even in fp32
    sub = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    bits = tl.where(u < (121 << 23), sub, normal)
    bits = tl.where(v != v, 0x7F, bits | sign)
    return bits


@jit
def _as_e4m3(bits):
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@jit
def _group_scales(s_ptrs, gscale, nmask, IS_NVFP4: tl.constexpr):
    byte = tl.load(s_ptrs, mask=nmask, other=0).to(tl.int32)
    return _scale_value(byte, IS_NVFP4) * gscale


@jit
def _w4a8_partial(xq, w_ptrs, s_ptrs, shift, r, wmask, nmask, gscale, IS_NVFP4: tl.constexpr):
    """sum over this 32-element K step of x_q * w, each scale group's dot times its scale.

    w_ptrs [32, BN]: row r points at the byte holding element k0 + r (each byte is read by the
    two rows of its nibbles); shift [32, 1]: 0 for even rows (low nibble), 4 for odd rows."""
    packed = tl.load(w_ptrs, mask=wmask, other=0).to(tl.int32)
    bits = _e2m1_e4m3_bits(packed >> shift)  # values * 2^-6: each dot is multiplied back by 2^6
    if IS_NVFP4:  # two 16-element groups: one dot each, the other group's rows zeroed
        lo = _as_e4m3(tl.where(r < 16, bits, 0))
        hi = _as_e4m3(tl.where(r >= 16, bits, 0))
        s_lo = _group_scales(s_ptrs, gscale, nmask, IS_NVFP4)
        s_hi = _group_scales(s_ptrs + 1, gscale, nmask, IS_NVFP4)
        part = (tl.dot(xq, lo, out_dtype=tl.float32) * 64.0) * s_lo[None, :]
        part += (tl.dot(xq, hi, out_dtype=tl.float32) * 64.0) * s_hi[None, :]
    else:
        w = _as_e4m3(bits)
        part = (tl.dot(xq, w, out_dtype=tl.float32) * 64.0) * _group_scales(
            s_ptrs, gscale, nmask, IS_NVFP4
        )[None, :]
    return part


@jit
def _w4a8_gate_up_kernel(
    xq_ptr,  # [num_tokens, K] float8_e4m3fn
    w_ptr,
    s_ptr,
    g_ptr,
    x_scale_ptr,  # [1] fp32: the activations' per-tensor scale
    out_scale_ptr,  # [1] fp32: the down projection's input scale (the intermediate's scale)
    out_ptr,  # [num_pairs, N] uint8: e4m3 bytes
    sorted_ptr,
    expert_ptr,
    npad_ptr,
    num_pairs,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    N: tl.constexpr,  # intermediate size I (w13 has 2N rows: gate then up)
    K: tl.constexpr,  # hidden size, a multiple of 32
    TOP_K: tl.constexpr,
    GROUP: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(npad_ptr):
        return
    expert, pair, valid, n, nmask = _tile_pairs(
        sorted_ptr, expert_ptr, num_pairs, N, BLOCK_M, BLOCK_N
    )
    token = (pair // TOP_K).to(tl.int64)
    r = tl.arange(0, BLOCK_K)
    shift = ((r & 1) * 4)[:, None]
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    g_gate = _global_scale(g_ptr, expert * 2, IS_NVFP4)
    g_up = _global_scale(g_ptr, expert * 2 + 1, IS_NVFP4)
    wmask = nmask[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xq = tl.load(xq_ptr + token[:, None] * stride_xt + (k0 + r)[None, :],
                     mask=valid[:, None], other=0.0)  # fmt: skip
        # each packed byte is read by the two rows of its nibbles
        wg_ptrs = w_base + n[None, :] * stride_wn + (k0 // 2 + r // 2)[:, None]
        sg_ptrs = s_base + n * stride_sn + k0 // GROUP
        acc_g += _w4a8_partial(xq, wg_ptrs, sg_ptrs, shift, r[:, None], wmask, nmask, g_gate,
                               IS_NVFP4)  # fmt: skip
        acc_u += _w4a8_partial(xq, wg_ptrs + N * stride_wn, sg_ptrs + N * stride_sn, shift,
                               r[:, None], wmask, nmask, g_up, IS_NVFP4)  # fmt: skip
    x_scale = tl.load(x_scale_ptr)
    gate = acc_g * x_scale
    up = acc_u * x_scale
    h = gate / (1.0 + tl.exp(-gate)) * up
    q = _fp32_to_e4m3_bits(h / tl.load(out_scale_ptr))
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + n[None, :]
    tl.store(out_ptrs, q.to(tl.uint8), mask=valid[:, None] & nmask[None, :])


@jit
def _w4a8_down_kernel(
    aq_ptr,  # [num_pairs, K] float8_e4m3fn
    w_ptr,
    s_ptr,
    g_ptr,
    a_scale_ptr,  # [1] fp32
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
    stride_ot,
    N: tl.constexpr,  # hidden size
    K: tl.constexpr,  # intermediate size, a multiple of 32
    GROUP: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(npad_ptr):
        return
    expert, pair, valid, n, nmask = _tile_pairs(
        sorted_ptr, expert_ptr, num_pairs, N, BLOCK_M, BLOCK_N
    )
    DT: tl.constexpr = out_ptr.dtype.element_ty
    pair64 = pair.to(tl.int64)
    r = tl.arange(0, BLOCK_K)
    shift = ((r & 1) * 4)[:, None]
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    gscale = _global_scale(g_ptr, expert, IS_NVFP4)
    wmask = nmask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        aq = tl.load(aq_ptr + pair64[:, None] * stride_at + (k0 + r)[None, :],
                     mask=valid[:, None], other=0.0)  # fmt: skip
        w_ptrs = w_base + n[None, :] * stride_wn + (k0 // 2 + r // 2)[:, None]
        s_ptrs = s_base + n * stride_sn + k0 // GROUP
        acc += _w4a8_partial(aq, w_ptrs, s_ptrs, shift, r[:, None], wmask, nmask, gscale,
                             IS_NVFP4)  # fmt: skip
    rw = tl.load(rw_ptr + pair64, mask=valid, other=0.0)
    y = (acc * tl.load(a_scale_ptr) * rw[:, None]).to(DT)
    out_ptrs = out_ptr + pair64[:, None] * stride_ot + n[None, :]
    tl.store(out_ptrs, y, mask=valid[:, None] & nmask[None, :])


def _check_fp8_rows(x: torch.Tensor, name: str, width: int) -> None:
    if x.dim() != 2 or x.shape[1] != width or x.dtype != torch.float8_e4m3fn:
        raise _err(f"{name} must be float8_e4m3fn [rows, {width}], got {x.dtype} {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise _err(f"{name} must be contiguous in its last dim")


def _check_scalar(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.numel() != 1:
        raise _err(f"{name} must be one fp32 value (a [1] tensor), got {t.dtype} {tuple(t.shape)}")


def _check_w4a8_tiles(k: int, sorted_ids, expert_ids, block_m: int) -> None:
    if k % W4A8_BLOCK_K:
        raise _err(f"K = {k} must be a multiple of {W4A8_BLOCK_K} for FP8-activation dots")
    _check_tiles(sorted_ids, expert_ids, block_m, W4A8_BLOCK_K)


@kernel_op("libkk::moe_w4a8_gate_up", mutates_args=("out",))
def moe_w4a8_gate_up(
    xq: torch.Tensor,  # [num_tokens, K] float8_e4m3fn, x / x_scale
    w13: torch.Tensor,  # [E, 2I, K/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, K/G] uint8
    w13_global: torch.Tensor,  # [E, 2] fp32 (gate, up); ignored for MXFP4
    x_scale: torch.Tensor,  # [1] fp32
    out_scale: torch.Tensor,  # [1] fp32: the down projection's input scale
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_pad: torch.Tensor,
    out: torch.Tensor,  # [num_tokens * top_k, I] float8_e4m3fn
    top_k: int,
    fmt: str,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """out[pair] = e4m3(SiLU(gate) * up / out_scale), gate and up = x_scale * (x_q @ w^T) in fp32."""
    k = xq.shape[-1]
    inter = w13.shape[1] // 2
    _check_fp8_rows(xq, "xq", k)
    _check_w4("w13", w13, w13_scale, w13_global, fmt, k, 2 * inter, 2)
    _check_fp8_rows(out, "out", inter)
    if out.shape[0] != xq.shape[0] * top_k:
        raise _err(f"out must have {xq.shape[0] * top_k} rows, got {out.shape[0]}")
    _check_scalar(x_scale, "x_scale")
    _check_scalar(out_scale, "out_scale")
    _check_w4a8_tiles(k, sorted_ids, expert_ids, block_m)
    check_device(xq)
    if out.shape[0] == 0:
        return
    grid = (expert_ids.shape[0], -(-inter // block_n))
    _w4a8_gate_up_kernel[grid](
        xq, w13, w13_scale, w13_global, x_scale, out_scale, out.view(torch.uint8),
        sorted_ids, expert_ids, num_post_pad, out.shape[0],
        xq.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        out.stride(0),
        N=inter, K=k, TOP_K=top_k, GROUP=GROUP[fmt], IS_NVFP4=fmt == "nvfp4",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=W4A8_BLOCK_K,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


@moe_w4a8_gate_up.register_fake
def _(xq, w13, w13_scale, w13_global, x_scale, out_scale, sorted_ids, expert_ids, num_post_pad,
      out, *args) -> None:  # fmt: skip
    return None


@kernel_op("libkk::moe_w4a8_down", mutates_args=("out",))
def moe_w4a8_down(
    aq: torch.Tensor,  # [num_pairs, I] float8_e4m3fn from moe_w4a8_gate_up
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/G] uint8
    w2_global: torch.Tensor,  # [E, 1] fp32; ignored for MXFP4
    a_scale: torch.Tensor,  # [1] fp32: aq's scale
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_pad: torch.Tensor,
    out: torch.Tensor,  # [num_pairs, H] float32/float16/bfloat16
    fmt: str,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """out[pair] = a_scale * (aq[pair] @ w2[expert]^T) * topk_weights.flat[pair], fp32 until the
    single rounding to out's dtype."""
    k = aq.shape[-1]
    hidden = w2.shape[1]
    _check_fp8_rows(aq, "aq", k)
    _check_w4("w2", w2, w2_scale, w2_global, fmt, k, hidden, 1)
    _check_rows(out, "out", hidden)
    if out.shape[0] != aq.shape[0]:
        raise _err(f"out must have {aq.shape[0]} rows, got {out.shape[0]}")
    if topk_weights.dtype != torch.float32 or topk_weights.numel() != aq.shape[0]:
        raise _err(
            f"topk_weights must be fp32 with {aq.shape[0]} elements, got {topk_weights.dtype} "
            f"{tuple(topk_weights.shape)}"
        )
    _check_scalar(a_scale, "a_scale")
    _check_w4a8_tiles(k, sorted_ids, expert_ids, block_m)
    check_device(aq)
    if out.shape[0] == 0:
        return
    grid = (expert_ids.shape[0], -(-hidden // block_n))
    _w4a8_down_kernel[grid](
        aq, w2, w2_scale, w2_global, a_scale, topk_weights.contiguous(), out,
        sorted_ids, expert_ids, num_post_pad, aq.shape[0],
        aq.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        out.stride(0),
        N=hidden, K=k, GROUP=GROUP[fmt], IS_NVFP4=fmt == "nvfp4",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=W4A8_BLOCK_K,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


@moe_w4a8_down.register_fake
def _(aq, w2, w2_scale, w2_global, a_scale, topk_weights, sorted_ids, expert_ids, num_post_pad,
      out, *args) -> None:  # fmt: skip
    return None


def fused_moe_w4a8(
    x: torch.Tensor,  # [num_tokens, H]
    w13: torch.Tensor,  # [E, 2I, H/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, H/G] uint8
    w13_global: torch.Tensor,  # [E, 2] fp32
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/G] uint8
    w2_global: torch.Tensor,  # [E, 1] fp32
    x_scale: torch.Tensor,  # [1] fp32: per-tensor FP8 scale of the layer's input
    a_scale: torch.Tensor,  # [1] fp32: per-tensor FP8 scale of the down projection's input
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64
    fmt: str,
    config: W4A8TileConfig | None = None,
) -> torch.Tensor:  # [num_tokens, H], x's dtype
    """The expert computation of one layer with FP8 activations (W4A8); no host synchronisation."""
    _check_rows(x, "x", x.shape[-1] if x.dim() == 2 else -1)
    num_tokens, top_k = topk_ids.shape
    if config is None:  # W4A8 runs eagerly (never traced, never graphed): a plain lookup
        shape = MoeShape(fmt, "w4a8", w13.shape[0], x.shape[-1], w13.shape[1] // 2, top_k)
        config = tile_choice(shape, num_tokens)
    cfg = config or W4A8_PREFILL_CONFIG
    tiles = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    sorted_ids, expert_ids, npad = moe_align_block_size(topk_ids, w13.shape[0], cfg.block_m)
    xq = quantize_fp8_per_tensor(x, x_scale)
    inter = torch.empty(num_tokens * top_k, w13.shape[1] // 2, dtype=torch.float8_e4m3fn,
                        device=x.device)  # fmt: skip
    moe_w4a8_gate_up(xq, w13, w13_scale, w13_global, x_scale, a_scale, sorted_ids, expert_ids,
                     npad, inter, top_k, fmt, *tiles)  # fmt: skip
    y = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    moe_w4a8_down(inter, w2, w2_scale, w2_global, a_scale, topk_weights, sorted_ids, expert_ids,
                  npad, y, fmt, *tiles)  # fmt: skip
    return y.view(num_tokens, top_k, -1).sum(dim=1)


def fused_moe_w4a8_ref(
    x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, x_scale, a_scale, topk_weights,
    topk_ids, fmt, config: W4A8TileConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """Torch reference of `fused_moe_w4a8`: x_q = e4m3(clamp(x / x_scale)), fp32 matmuls against
    the dequantized 4-bit weights times x_scale, SiLU(gate) * up quantized likewise with a_scale,
    the down projection times a_scale and the routing weight, one rounding to x's dtype."""
    num_tokens, top_k = topk_ids.shape
    w13_d = dequantize_w4_ref(w13, w13_scale, w13_global, fmt, torch.float32)
    w2_d = dequantize_w4_ref(w2, w2_scale, w2_global, fmt, torch.float32)
    inter = w13.shape[1] // 2
    xq = quantize_fp8_per_tensor(x, x_scale).float()
    xs, as_ = x_scale.reshape(()), a_scale.reshape(())
    y = torch.zeros(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    flat = topk_ids.reshape(-1).long()
    rw = topk_weights.reshape(-1)
    for e in flat.unique().tolist():
        pairs = torch.nonzero(flat == e).flatten()
        h = torch.nn.functional.linear(xq[pairs // top_k], w13_d[e]) * xs
        gate, up = h[:, :inter], h[:, inter:]
        act = gate / (1.0 + torch.exp(-gate)) * up
        aq = quantize_fp8_per_tensor(act, a_scale).float()
        yy = torch.nn.functional.linear(aq, w2_d[e]) * as_
        y[pairs] = (yy * rw[pairs, None]).to(x.dtype)
    return y.view(num_tokens, top_k, -1).sum(dim=1)
