"""rms_norm (+ residual add) and qk_norm_rope (Qwen3's per-head q/k RMSNorm, then RoPE; RoPE
alone for families without the norms): one launch each.

Inductor, compiling the forward with an unbacked token count, gives every norm a reduction
kernel and a separate pointwise kernel (its fusion scores need size hints an unbacked size lacks),
and Qwen3's q/k norms plus rotary four; at decode sizes each is a ~1.5 µs launch-bound kernel.
As opaque ops these run as one kernel per norm and one per attention layer's q/k. `add_rms_norm`
also takes an MoE layer's routed expert outputs [tokens, top_k, hidden] and sums them first, so
the top-k sum, which Inductor cannot fold into an opaque op, needs no kernel of its own.
`qk_norm_rope_store_kv` is the q/k kernel writing the rotated k, and v, into the paged KV cache
(as `store_kv` would) instead of returning k: attention reads keys only from the cache, so the
store's own launch goes.

Rounding follows the torch references (Hugging Face's order) where it matters: the residual add
rounds to the activation dtype, the normalized value rounds to it before the weight multiply, the
q/k norm output rounds to it before the rotation, and cos/sin are cast to it. The rotation's
products and sums are fp32, rounded once at the end (as Inductor's fused code does), where the
eager reference rounds each.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import check_device, jit, kernel_op, next_pow2, pdl_args, wait_for_previous
from .kv_cache import FP8_DTYPE, check_store_args, saturate_fp8, store_kv_ref


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
    NUM_TERMS: tl.constexpr,  # x rows per output row, summed first (an MoE layer's top-k outputs)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * NUM_TERMS * stride_x + cols, mask=mask, other=0.0)
    if NUM_TERMS > 1:  # in order, in fp32, rounded once: torch's sum over the terms' dim
        acc = x.to(tl.float32)
        for t in tl.static_range(1, NUM_TERMS):
            term = tl.load(x_ptr + (row * NUM_TERMS + t) * stride_x + cols, mask=mask, other=0.0)
            acc += term.to(tl.float32)
        x = acc.to(x.dtype)
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


@kernel_op("libkk::rms_norm", mutates_args=())
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
            HAS_RESIDUAL=False, NUM_TERMS=1, BLOCK=block, num_warps=_warps(block),
            **pdl_args(x.device),
        )  # fmt: skip
    return out


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight))


@kernel_op("libkk::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,  # residual's shape, or [..., num_terms, hidden]: terms summed first
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype. An x with one more
    dimension than residual holds terms of x (an MoE layer's routed expert outputs): they are
    summed in fp32 and rounded to x's dtype first, as `x.sum(dim=-2)` does, which saves that
    sum its own kernel."""
    check_device(x)
    hidden = weight.shape[0]
    num_terms = _num_terms(x, residual)
    rows, res_rows = _rows(x, hidden), _rows(residual, hidden)
    out = torch.empty(residual.shape, dtype=_out_dtype(x, weight), device=x.device)
    summed = torch.empty(residual.shape, dtype=x.dtype, device=x.device)
    if res_rows.shape[0]:
        block = next_pow2(hidden)
        _rms_norm_kernel[(res_rows.shape[0],)](
            rows, res_rows, weight, out, summed, rows.stride(0), res_rows.stride(0), hidden, eps,
            HAS_RESIDUAL=True, NUM_TERMS=num_terms, BLOCK=block, num_warps=_warps(block),
            **pdl_args(x.device),
        )  # fmt: skip
    return out, summed


@add_rms_norm.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _num_terms(x, residual)
    return (
        x.new_empty(residual.shape, dtype=_out_dtype(x, weight)),
        x.new_empty(residual.shape),
    )


