"""rms_norm (+ residual add) and qk_norm_rope (Qwen3's per-head q/k RMSNorm, then RoPE): one
launch each.

Inductor, compiling the forward with an unbacked token count, gives every norm a reduction
kernel and a separate pointwise kernel (its fusion scores need size hints an unbacked size lacks),
and Qwen3's q/k norms plus rotary four; at decode sizes each is a ~1.5 µs launch-bound kernel.
As opaque ops these run as one kernel per norm and one per attention layer's q/k.

Rounding follows the torch references (Hugging Face's order) where it matters: the residual add
rounds to the activation dtype, the normalized value rounds to it before the weight multiply, the
q/k norm output rounds to it before the rotation, and cos/sin are cast to it. The rotation's
products and sums are fp32, rounded once at the end (as Inductor's fused code does), where the
eager reference rounds each.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import check_device, jit, next_pow2, pdl_args, wait_for_previous


@jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x as [rows, hidden] with unit stride along hidden (a view where it can be)."""
    x = x.reshape(-1, hidden)
    return x if x.stride(-1) == 1 else x.contiguous()


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


@torch.library.custom_op("libkk::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # x's shape, dtype promote(weight, x)
    """weight * (x / rms(x)), the normalized x rounded to x's dtype before the multiply."""
    check_device(x)
    hidden = weight.shape[0]
    rows = _rows(x, hidden)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    if rows.shape[0]:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, rows, weight, out, out, rows.stride(0), 0, hidden, eps,
            HAS_RESIDUAL=False, BLOCK=block, num_warps=_warps(block), **pdl_args(x.device),
        )  # fmt: skip
    return out


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight))


@torch.library.custom_op("libkk::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # x's shape and dtype
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype."""
    check_device(x)
    hidden = weight.shape[0]
    rows, res_rows = _rows(x, hidden), _rows(residual, hidden)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, out, summed, rows.stride(0), res_rows.stride(0), hidden, eps,
            HAS_RESIDUAL=True, BLOCK=block, num_warps=_warps(block), **pdl_args(x.device),
        )  # fmt: skip
    return out, summed


@add_rms_norm.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight)), x.new_empty(x.shape)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # NOTE: HF casts back to the input dtype *before* the weight multiply; keep that order so
    # bf16 rounding matches too.
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual  # in the activation dtype, as HF's `residual + hidden_states`
    return rms_norm_ref(summed, weight, eps), summed


@jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_sin_ptr,
    positions_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q,
    stride_k,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    d = tl.arange(0, HALF_PAD)
    mask = d < half
    if head < NUM_Q_HEADS:
        src = q_ptr + token * stride_q + head * HEAD_DIM
        weight_ptr = q_weight_ptr
        dst = q_out_ptr + token * (NUM_Q_HEADS * HEAD_DIM) + head * HEAD_DIM
    else:
        src = k_ptr + token * stride_k + (head - NUM_Q_HEADS) * HEAD_DIM
        weight_ptr = k_weight_ptr
        dst = k_out_ptr + token * (NUM_KV_HEADS * HEAD_DIM) + (head - NUM_Q_HEADS) * HEAD_DIM
    x1 = tl.load(src + d, mask=mask, other=0.0)
    x2 = tl.load(src + half + d, mask=mask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HEAD_DIM + eps)
    w1 = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
    # the norm's output, rounded as the separate norm op rounds it
    y1 = (w1 * (f1 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    y2 = (w2 * (f2 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + d, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + d, mask=mask, other=0.0)
    cos = cos.to(x1.dtype).to(tl.float32)
    sin = sin.to(x1.dtype).to(tl.float32)
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(dst + d, (y1 * cos - y2 * sin).to(out_ty), mask=mask)
    tl.store(dst + half + d, (y2 * cos + y1 * sin).to(out_ty), mask=mask)


@torch.library.custom_op("libkk::qk_norm_rope", mutates_args=())
def qk_norm_rope(
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos | sin
    positions: torch.Tensor,  # [num_tokens] int64
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head of q and k RMS-normalized (over head_dim, by q_weight / k_weight), then rotated
    by RoPE at its token's position (the halves of a head are the pairs, as in Llama/Qwen)."""
    check_device(q)
    head_dim = q_weight.shape[0]
    num_tokens = q.shape[0]
    num_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty((num_tokens, q.shape[1]), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, k.shape[1]), dtype=k.dtype, device=k.device)
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens, num_heads + num_kv_heads)](
            q, k, q_weight, k_weight, cos_sin_cache, positions, q_out, k_out,
            q.stride(0), k.stride(0), eps,
            NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HALF_PAD=next_pow2(head_dim // 2), num_warps=1, **pdl_args(q.device),
        )  # fmt: skip
    return q_out, k_out


@qk_norm_rope.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = q_weight.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)  # [T, head_dim]
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, head_dim // 2]

    def one(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = rms_norm_ref(x.reshape(x.shape[0], x.shape[1] // head_dim, head_dim), weight, eps)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(1)

    return one(q, q_weight), one(k, k_weight)
