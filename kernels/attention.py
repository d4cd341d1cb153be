"""paged_attention: attention of a flat, mixed batch of queries over the paged KV cache.

Request i owns query rows query_start_loc[i]:query_start_loc[i+1]; they are its last query_len
positions of seq_lens[i], and earlier positions (a prefix hit, or earlier steps) are read from the
cache through block_table[i]. Queries are causal within the new tokens; heads are grouped (GQA:
num_heads is a multiple of num_kv_heads). Scores and softmax are fp32; the output has q's dtype.

Two paths share that contract:
- varlen: one program per (BLOCK_Q query tokens x the heads sharing one KV head); it serves any
  batch (prefill, chunked prefill with prefix hits, mixed prefill + decode).
- decode: uniform batches (every request has the same query_len, 1 or 1+K drafts) split each
  request's context across programs (split-K, "flash-decoding") and merge the partial softmaxes,
  so one long sequence still spreads its KV reads over the whole GPU. The split count depends only
  on shapes, never on sequence lengths, so a CUDA graph captured once stays right for any context.

A sliding window (window > 0) limits each query at position p to keys at positions
p - window < n <= p (its last `window` positions, itself included; transformers' Mistral
convention); both paths skip the KV tiles wholly before it. 0 means full causal attention.

Attention sinks (gpt-oss): a learned logit per query head that joins every softmax denominator
and adds nothing to the output, so a row may give most of its weight to "nothing".

FP8 caches are dequantized on load: k_scale folds into the score scale and v_scale into the
output. Rows past query_start_loc[-1] (graph padding) are left as they are.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from ._jit import (
    check_device,
    device_parallelism,
    jit,
    kernel_op,
    next_pow2,
    pdl_args,
    wait_for_previous,
)
from .kv_cache import FP8_DTYPE

_LOG2E = math.log2(math.e)
# Running max starts finite: a row with every key masked so far then keeps weight 0 instead of
# computing exp2(-inf - -inf) = NaN (it happens in splits past a verify row's causal limit).
_NEG_BIG = -1.0e30
# The kernels' window when there is none: wider than any context, so `n > q_pos - window` holds.
_NO_WINDOW = 1 << 30

# Launch settings, from a sweep on an H200 (Triton 3.6, Qwen3-8B layer shapes). Decode rows are
# query_len * heads-per-KV-head, padded to 16 (tl.dot's minimum).
VARLEN_BLOCK_M = 64
VARLEN_BLOCK_N = 64
VARLEN_WARPS = 4
VARLEN_STAGES = 3
DECODE_BLOCK_N = 64
DECODE_WARPS = 4
DECODE_STAGES = 3
DECODE_MAX_ROWS = 64  # uniform batches with more rows per KV head take the varlen path
MAX_SPLITS = 64
SPLITS_PER_SM = 2  # decode programs per SM the split count aims for
# A windowed layer's decode splits keep at least this many key tiles each: a window of 128 keys
# is then one program per KV head, with no merge kernel after it.
MIN_WINDOW_SPLIT_TILES = 4


@jit
def _attend(
    q,  # [ROWS, DIM_PAD] in q's dtype
    q_pos,  # [ROWS] position of each row's token: it sees keys in (q_pos - window, q_pos]
    m_i,  # [ROWS] fp32 running max of scaled scores (log2 units)
    l_i,  # [ROWS] fp32 running softmax denominator
    acc,  # [ROWS, DIM_PAD] fp32 running unnormalized output
    cache_ptr,
    table,  # this request's block table row
    kv_head,
    kv_start,
    kv_end,
    qk_scale,
    cache_kv_stride,
    window,  # sliding window (_NO_WINDOW when none)
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STAGES: tl.constexpr,  # software pipelining depth of the KV loop
):
    """Online softmax over keys kv_start..kv_end-1, BLOCK_N at a time, gathered through pages."""
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    for start in tl.range(kv_start, kv_end, BLOCK_N, num_stages=STAGES):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_ok = n < kv_end
        block = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        kv_off = (block * PAGE + n % PAGE)[:, None] * (NUM_KV_HEADS * HEAD_DIM)
        kv_off += kv_head * HEAD_DIM + d[None, :]  # [BLOCK_N, DIM_PAD]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
        visible = visible & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))  # [ROWS, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + cache_kv_stride + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@jit
def _load_q(q_ptr, q_rows, head, row_ok, stride_qt, stride_qh, HEAD_DIM: tl.constexpr,
            DIM_PAD: tl.constexpr):  # fmt: skip
    """[ROWS, DIM_PAD] query rows (token q_rows, head `head`), zero where masked."""
    d = tl.arange(0, DIM_PAD)
    return tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )


@jit
def _sink_weight(sinks_ptr, head, row_ok, m_i, LOG2E: tl.constexpr):
    """Each row's sink term of the softmax denominator, exp(sink) in the units of l (scaled by
    2^-m with m the running max, log2 units)."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    return tl.exp2(tl.where(row_ok, sink * LOG2E - m_i, 0.0))  # masked rows: never stored