def _num_terms(x: torch.Tensor, residual: torch.Tensor) -> int:
    """1 when x has residual's shape; K when x is residual's shape with a K axis before hidden."""
    if x.shape == residual.shape:
        return 1
    if x.dim() == residual.dim() + 1 and x.shape[:-2] + x.shape[-1:] == residual.shape:
        return x.shape[-2]
    raise ValueError(
        f"add_rms_norm: x {tuple(x.shape)} must have residual's shape {tuple(residual.shape)}, "
        "or that shape with a terms axis before the last"
    )


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
    _num_terms(x, residual)  # checks the shapes
    if x.dim() > residual.dim():
        x = x.sum(dim=-2)  # fp32 accumulation, rounded to x's dtype
    summed = x + residual  # in the activation dtype, as HF's `residual + hidden_states`
    return rms_norm_ref(summed, weight, eps), summed


@jit
def _to_cache(x, scale_ptr, cache_ptr, IS_FP8: tl.constexpr):
    """A K or V value as the cache stores it, exactly as kv_cache.store_kv converts it."""
    if IS_FP8:
        x = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        x = saturate_fp8(x)
    return x.to(cache_ptr.dtype.element_ty)


@jit
def _store_to_cache(dst, x1, x2, half, d, scale_ptr, cache_ptr, mask, IS_FP8: tl.constexpr):
    """Both halves of a K or V head row into the cache at dst."""
    tl.store(dst + d, _to_cache(x1, scale_ptr, cache_ptr, IS_FP8), mask=mask)
    tl.store(dst + half + d, _to_cache(x2, scale_ptr, cache_ptr, IS_FP8), mask=mask)


@jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,  # STORE only
    q_weight_ptr,  # NORM only
    k_weight_ptr,
    cos_sin_ptr,
    positions_ptr,
    q_out_ptr,
    k_out_ptr,  # without STORE
    cache_ptr,  # STORE: [2, num_blocks, PAGE, NUM_KV_HEADS, HEAD_DIM]
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_q,
    stride_k,
    stride_v,
    cache_kv_stride,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program: a [HEADS, HALF_PAD] tile per half of a head row
    NORM: tl.constexpr,  # each head RMS-normalized before the rotation (Qwen3); else rotation only
    STORE: tl.constexpr,  # k and v go to the cache (the blocks past the k heads copy v)
    PAGE: tl.constexpr,
    IS_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, block): the blocks of q heads, then of k heads (then, STORE, of v heads).
    # A block holds one kind only, so its heads share a weight and a destination; lanes past the
    # kind's last head are masked.
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks: tl.constexpr = (NUM_Q_HEADS + HEADS - 1) // HEADS
    kv_blocks: tl.constexpr = (NUM_KV_HEADS + HEADS - 1) // HEADS
    half = HEAD_DIM // 2
    lane = tl.arange(0, HEADS)
    d = tl.arange(0, HALF_PAD)[None, :]
    col_mask = d < half
    out_ty = q_out_ptr.dtype.element_ty
    row_stored = True
    cache_row = cache_ptr
    if STORE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        row_stored = slot >= PAGE  # a padded row's slot is the null block's, or negative
        cache_row = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM)
    if block < q_blocks + kv_blocks:
        if block < q_blocks:
            head = (block * HEADS + lane)[:, None]
            mask = col_mask & (head < NUM_Q_HEADS)
            src = q_ptr + token * stride_q + head * HEAD_DIM
            weight_ptr = q_weight_ptr
            dst = q_out_ptr + token * (NUM_Q_HEADS * HEAD_DIM) + head * HEAD_DIM
        else:
            head = ((block - q_blocks) * HEADS + lane)[:, None]
            mask = col_mask & (head < NUM_KV_HEADS)
            src = k_ptr + token * stride_k + head * HEAD_DIM
            weight_ptr = k_weight_ptr
            dst = k_out_ptr + token * (NUM_KV_HEADS * HEAD_DIM) + head * HEAD_DIM
        x1 = tl.load(src + d, mask=mask, other=0.0)
        x2 = tl.load(src + half + d, mask=mask, other=0.0)
        y1, y2 = x1.to(tl.float32), x2.to(tl.float32)
        if NORM:
            # each head's own sum of squares, along head_dim only
            ss = tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)
            rstd = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
            w1 = tl.load(weight_ptr + d, mask=col_mask, other=0.0).to(tl.float32)
            w2 = tl.load(weight_ptr + half + d, mask=col_mask, other=0.0).to(tl.float32)
            # the norm's output, rounded as the separate norm op rounds it
            y1 = (w1 * (y1 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
            y2 = (w2 * (y2 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        pos = tl.load(positions_ptr + token).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + d, mask=col_mask, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + d, mask=col_mask, other=0.0)
        cos = cos.to(x1.dtype).to(tl.float32)
        sin = sin.to(x1.dtype).to(tl.float32)
        r1 = (y1 * cos - y2 * sin).to(out_ty)
        r2 = (y2 * cos + y1 * sin).to(out_ty)
        out_mask = mask
        if STORE:  # k blocks write the cache instead of k_out
            out_mask = mask & (block < q_blocks)
            key_mask = mask & row_stored & (block >= q_blocks)
            key = cache_row + head * HEAD_DIM
            _store_to_cache(key, r1, r2, half, d, k_scale_ptr, cache_ptr, key_mask, IS_FP8)
        tl.store(dst + d, r1, mask=out_mask)
        tl.store(dst + half + d, r2, mask=out_mask)
    else:
        if STORE:  # the blocks past the k heads copy this step's v rows into the cache
            head = ((block - q_blocks - kv_blocks) * HEADS + lane)[:, None]
            mask = col_mask & (head < NUM_KV_HEADS) & row_stored
            src = v_ptr + token * stride_v + head * HEAD_DIM
            x1 = tl.load(src + d, mask=mask, other=0.0)
            x2 = tl.load(src + half + d, mask=mask, other=0.0)
            value = cache_row + cache_kv_stride + head * HEAD_DIM
            _store_to_cache(value, x1, x2, half, d, v_scale_ptr, cache_ptr, mask, IS_FP8)


@kernel_op("libkk::qk_norm_rope", mutates_args=())
def qk_norm_rope(
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    q_weight: torch.Tensor | None,  # [head_dim]; None (with k_weight None): no norm
    k_weight: torch.Tensor | None,  # [head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos | sin
    positions: torch.Tensor,  # [num_tokens] int64
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head of q and k RMS-normalized (over head_dim, by q_weight / k_weight; Qwen3), then
    rotated by RoPE at its token's position (the halves of a head are the pairs, as in
    Llama/Qwen). Without weights, the rotation alone (every other family)."""
    check_device(q)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, q_out, k_out)
    return q_out, k_out


def _heads_per_program(num_heads: int) -> int:
    """Heads of one token a program takes: 8, fewer where there are fewer q heads (a tile's side
    is a power of two).

    One head a program made 12K one-warp programs at 256 tokens of Qwen3-8B (32 q, 8 k, 8 v
    heads), latency-bound. Each head keeps a warp of its own, so a block takes about one head's
    time; 8 fills that model's blocks exactly: 4 + 1 + 1 a token, 1.5K programs at 256 tokens
    and still 6 at one."""
    return min(8, next_pow2(num_heads))


def _launch_qk_norm_rope(
    q, k, q_weight, k_weight, cos_sin_cache, positions, eps, q_out, k_out=None,
    v=None, kv_cache=None, slot_mapping=None, k_scale=None, v_scale=None,
) -> None:  # fmt: skip
    """Into q_out / k_out, or (kv_cache given) q_out and the cache."""
    head_dim = cos_sin_cache.shape[1]
    norm = _check_norm_weights(q_weight, k_weight, head_dim)
    num_tokens = q.shape[0]
    num_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    if not num_tokens:
        return
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    heads = _heads_per_program(num_heads)
    q_blocks, kv_blocks = -(-num_heads // heads), -(-num_kv_heads // heads)
    store = kv_cache is not None
    if store:
        v = v if v.stride(-1) == 1 else v.contiguous()
        cache_args = (kv_cache, slot_mapping, k_scale, v_scale, v.stride(0), kv_cache.stride(0))
        page, programs = kv_cache.shape[2], q_blocks + 2 * kv_blocks
    else:  # unread pointers and strides
        v, cache_args = k, (q_out, positions, q_out, q_out, 0, 0)
        page, programs = 1, q_blocks + kv_blocks
    cache, slots, k_sc, v_sc, stride_v, kv_stride = cache_args
    if not norm:  # unread pointers
        q_weight = k_weight = cos_sin_cache
    # One warp per head: each head row then has the layout (lanes, elements per lane) that a
    # one-warp program per head gave it, so its sum of squares reduces in the same order.
    _qk_norm_rope_kernel[(num_tokens, programs)](
        q, k, v, q_weight, k_weight, cos_sin_cache, positions, q_out,
        q_out if k_out is None else k_out, cache, slots, k_sc, v_sc,
        q.stride(0), k.stride(0), stride_v, kv_stride, eps,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_PAD=next_pow2(head_dim // 2), HEADS=heads, NORM=norm, STORE=store, PAGE=page,
        IS_FP8=store and kv_cache.dtype == FP8_DTYPE,
        num_warps=heads, **pdl_args(q.device),
    )  # fmt: skip


def _check_norm_weights(
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, head_dim: int
) -> bool:
    """Whether q and k are normalized: both weights given ([head_dim] each), or neither."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight are given together or not at all")
    for weight in (q_weight, k_weight):
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(
                f"a norm weight of shape {tuple(weight.shape)} for head_dim {head_dim} (the "
                "rope table's width)"
            )
    return q_weight is not None


@qk_norm_rope.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops of the norm modules and of RotaryEmbedding (same rounding, same order)."""
    head_dim = cos_sin_cache.shape[1]
    norm = _check_norm_weights(q_weight, k_weight, head_dim)
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)  # [T, head_dim]
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, head_dim // 2]

    def one(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        x = x.reshape(x.shape[0], x.shape[1] // head_dim, head_dim)
        if norm:
            x = rms_norm_ref(x, weight, eps)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(1)

    return one(q, q_weight), one(k, k_weight)


@kernel_op("libkk::qk_norm_rope_store_kv", mutates_args=("kv_cache", "q_out"))
def qk_norm_rope_store_kv(
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    q_weight: torch.Tensor | None,  # [head_dim]; None (with k_weight None): no norm
    k_weight: torch.Tensor | None,  # [head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos | sin
    positions: torch.Tensor,  # [num_tokens] int64
    eps: float,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (int32 works too)
    k_scale: torch.Tensor,  # [1] fp32; used only by FP8 caches
    v_scale: torch.Tensor,  # [1] fp32
    q_out: torch.Tensor,  # [num_tokens, num_heads * head_dim] contiguous: q normalized, rotated
) -> None:
    """qk_norm_rope (with or without the norms), then store_kv of the rotated k and of v, in one
    launch: k never leaves the kernel. Same values, rounding and skipped padded rows as the two
    ops.

    q comes back through q_out: like every op here that writes into an argument, it returns
    nothing."""
    check_device(q)
    head_dim = cos_sin_cache.shape[1]
    shape = (k.shape[0], k.shape[1] // head_dim, head_dim)
    check_store_args(k.view(shape), v.view(shape), kv_cache, slot_mapping)
    if q_out.shape != q.shape or q_out.dtype != q.dtype or not q_out.is_contiguous():
        raise ValueError(f"q_out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    _launch_qk_norm_rope(
        q, k, q_weight, k_weight, cos_sin_cache, positions, eps, q_out,
        v=v, kv_cache=kv_cache, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


@qk_norm_rope_store_kv.register_fake
def _(q, k, v, q_weight, k_weight, cos_sin_cache, positions, eps, kv_cache, slot_mapping,
      k_scale, v_scale, q_out) -> None:  # fmt: skip
    return None


def qk_norm_rope_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    q_out: torch.Tensor,
) -> None:
    q, k = qk_norm_rope_ref(q, k, q_weight, k_weight, cos_sin_cache, positions, eps)
    head_dim = cos_sin_cache.shape[1]
    shape = (k.shape[0], k.shape[1] // head_dim, head_dim)
    store_kv_ref(k.view(shape), v.view(shape), kv_cache, slot_mapping, k_scale, v_scale)
    q_out.copy_(q)
