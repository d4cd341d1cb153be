"""store_kv: write a step's new keys and values into the paged KV cache by slot.

The cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K half, V half). Slot s is
block s // block_size, offset s % block_size. Rows whose slot is negative or inside the null
block (block 0) are padding and are skipped. FP8 (e4m3) caches hold x / scale, saturated to the
format's range, with one scale per tensor for K and one for V; other cache dtypes ignore scales.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import check_device, jit, kernel_op, next_pow2, pdl_args, wait_for_previous

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


@jit
def saturate_fp8(x):
    """x clamped to e4m3fn's finite range, 448 (no inf in the format: an overflow would be NaN);
    the store kernels' one copy of the limit."""
    return tl.minimum(tl.maximum(x, -448.0), 448.0)


@jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    cache_kv_stride,  # elements from the K half of the cache to the V half
    PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IS_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < PAGE:  # null block or negative: a padded row
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    if IS_FP8:
        # NOTE: div_rn rounds like torch's division, so the op and the reference store the
        # same bytes; the clamp saturates instead of producing NaN (e4m3fn has no inf).
        k = tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr))
        v = tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr))
        k = saturate_fp8(k)
        v = saturate_fp8(v)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + cache_kv_stride, v.to(cache_ptr.dtype.element_ty), mask=mask)


def check_store_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(
            "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] "
            f"tensor, got shape {tuple(kv_cache.shape)}"
        )
    want = (slot_mapping.shape[0], *kv_cache.shape[3:])
    if tuple(key.shape) != want or tuple(value.shape) != want:
        raise ValueError(
            f"key/value must be [num_tokens, num_kv_heads, head_dim] = {want}, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )


@kernel_op("libkk::store_kv", mutates_args=("kv_cache",))
def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (int32 works too)
    k_scale: torch.Tensor,  # [1] fp32; used only by FP8 caches
    v_scale: torch.Tensor,  # [1] fp32
) -> None:
    """Writes key/value rows into `kv_cache` at `slot_mapping`, skipping padded rows."""
    check_store_args(key, value, kv_cache, slot_mapping)
    check_device(kv_cache)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    # The kernel walks the last dim with stride 1 (rows of a fused qkv output are fine).
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _, _, page, num_kv_heads, head_dim = kv_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        PAGE=page,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(num_kv_heads),
        DIM_PAD=next_pow2(head_dim),
        IS_FP8=kv_cache.dtype == FP8_DTYPE,
        num_warps=4,
        **pdl_args(kv_cache.device),
    )


@store_kv.register_fake
def _(key, value, kv_cache, slot_mapping, k_scale, v_scale) -> None:
    return None


def store_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
    k_scale: torch.Tensor,  # [1] fp32
    v_scale: torch.Tensor,  # [1] fp32
) -> None:
    """Torch reference of `store_kv`."""
    check_store_args(key, value, kv_cache, slot_mapping)
    _, num_blocks, page, num_kv_heads, head_dim = kv_cache.shape
    keep = slot_mapping >= page
    slots = slot_mapping[keep].long()
    key, value = key[keep], value[keep]
    if kv_cache.dtype == FP8_DTYPE:
        key = (key.float() / k_scale.float()).clamp(-FP8_MAX, FP8_MAX)
        value = (value.float() / v_scale.float()).clamp(-FP8_MAX, FP8_MAX)
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    flat = kv_cache.view(2, num_blocks * page, num_kv_heads, head_dim)
    if kv_cache.dtype == FP8_DTYPE:
        # index_copy_ has no FP8 kernels: copy the bytes.
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)