@jit
def _store_out(out_ptr, acc, l_i, m_i, v_scale_ptr, sinks_ptr, q_rows, head, row_ok, stride_ot,
               stride_oh, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, IS_FP8: tl.constexpr,
               HAS_SINKS: tl.constexpr, LOG2E: tl.constexpr):  # fmt: skip
    """out rows = acc / l (times v_scale for FP8 caches), in out's dtype; with sinks, l also
    holds each head's exp(sink)."""
    if HAS_SINKS:
        l_i = l_i + _sink_weight(sinks_ptr, head, row_ok, m_i, LOG2E)
    if IS_FP8:
        acc = acc * tl.load(v_scale_ptr)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    d = tl.arange(0, DIM_PAD)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (d < HEAD_DIM)[None, :],
    )


@jit
def _varlen_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,  # [num_heads] fp32 (HAS_SINKS)
    scale,
    window,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    cache_kv_stride,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_M = BLOCK_Q * GROUP_PAD rows
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NEG_BIG: tl.constexpr,
    LOG2E: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Request i's q blocks are numbered from query_start[i] // BLOCK_Q + i upward; those
    # starts increase with i, so a binary search finds the request that owns this block.
    lo = pid * 0  # tensors from the start: loop-carried values keep one type
    hi = lo + num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid
    req = lo
    q_start = tl.load(query_start_ptr + req)
    query_len = tl.load(query_start_ptr + req + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] token within the request
    head = kv_head * GROUP + rows % GROUP_PAD  # [BLOCK_M]
    row_ok = (tok < query_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_len + tok  # [BLOCK_M] position of each row's token
    q_rows = (q_start + tok).to(tl.int64)
    q = _load_q(q_ptr, q_rows, head, row_ok, stride_qt, stride_qh, HEAD_DIM, DIM_PAD)

    qk_scale = scale * LOG2E
    if IS_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # Keys past the last row's position are masked for every row of this block: stop there.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    # Keys before the first row's window are masked for every row: start there.
    kv_start = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    table = block_table_ptr + req.to(tl.int64) * stride_bt
    m_i, l_i, acc = _attend(
        q, q_pos, m_i, l_i, acc, cache_ptr, table, kv_head, kv_start, kv_end, qk_scale,
        cache_kv_stride, window, BLOCK_N, PAGE, NUM_KV_HEADS, HEAD_DIM, DIM_PAD, DOT_PRECISION,
        STAGES,
    )  # fmt: skip
    _store_out(out_ptr, acc, l_i, m_i, v_scale_ptr, sinks_ptr, q_rows, head, row_ok, stride_ot,
               stride_oh, HEAD_DIM, DIM_PAD, IS_FP8, HAS_SINKS, LOG2E)  # fmt: skip


@jit
def _decode_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, DIM_PAD] fp32, unnormalized
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, running max (log2 units)
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, softmax denominator
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    cache_kv_stride,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # >= query_len * GROUP, a power of two >= 16
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NEG_BIG: tl.constexpr,
    LOG2E: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    query_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    # The splits share the keys some row sees: from the first row's window on. Each split takes
    # a whole number of BLOCK_N tiles; trailing splits may get none.
    kv_lo = tl.maximum(seq_len - query_len + 1 - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_start = kv_lo + split * chunk
    kv_end = tl.minimum(seq_len, kv_start + chunk)
    if NUM_SPLITS > 1:
        if kv_start >= kv_end:
            return

    rows = tl.arange(0, ROWS)
    tok = rows // GROUP  # [ROWS] token within the request
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < query_len
    q_pos = seq_len - query_len + tok
    q_rows = (q_start + tok).to(tl.int64)
    q = _load_q(q_ptr, q_rows, head, row_ok, stride_qt, stride_qh, HEAD_DIM, DIM_PAD)

    qk_scale = scale * LOG2E
    if IS_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([ROWS], NEG_BIG, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    table = block_table_ptr + req.to(tl.int64) * stride_bt
    m_i, l_i, acc = _attend(
        q, q_pos, m_i, l_i, acc, cache_ptr, table, kv_head, kv_start, kv_end, qk_scale,
        cache_kv_stride, window, BLOCK_N, PAGE, NUM_KV_HEADS, HEAD_DIM, DIM_PAD, DOT_PRECISION,
        STAGES,
    )  # fmt: skip

    if NUM_SPLITS == 1:
        _store_out(out_ptr, acc, l_i, m_i, v_scale_ptr, sinks_ptr, q_rows, head, row_ok,
                   stride_ot, stride_oh, HEAD_DIM, DIM_PAD, IS_FP8, HAS_SINKS, LOG2E)  # fmt: skip
    else:
        part = (q_rows * (NUM_KV_HEADS * GROUP) + head) * NUM_SPLITS + split  # [ROWS]
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        d = tl.arange(0, DIM_PAD)
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=row_ok[:, None])


@jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    query_start_ptr,
    v_scale_ptr,
    sinks_ptr,
    window,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    LOG2E: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    query_len = tl.load(query_start_ptr + req + 1) - q_start
    if tok >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    # The splits the decode kernel wrote (same arithmetic as there).
    kv_lo = tl.maximum(seq_len - query_len + 1 - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    num_active = tl.cdiv(seq_len - kv_lo, tl.maximum(chunk, 1))
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_active
    row = (q_start + tok).to(tl.int64)
    part = (row * NUM_HEADS + head) * NUM_SPLITS + s  # [SPLITS_PAD]
    m_s = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    d = tl.arange(0, DIM_PAD)
    acc_s = tl.load(
        part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=s_ok[:, None], other=0.0
    )  # [SPLITS_PAD, DIM_PAD]
    m = tl.max(m_s, 0)
    w = tl.where(s_ok, tl.exp2(m_s - m), 0.0)
    total = tl.sum(w * l_s, 0)
    if HAS_SINKS:
        total += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * LOG2E - m)
    out = tl.sum(w[:, None] * acc_s, 0) / tl.where(total > 0.0, total, 1.0)  # [DIM_PAD]
    if IS_FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _check(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(
            "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] "
            f"tensor, got shape {tuple(kv_cache.shape)}"
        )
    num_kv_heads, head_dim = kv_cache.shape[3:]
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q must be [num_tokens, num_heads, {head_dim}] with num_heads a multiple of "
            f"{num_kv_heads}, got {tuple(q.shape)}"
        )
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must have q's shape and dtype and a unit stride in its last dim")
    if sinks is not None and (
        sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32 or not sinks.is_contiguous()
    ):
        raise ValueError(
            f"sinks must be a contiguous fp32 [{q.shape[1]}] tensor (one per query head), got "
            f"{sinks.dtype} {tuple(sinks.shape)}"
        )
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries and block_table "
            f"num_reqs rows; got {tuple(query_start_loc.shape)} and {tuple(block_table.shape)}"
        )


def default_num_splits(
    num_reqs: int, num_kv_heads: int, device: torch.device, max_keys: int | None = None
) -> int:
    """Context splits for a decode batch: about SPLITS_PER_SM programs per SM, and where a
    request sees at most `max_keys` keys (a sliding window), MIN_WINDOW_SPLIT_TILES key tiles a
    split or more.

    Shapes only (no sequence lengths), so CUDA graphs may capture the choice.
    """
    programs = num_reqs * num_kv_heads
    want = -(-SPLITS_PER_SM * device_parallelism(device) // max(programs, 1))
    if max_keys is not None:
        want = min(want, -(-max_keys // (MIN_WINDOW_SPLIT_TILES * DECODE_BLOCK_N)))
    return max(1, min(MAX_SPLITS, want))


@kernel_op("libkk::paged_attention", mutates_args=("out",))
def _paged_attention_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    max_query_len: int,
    num_splits: int,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    check_device(q)
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    _, _, page, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    # The most keys a row of a uniform batch sees: a window's, plus the request's other rows.
    max_keys = window + max_query_len - 1 if window > 0 else None
    window = window if window > 0 else _NO_WINDOW
    dim_pad = max(16, next_pow2(head_dim))
    common = dict(
        PAGE=page,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        IS_FP8=kv_cache.dtype == FP8_DTYPE,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NEG_BIG=_NEG_BIG,
        LOG2E=_LOG2E,
        **pdl_args(q.device),
    )
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0))
    sinks_arg = k_scale if sinks is None else sinks  # any pointer when there are none
    rows = next_pow2(max(16, max_query_len * group))
    # Uniform when the rows add up to num_reqs * max_query_len (each request has at most that
    # many). The decode kernel still reads every request's own query_len.
    if num_tokens == num_reqs * max_query_len and rows <= DECODE_MAX_ROWS:
        splits = num_splits or default_num_splits(num_reqs, num_kv_heads, q.device, max_keys)
        parts: list[torch.Tensor] = [out] * 3  # unused when nothing is split
        if splits > 1:
            parts = [
                torch.empty(
                    num_tokens, num_heads, splits, dim_pad, dtype=torch.float32, device=q.device
                ),
                torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device),
                torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device),
            ]
        _decode_kernel[(num_reqs, num_kv_heads, splits)](
            q, kv_cache, out, *parts, block_table, seq_lens, query_start_loc, k_scale, v_scale,
            sinks_arg, scale, window, *strides, kv_cache.stride(0),
            GROUP=group, ROWS=rows, NUM_SPLITS=splits, BLOCK_N=DECODE_BLOCK_N, **common,
            STAGES=DECODE_STAGES, num_warps=DECODE_WARPS,
        )  # fmt: skip
        if splits > 1:
            _merge_splits_kernel[(num_reqs, num_heads, max_query_len)](
                out, *parts, seq_lens, query_start_loc, v_scale, sinks_arg, window, out.stride(0),
                out.stride(1),
                NUM_HEADS=num_heads, NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits),
                BLOCK_N=DECODE_BLOCK_N, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
                IS_FP8=common["IS_FP8"], HAS_SINKS=common["HAS_SINKS"], LOG2E=_LOG2E,
                num_warps=4, **pdl_args(q.device),
            )  # fmt: skip
        return

    group_pad = next_pow2(group)
    block_m = max(VARLEN_BLOCK_M, group_pad)
    if max_query_len * group_pad <= 16:  # decode rows in a mixed batch: no wasted rows
        block_m = 16 if group_pad <= 16 else group_pad
    block_q = block_m // group_pad
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _varlen_kernel[grid](
        q, kv_cache, out, block_table, seq_lens, query_start_loc, k_scale, v_scale, sinks_arg,
        scale, window, num_reqs, *strides, kv_cache.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=VARLEN_BLOCK_N, **common, STAGES=VARLEN_STAGES, num_warps=VARLEN_WARPS,
    )  # fmt: skip


@_paged_attention_op.register_fake
def _(q, kv_cache, block_table, seq_lens, query_start_loc, out, scale, k_scale, v_scale,
      max_query_len, num_splits, window=0, sinks=None) -> None:  # fmt: skip
    return None


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context after this step (cached + new)
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    k_scale: torch.Tensor,  # [1] fp32; used only by FP8 caches
    v_scale: torch.Tensor,  # [1] fp32
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], q's dtype
    num_splits: int = 0,  # decode path's context splits; 0 picks by shape
    window: int = 0,  # sliding window: keys in (p - window, p] for a query at p; 0 = none
    sinks: torch.Tensor | None = None,  # [num_heads] fp32 attention sinks (logits); None: none
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged attention for a mixed batch; writes and returns `out` (allocated if None)."""
    out = torch.empty_like(q) if out is None else out
    _check(q, kv_cache, block_table, seq_lens, query_start_loc, out, sinks)
    _paged_attention_op(
        q, kv_cache, block_table, seq_lens, query_start_loc, out, scale, k_scale, v_scale,
        max_query_len, num_splits, window, sinks,
    )  # fmt: skip
    return out


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor | None = None,
    num_splits: int = 0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `paged_attention`: one fp32 softmax per request, straight from the math.

    `max_query_len` and `num_splits` only steer the kernels; the reference ignores them.
    """
    out = torch.empty_like(q) if out is None else out
    _check(q, kv_cache, block_table, seq_lens, query_start_loc, out, sinks)
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    is_fp8 = kv_cache.dtype == FP8_DTYPE
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        blocks = block_table[i, : -(-seq_len // page)].long()
        # [num_kv_heads, seq_len, head_dim], fp32 and dequantized
        keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].transpose(0, 1).float()
        values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].transpose(0, 1).float()
        if is_fp8:
            keys, values = keys * k_scale.float(), values * v_scale.float()
        keys = keys.repeat_interleave(group, 0)  # [num_heads, seq_len, head_dim]
        values = values.repeat_interleave(group, 0)
        queries = q[q_start:q_end].transpose(0, 1).float()  # [num_heads, query_len, head_dim]
        scores = queries @ keys.transpose(1, 2) * scale  # [num_heads, query_len, seq_len]
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window > 0:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more column per head, dropped after the softmax
            sink = sinks.float()[:, None, None].expand(-1, query_len, 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = scores.softmax(-1)[..., :seq_len]
        out[q_start:q_end] = (probs @ values).transpose(0, 1).to(q.dtype)
    return out
