"""Quantized mixture-of-experts ops: routing, expert alignment and fused W4A16 expert GEMMs, plus
W4A8 variants (FP8 e4m3 activations) for prefill rows; see the W4A8 section below.

Pipeline of one MoE layer (no host synchronisation anywhere, so it can be captured in a CUDA graph):

1. `moe_topk_routing`: top-k over softmax or sigmoid router probabilities, optionally renormalized
   (Qwen3-MoE: softmax + renorm when `norm_topk_prob`; Mixtral: softmax + renorm).
2. `moe_align_block_size`: the (token, expert) pairs, pair p = token * top_k + k, sorted by expert
   and each expert's run padded to a multiple of the M tile. Padding slots hold the sentinel
   `num_pairs`; blocks past the padded total have expert -1. Sizes are the static worst case.
3. `moe_w4a16_gate_up`: per M block (one expert), x[token] @ w13[expert]^T with the 4-bit weights
   dequantized in the kernel, then SiLU(gate) * up -> intermediate [num_pairs, I].
4. `moe_w4a16_down`: intermediate[pair] @ w2[expert]^T times the pair's routing weight -> [num_pairs,
   hidden]; `fused_moe_w4a16` then sums each token's top_k rows.

4-bit weights: uint8 [E, N, K/2], two E2M1 codes per byte, element 2i in the low nibble. Scales:
uint8 [E, N, K/G] bytes, NVFP4 (G=16) E4M3 with an fp32 global scale per (expert, projection),
MXFP4 (G=32) E8M0 (2^(b-127), 0xFF NaN) with no global scale. The kernel forms each weight exactly
as the torch dequantizer does (e2m1 * (scale * global) in fp32, rounded once to the activation
dtype), so it multiplies the same bf16 weights the dequantized reference path holds. It decodes
through the hardware fp8 conversion (compute capability >= 8.9): a nibble's bits moved into an
e4m3 byte are its value times 2^-6, and the 2^6 rides on the scale.

A tile config with block_m = PAIR_MAJOR replaces steps 2-4 with one matrix-vector product per pair
(see the pair-major section).

Because the packed bytes hold even and odd K elements in the two nibbles, the kernels split the
activations into even and odd columns and run two dots per K step instead of interleaving nibbles.

Tile configs: a static table (decode <= 64 tokens: 16-row M tiles, the weight stream dominates;
prefill: 64-row tiles), unless a higher layer installed measured choices for the layer's shape
(`install_tile_choice`; graphs/moe_tiles.py times candidates on the GPU and keeps them in the
artifact cache, which kernels/ cannot import). Triton's own autotune is not used.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton.language as tl

from libkk.errors import LibkkError

from ._jit import INTERPRETED, check_device, jit, next_pow2

FORMATS = ("nvfp4", "mxfp4")
GROUP = {"nvfp4": 16, "mxfp4": 32}
SCORING = ("softmax", "sigmoid")
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


# Decode: few rows per expert, so a 16-row tile (tl.dot's minimum) wastes the least, and narrow N
# tiles spread the few touched experts' weight stream over many SMs (batch 1 at the Qwen3-30B
# shape: 8 experts x 768 / 32 = 192 gate_up programs, 512 down programs); no split-K, as N alone
# already gives more programs than SMs there. Prefill: tiles big enough to reuse each dequantized
# weight tile across many rows.
DECODE_CONFIG = MoeTileConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3)
PREFILL_CONFIG = MoeTileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
DECODE_MAX_TOKENS = 64
# block_m of a W4A16 tile config that selects the pair-major decode path (no M tiles; see there).
PAIR_MAJOR = 1


def default_tile_config(num_tokens: int) -> MoeTileConfig:
    return DECODE_CONFIG if num_tokens <= DECODE_MAX_TOKENS else PREFILL_CONFIG


def _err(msg: str) -> MoeKernelError:
    return MoeKernelError(msg)


# --------------------------------------------------------------------------------------------------
# Routing


@jit
def _routing_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_t,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    emask = e < NUM_EXPERTS
    x = tl.load(logits_ptr + token * stride_t + e, mask=emask, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        p = 1.0 / (1.0 + tl.exp(-x))
    else:
        z = tl.exp(x - tl.max(x, axis=0))
        p = z / tl.sum(z, axis=0)
    p = tl.where(emask, p, -1.0)  # below every probability: padding is never picked
    kk = tl.arange(0, K_PAD)
    w = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        # the lowest index among equal maxima
        idx = tl.min(tl.where(p == best, e, E_PAD), axis=0)
        w = tl.where(kk == k, best, w)
        ids = tl.where(kk == k, idx, ids)
        p = tl.where(e == idx, -2.0, p)
    if RENORM:
        w = w / tl.sum(tl.where(kk < TOP_K, w, 0.0), axis=0)
    kmask = kk < TOP_K
    tl.store(weights_ptr + token * TOP_K + kk, w, mask=kmask)
    tl.store(ids_ptr + token * TOP_K + kk, ids, mask=kmask)


def _check_routing(router_logits: torch.Tensor, top_k: int, scoring: str) -> None:
    if router_logits.dim() != 2:
        raise _err(f"router_logits must be [num_tokens, num_experts], got {router_logits.shape}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise _err(f"top_k={top_k} must be in 1..num_experts ({router_logits.shape[1]})")
    if scoring not in SCORING:
        raise _err(f"scoring {scoring!r} is not supported; supported: {', '.join(SCORING)}")


@torch.library.custom_op("libkk::moe_topk_routing", mutates_args=())
def moe_topk_routing(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [num_tokens, top_k] fp32, ids [num_tokens, top_k] int32), best first."""
    _check_routing(router_logits, top_k, scoring)
    check_device(router_logits)
    num_tokens, num_experts = router_logits.shape
    dev = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    _routing_kernel[(num_tokens,)](
        logits,
        weights,
        ids,
        logits.stride(0),
        NUM_EXPERTS=num_experts,
        E_PAD=next_pow2(num_experts),
        TOP_K=top_k,
        K_PAD=next_pow2(top_k),
        SIGMOID=scoring == "sigmoid",
        RENORM=renormalize,
        num_warps=4 if num_experts > 256 else 1,
    )
    return weights, ids


@moe_topk_routing.register_fake
def _(router_logits, top_k, renormalize, scoring="softmax"):
    n = router_logits.shape[0]
    return (
        router_logits.new_empty(n, top_k, dtype=torch.float32),
        router_logits.new_empty(n, top_k, dtype=torch.int32),
    )


def moe_topk_routing_ref(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `moe_topk_routing` (HF's op order: probabilities in fp32, top-k, divide
    by their sum)."""
    _check_routing(router_logits, top_k, scoring)
    x = router_logits.float()
    probs = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# --------------------------------------------------------------------------------------------------
# Alignment of (token, expert) pairs into expert blocks


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static size of sorted_ids: every pair plus at most block_m - 1 padding per used expert."""
    padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-padded // block_m) * block_m


@jit
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    npad_ptr,
    num_pairs,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIRS_PAD: tl.constexpr,  # num_pairs rounded up to a power of two (a constexpr loop bound)
    BLOCKS_PAD: tl.constexpr,
    SLOTS_PAD: tl.constexpr,  # num_blocks * BLOCK_M, likewise
    CHUNK: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    c = tl.arange(0, CHUNK)
    # 0. every slot starts as padding (here rather than in a fill kernel: decode runs this per
    # MoE layer, and a separate launch costs more than the whole alignment)
    for start in range(0, SLOTS_PAD, CHUNK):
        slot = start + c
        tl.store(sorted_ptr + slot, tl.full([CHUNK], 0, tl.int32) + num_pairs,
                 mask=slot < num_blocks * BLOCK_M)  # fmt: skip
    tl.debug_barrier()  # the padding is written before any pair lands on its slot
    # 1. tokens per expert
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, PAIRS_PAD, CHUNK):
        p = start + c
        ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        counts += tl.sum(hit, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_PAD] inclusive
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(npad_ptr, total)
    # 2. the expert of each M block: the first expert whose padded run ends after the block start
    for start in range(0, BLOCKS_PAD, CHUNK):
        b = start + c
        row0 = b * BLOCK_M
        before = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)  # [CHUNK]
        expert = tl.where(row0 < total, before, -1)
        tl.store(expert_ids_ptr + b, expert, mask=b < num_blocks)
    # 3. scatter each pair to its expert's run, in pair order (stable)
    cursor = starts
    for start in range(0, PAIRS_PAD, CHUNK):
        p = start + c
        ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        rank = tl.cumsum(hit, axis=0) - hit  # earlier pairs of the same expert in this chunk
        pos = tl.sum(hit * (cursor[None, :] + rank), axis=1)  # [CHUNK]
        tl.store(sorted_ptr + pos, p, mask=p < num_pairs)
        cursor += tl.sum(hit, axis=0)


# Above this many pairs the alignment runs as three grid-wide kernels (count per chunk, prefix
# over chunks, scatter) instead of one program walking every pair: at 4096 tokens x top-8 one
# program would take about as long as the expert GEMMs.
ALIGN_SINGLE_MAX_PAIRS = 1024
ALIGN_CHUNK = 128  # pairs per program of the grid-wide path
ALIGN_CHUNK_GROUP = 32  # chunks per step of the prefix kernel's loops


@jit
def _align_count_kernel(
    ids_ptr,
    counts_ptr,  # [num_chunks, E_PAD] int32 out
    num_pairs,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    p = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    hit = (ids[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    tl.store(counts_ptr + pid * E_PAD + e, tl.sum(hit, axis=0))


@jit
def _align_prefix_kernel(
    counts_ptr,  # [num_chunks, E_PAD] int32
    base_ptr,  # [num_chunks, E_PAD] int32 out: first slot of each (chunk, expert)'s pairs
    expert_ids_ptr,
    npad_ptr,
    num_chunks,
    num_blocks,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
    GROUP: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    g = tl.arange(0, GROUP)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, CHUNKS_PAD, GROUP):
        c = c0 + g
        cnt = tl.load(counts_ptr + c[:, None] * E_PAD + e[None, :], mask=(c < num_chunks)[:, None],
                      other=0)  # fmt: skip
        counts += tl.sum(cnt, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    carry = ends - padded  # [E_PAD] the expert's first slot
    total = tl.sum(padded, axis=0)
    tl.store(npad_ptr, total)
    for c0 in range(0, CHUNKS_PAD, GROUP):
        c = c0 + g
        cmask = (c < num_chunks)[:, None]
        cnt = tl.load(counts_ptr + c[:, None] * E_PAD + e[None, :], mask=cmask, other=0)
        before = tl.cumsum(cnt, axis=0) - cnt  # earlier chunks of this group
        tl.store(base_ptr + c[:, None] * E_PAD + e[None, :], carry[None, :] + before, mask=cmask)
        carry += tl.sum(cnt, axis=0)
    for b0 in range(0, BLOCKS_PAD, GROUP):
        b = b0 + g
        row0 = b * BLOCK_M
        before_b = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(row0 < total, before_b, -1), mask=b < num_blocks)


@jit
def _align_scatter_kernel(
    ids_ptr,
    base_ptr,  # [num_chunks, E_PAD] int32
    sorted_ptr,
    num_pairs,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    p = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    hit = (ids[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    rank = tl.cumsum(hit, axis=0) - hit
    base = tl.load(base_ptr + pid * E_PAD + e)
    pos = tl.sum(hit * (base[None, :] + rank), axis=1)
    tl.store(sorted_ptr + pos, p, mask=p < num_pairs)


def _check_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise _err(
            f"topk_ids must be int32/int64 [num_tokens, top_k], got {topk_ids.dtype} "
            f"{tuple(topk_ids.shape)}"
        )
    if num_experts < 1:
        raise _err(f"num_experts must be positive, got {num_experts}")
    if block_m < 1:
        raise _err(f"block_m must be positive, got {block_m}")


@torch.library.custom_op("libkk::moe_align_block_size", mutates_args=())
def moe_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64, values in 0..num_experts-1
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [P], expert_ids int32 [P / block_m], num_post_pad int32 [1]).

    P = max_padded_pairs(...). sorted_ids lists pair indices grouped by expert (ascending expert,
    pairs in ascending order within an expert), each group padded with the sentinel num_pairs to a
    multiple of block_m; slots from num_post_pad on are all sentinel and their blocks' expert is -1.
    """
    _check_align(topk_ids, num_experts, block_m)
    check_device(topk_ids)
    num_pairs = topk_ids.numel()
    size = max_padded_pairs(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    num_blocks = size // block_m
    ids = topk_ids.contiguous().view(-1)
    e_pad = next_pow2(num_experts)
    if 0 < num_pairs <= ALIGN_SINGLE_MAX_PAIRS:  # one program writes every output slot
        sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
        num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
        chunk = max(16, min(64, 8192 // e_pad))
        _align_kernel[(1,)](
            ids,
            sorted_ids,
            expert_ids,
            num_post_pad,
            num_pairs,
            num_blocks,
            NUM_EXPERTS=num_experts,
            E_PAD=e_pad,
            BLOCK_M=block_m,
            PAIRS_PAD=max(next_pow2(num_pairs), chunk),
            BLOCKS_PAD=max(next_pow2(num_blocks), chunk),
            SLOTS_PAD=max(next_pow2(size), chunk),
            CHUNK=chunk,
            num_warps=4,
        )
        return sorted_ids, expert_ids, num_post_pad
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=dev)
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32, device=dev)
    num_post_pad = torch.zeros(1, dtype=torch.int32, device=dev)
    if num_pairs > 0:
        num_chunks = -(-num_pairs // ALIGN_CHUNK)
        counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)
        base = torch.empty_like(counts)
        _align_count_kernel[(num_chunks,)](
            ids, counts, num_pairs, E_PAD=e_pad, CHUNK=ALIGN_CHUNK, num_warps=4
        )
        group = ALIGN_CHUNK_GROUP
        _align_prefix_kernel[(1,)](
            counts,
            base,
            expert_ids,
            num_post_pad,
            num_chunks,
            num_blocks,
            E_PAD=e_pad,
            BLOCK_M=block_m,
            CHUNKS_PAD=max(next_pow2(num_chunks), group),
            BLOCKS_PAD=max(next_pow2(num_blocks), group),
            GROUP=group,
            num_warps=4,
        )
        _align_scatter_kernel[(num_chunks,)](
            ids, base, sorted_ids, num_pairs, E_PAD=e_pad, CHUNK=ALIGN_CHUNK, num_warps=4
        )
    return sorted_ids, expert_ids, num_post_pad


@moe_align_block_size.register_fake
def _(topk_ids, num_experts, block_m):
    size = max_padded_pairs(topk_ids.numel(), num_experts, block_m)
    return (
        topk_ids.new_empty(size, dtype=torch.int32),
        topk_ids.new_empty(size // block_m, dtype=torch.int32),
        topk_ids.new_empty(1, dtype=torch.int32),
    )


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `moe_align_block_size` (reads counts on the host)."""
    _check_align(topk_ids, num_experts, block_m)
    num_pairs = topk_ids.numel()
    size = max_padded_pairs(num_pairs, num_experts, block_m)
    flat = topk_ids.reshape(-1).long().cpu()
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32)
    expert_ids = torch.full((size // block_m,), -1, dtype=torch.int32)
    pos = 0
    for expert in range(num_experts):
        pairs = torch.nonzero(flat == expert).flatten()
        if pairs.numel() == 0:
            continue
        n = -(-pairs.numel() // block_m) * block_m
        sorted_ids[pos : pos + pairs.numel()] = pairs.to(torch.int32)
        expert_ids[pos // block_m : (pos + n) // block_m] = expert
        pos += n
    dev = topk_ids.device
    return sorted_ids.to(dev), expert_ids.to(dev), torch.tensor([pos], dtype=torch.int32).to(dev)


# --------------------------------------------------------------------------------------------------
# In-kernel dequantization


@jit
def _scale_value(byte, IS_NVFP4: tl.constexpr):
    """A scale byte (int32) -> fp32: E4M3 (NVFP4) or E8M0 (MXFP4), NaN patterns included."""
    nan = tl.full(byte.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    if IS_NVFP4:
        e = (byte >> 3) & 15
        m = byte & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        mag = tl.where((e == 15) & (m == 7), nan, mag)
        return tl.where((byte & 0x80) != 0, -mag, mag)
    else:
        # 2^(b - 127): the exponent field is b itself; b = 0 is the subnormal 2^-127
        val = tl.where(byte == 0, 1 << 22, byte << 23).to(tl.float32, bitcast=True)
        return tl.where(byte == 255, nan, val)


@jit
def _e2m1_e4m3_bits(nibbles):
    """E2M1 codes in the low 4 bits (integers) -> e4m3 bytes holding each value * 2^-6.

    Moving the sign to bit 7 and the two exponent bits and the mantissa bit to bits 4..2 makes an
    e4m3 byte whose value is the E2M1 value times 2^-6 (E2M1's subnormal 0.5 lands on e4m3's
    subnormal 2^-7), so the hardware fp8 conversion replaces a decode of selects and shifts; the
    callers fold the 2^6 into their scales."""
    return ((nibbles << 2) & 0x1C) | ((nibbles << 4) & 0x80)


@jit
def _e2m1_as_e4m3(nibbles):
    return _e2m1_e4m3_bits(nibbles).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@jit
def _e2m1_pairs_as_f16(packed):
    """Packed E2M1 bytes (uint8) -> (low nibble, high nibble) values * 2^-6 as float16, four bytes
    per 32-bit register: the nibbles move into e4m3 bytes with whole-word bit operations and the
    hardware converts two e4m3 bytes per instruction (~1.4 instructions per weight, where byte-wise
    Triton code spends ~8 on unpacking and repacking bytes)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, u, lo, hi;
        .reg .b16 l0, l1, h0, h1;
        shl.b32 t, $4, 2;
        and.b32 t, t, 0x1C1C1C1C;
        shl.b32 u, $4, 4;
        and.b32 u, u, 0x80808080;
        or.b32 lo, t, u;
        shr.b32 t, $4, 2;
        and.b32 t, t, 0x1C1C1C1C;
        and.b32 u, $4, 0x80808080;
        or.b32 hi, t, u;
        mov.b32 {l0, l1}, lo;
        mov.b32 {h0, h1}, hi;
        cvt.rn.f16x2.e4m3x2 $0, l0;
        cvt.rn.f16x2.e4m3x2 $1, l1;
        cvt.rn.f16x2.e4m3x2 $2, h0;
        cvt.rn.f16x2.e4m3x2 $3, h1;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


def _ptx_decode(block_n: int, block_k: int, num_warps: int) -> bool:
    """Whether a W4 tile of these sizes decodes through `_e2m1_pairs_as_f16`: on CUDA, with at
    least the four packed bytes per thread that one call takes."""
    return not INTERPRETED and block_n * block_k // 2 >= 4 * 32 * num_warps


@jit
def _w4_tile(
    w_ptrs,  # [BK/2, BN] pointers to packed bytes
    s_ptrs,  # [BK/G, BN] pointers to the scale bytes of the tile's groups
    gscale,  # fp32 scalar (1.0 for MXFP4)
    wmask,
    smask,
    DT: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    GROUP: tl.constexpr,
    USE_PTX: tl.constexpr,  # the inline-PTX nibble decode (CUDA; the interpreter runs no PTX)
):
    """(even, odd) weight tiles [BK/2, BN] in DT, each e2m1 * (scale * global) rounded once from
    fp32, as the reference dequantization computes it."""
    packed = tl.load(w_ptrs, mask=wmask, other=0)
    sbyte = tl.load(s_ptrs, mask=smask, other=0)
    if IS_NVFP4:
        # (scale * global) * 2^6 is exact, so each product below rounds like e2m1 * (scale*global)
        step = sbyte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (gscale * 64.0)
    else:
        step = _scale_value(sbyte.to(tl.int32), IS_NVFP4)  # 2^(b-127) may be near fp32's limit
    NG: tl.constexpr = step.shape[0]
    BN: tl.constexpr = step.shape[1]
    step = tl.reshape(
        tl.broadcast_to(step[:, None, :], [NG, GROUP // 2, BN]), [NG * GROUP // 2, BN]
    )
    if USE_PTX:
        lo, hi = _e2m1_pairs_as_f16(packed)
    else:
        lo = _e2m1_as_e4m3(packed)
        hi = _e2m1_as_e4m3(packed >> 4)
    if IS_NVFP4:
        even = (lo.to(tl.float32) * step).to(DT)
        odd = (hi.to(tl.float32) * step).to(DT)
    else:
        even = ((lo.to(tl.float32) * 64.0) * step).to(DT)
        odd = ((hi.to(tl.float32) * 64.0) * step).to(DT)
    return even, odd


# --------------------------------------------------------------------------------------------------
# Fused expert GEMMs


@jit
def _tile_pairs(sorted_ptr, expert_ptr, num_pairs, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert, its M tile of (token, expert) pair ids and their validity, and its
    N tile of output columns and their mask."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, pair, pair < num_pairs, n, n < N


@jit
def _w4_step(w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K: tl.constexpr,
             GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """One K step of a W4 tile: its even elements kk [BK/2] and their mask, pointers to its packed
    bytes [BK/2, BN], pointers to its scale bytes [BK/G, BN], and the masks of both tiles.

    Byte offsets as k0/2 + j (not kk/2) let the compiler see each thread's bytes contiguous, and
    with EVEN_K (BLOCK_K divides K) the weight mask varies along N only: the packed bytes then
    load as wide vectors along K."""
    j = tl.arange(0, BLOCK_K // 2)
    g = tl.arange(0, BLOCK_K // GROUP)
    kk = k0 + 2 * j
    kmask = kk < K
    w_ptrs = w_base + n[None, :] * stride_wn + (k0 // 2 + j)[:, None]
    s_ptrs = s_base + n[None, :] * stride_sn + (k0 // GROUP + g)[:, None]
    if EVEN_K:
        wmask = nmask[None, :]
        smask = nmask[None, :]
    else:
        wmask = kmask[:, None] & nmask[None, :]
        smask = ((k0 + g * GROUP) < K)[:, None] & nmask[None, :]
    return kk, kmask, w_ptrs, s_ptrs, wmask, smask


@jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
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
    g_gate = 1.0
    g_up = 1.0
    if IS_NVFP4:
        g_gate = tl.load(g_ptr + expert * 2)
        g_up = tl.load(g_ptr + expert * 2 + 1)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk, kmask, wg_ptrs, sg_ptrs, wmask, smask = _w4_step(
            w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K, GROUP, BLOCK_K, EVEN_K
        )
        amask = valid[:, None] & kmask[None, :]
        x_ptrs = x_ptr + token[:, None] * stride_xt + kk[None, :]
        xe = tl.load(x_ptrs, mask=amask, other=0.0)
        xo = tl.load(x_ptrs + 1, mask=amask, other=0.0)
        ge, go = _w4_tile(wg_ptrs, sg_ptrs, g_gate, wmask, smask, DT, IS_NVFP4, GROUP, USE_PTX)
        ue, uo = _w4_tile(wg_ptrs + N * stride_wn, sg_ptrs + N * stride_sn, g_up, wmask, smask,
                          DT, IS_NVFP4, GROUP, USE_PTX)  # fmt: skip
        acc_g = tl.dot(xe, ge, acc_g, input_precision=PRECISION)
        acc_g = tl.dot(xo, go, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(xe, ue, acc_u, input_precision=PRECISION)
        acc_u = tl.dot(xo, uo, acc_u, input_precision=PRECISION)
    # Round each projection to the activation dtype first, as the unfused linear would.
    gate = acc_g.to(DT).to(tl.float32)
    up = acc_u.to(DT).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
    h = (act * up).to(DT)
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + n[None, :]
    tl.store(out_ptrs, h, mask=valid[:, None] & nmask[None, :])


@jit
def _down_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
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
    K: tl.constexpr,  # intermediate size
    GROUP: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask, so weight loads vectorize along K
    USE_PTX: tl.constexpr,
    PRECISION: tl.constexpr,
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
    gscale = 1.0
    if IS_NVFP4:
        gscale = tl.load(g_ptr + expert)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk, kmask, w_ptrs, s_ptrs, wmask, smask = _w4_step(
            w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K, GROUP, BLOCK_K, EVEN_K
        )
        amask = valid[:, None] & kmask[None, :]
        a_ptrs = a_ptr + pair64[:, None] * stride_at + kk[None, :]
        ae = tl.load(a_ptrs, mask=amask, other=0.0)
        ao = tl.load(a_ptrs + 1, mask=amask, other=0.0)
        we, wo = _w4_tile(w_ptrs, s_ptrs, gscale, wmask, smask, DT, IS_NVFP4, GROUP, USE_PTX)
        acc = tl.dot(ae, we, acc, input_precision=PRECISION)
        acc = tl.dot(ao, wo, acc, input_precision=PRECISION)
    rw = tl.load(rw_ptr + pair64, mask=valid, other=0.0)  # fp32 routing weight of each pair
    y = (acc.to(DT).to(tl.float32) * rw[:, None]).to(DT)
    out_ptrs = out_ptr + pair64[:, None] * stride_ot + n[None, :]
    tl.store(out_ptrs, y, mask=valid[:, None] & nmask[None, :])


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


@torch.library.custom_op("libkk::moe_w4a16_gate_up", mutates_args=("out",))
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
) -> None:
    """out[pair] = SiLU(x[token] @ gate^T) * (x[token] @ up^T) with the pair's expert's weights."""
    k = x.shape[-1]
    inter = w13.shape[1] // 2
    _check_rows(x, "x", k)
    _check_w4("w13", w13, w13_scale, w13_global, fmt, k, 2 * inter, 2)
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
        num_warps=num_warps,
        num_stages=num_stages,
    )


@moe_w4a16_gate_up.register_fake
def _(x, w13, w13_scale, w13_global, sorted_ids, expert_ids, num_post_pad, out, *args) -> None:
    return None


@torch.library.custom_op("libkk::moe_w4a16_down", mutates_args=("out",))
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
) -> None:
    """out[pair] = (a[pair] @ w2[expert]^T) * topk_weights.flat[pair]."""
    k = a.shape[-1]
    hidden = w2.shape[1]
    _check_rows(a, "a", k)
    _check_w4("w2", w2, w2_scale, w2_global, fmt, k, hidden, 1)
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
        num_warps=num_warps,
        num_stages=num_stages,
    )


@moe_w4a16_down.register_fake
def _(a, w2, w2_scale, w2_global, topk_weights, sorted_ids, expert_ids, num_post_pad, out, *args):
    return None


def _check_tiles(
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, block_m: int, block_k: int
) -> None:
    if block_m < 16 or block_m & (block_m - 1):
        raise _err(f"block_m must be a power of two >= 16 (tl.dot's minimum), got {block_m}")
    if block_k < 32 or block_k & (block_k - 1):
        raise _err(f"block_k must be a power of two >= 32, got {block_k}")
    if sorted_ids.numel() != expert_ids.numel() * block_m:
        raise _err(
            f"sorted_ids ({sorted_ids.numel()}) must be expert_ids ({expert_ids.numel()}) "
            f"x block_m ({block_m}): align with the same block_m"
        )


# --------------------------------------------------------------------------------------------------
# Pair-major decode path (tile config block_m = 1)
#
# With a few tokens, each (token, expert) pair is its own matrix-vector product: both grids run
# over (pair, N tile), reading the pair's expert id straight from topk_ids. No alignment, no
# tensor cores: each weight costs a multiply-add instead of a tensor-core operand round trip
# through shared memory. (A down kernel summing a token's experts itself would save the top-k
# sum's launch but give each program top_k times the serial weight stream; one token's layer
# would then run on H / BLOCK_N programs.) Pairs that share an expert read its weights once
# each, so the sorted path wins once tokens share experts often; the tile tuner measures both.
# The weight tile is [BN, BK/2] bytes with K contiguous (rows of the checkpoint's layout), each
# scale group's partial sum is taken in fp32 and multiplied by its scale once.


@jit
def _w4_row_dots(w_ptrs, s_ptrs, wmask, smask, xe, xo, gscale, IS_NVFP4: tl.constexpr,
                 GROUP: tl.constexpr, USE_PTX: tl.constexpr):  # fmt: skip
    """[BN] fp32: each row of a [BN, BK/2] packed weight tile (scales [BN, BK/G]) dotted with the
    step's even and odd activations xe, xo [BK/2] (fp32)."""
    packed = tl.load(w_ptrs, mask=wmask, other=0)
    sbyte = tl.load(s_ptrs, mask=smask, other=0)
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
def _gemv_step(x_row, w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """One K step of a pair-major product: the activations' even and odd elements [BK/2] (fp32),
    pointers to the packed bytes [BN, BK/2] and scale bytes [BN, BK/G], and their masks."""
    kk = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
    xe, xo = tl.split(tl.reshape(x, [BLOCK_K // 2, 2]))
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
    return xe, xo, w_ptrs, s_ptrs, wmask, smask


@jit
def _gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    ids_ptr,  # [num_pairs] expert of each (token, k) pair: topk_ids flattened
    out_ptr,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    N: tl.constexpr,  # intermediate size I (w13 has 2N rows: gate then up)
    K: tl.constexpr,  # hidden size
    TOP_K: tl.constexpr,
    GROUP: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x_row = x_ptr + (pair // TOP_K) * stride_xt
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    g_gate = 1.0
    g_up = 1.0
    if IS_NVFP4:
        g_gate = tl.load(g_ptr + expert * 2)
        g_up = tl.load(g_ptr + expert * 2 + 1)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xe, xo, w_ptrs, s_ptrs, wmask, smask = _gemv_step(
            x_row, w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K, GROUP, BLOCK_K, EVEN_K
        )
        acc_g += _w4_row_dots(w_ptrs, s_ptrs, wmask, smask, xe, xo, g_gate, IS_NVFP4, GROUP,
                              USE_PTX)  # fmt: skip
        acc_u += _w4_row_dots(w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, wmask, smask, xe,
                              xo, g_up, IS_NVFP4, GROUP, USE_PTX)  # fmt: skip
    # Round each projection to the activation dtype first, as the unfused linear would.
    gate = acc_g.to(DT).to(tl.float32)
    up = acc_u.to(DT).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
    tl.store(out_ptr + pair * stride_ot + n, (act * up).to(DT), mask=nmask)


@jit
def _down_gemv_kernel(
    a_ptr,  # [num_pairs, K] from the gate_up kernel
    w_ptr,
    s_ptr,
    g_ptr,
    ids_ptr,
    rw_ptr,  # [num_pairs] fp32 routing weights
    out_ptr,  # [num_pairs, N]: each pair's output times its routing weight
    stride_at,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    N: tl.constexpr,  # hidden size
    K: tl.constexpr,  # intermediate size
    GROUP: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    DT: tl.constexpr = a_ptr.dtype.element_ty
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    gscale = 1.0
    if IS_NVFP4:
        gscale = tl.load(g_ptr + expert)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ae, ao, w_ptrs, s_ptrs, wmask, smask = _gemv_step(
            a_ptr + pair * stride_at, w_base, s_base, stride_wn, stride_sn, n, nmask, k0, K,
            GROUP, BLOCK_K, EVEN_K,
        )  # fmt: skip
        acc += _w4_row_dots(w_ptrs, s_ptrs, wmask, smask, ae, ao, gscale, IS_NVFP4, GROUP,
                            USE_PTX)  # fmt: skip
    # The sorted path's roundings: the expert's output, then times its routing weight, in DT.
    y = acc.to(DT).to(tl.float32) * tl.load(rw_ptr + pair)
    tl.store(out_ptr + pair * stride_ot + n, y.to(DT), mask=nmask)


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
) -> torch.Tensor:
    """fused_moe_w4a16 on the pair-major path (cfg.block_m == 1)."""
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[-1]
    inter = w13.shape[1] // 2
    _check_rows(x, "x", hidden)
    _check_w4("w13", w13, w13_scale, w13_global, fmt, hidden, 2 * inter, 2)
    _check_w4("w2", w2, w2_scale, w2_global, fmt, inter, hidden, 1)
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise _err(
            f"topk_weights must be fp32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
            f"{tuple(topk_weights.shape)}"
        )
    check_device(x)
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    ids = topk_ids.contiguous().view(-1)
    a = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    common = dict(GROUP=GROUP[fmt], IS_NVFP4=fmt == "nvfp4", BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  USE_PTX=_ptx_decode(cfg.block_n, cfg.block_k, cfg.num_warps))  # fmt: skip
    _gate_up_gemv_kernel[(num_tokens * top_k, -(-inter // cfg.block_n))](
        x, w13, w13_scale, w13_global, ids, a,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        a.stride(0), N=inter, K=hidden, TOP_K=top_k, EVEN_K=hidden % cfg.block_k == 0, **common,
    )  # fmt: skip
    _down_gemv_kernel[(num_tokens * top_k, -(-hidden // cfg.block_n))](
        a, w2, w2_scale, w2_global, ids, topk_weights.contiguous().view(-1), y,
        a.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        y.stride(0), N=hidden, K=inter, EVEN_K=inter % cfg.block_k == 0, **common,
    )  # fmt: skip
    return y.view(num_tokens, top_k, -1).sum(dim=1)  # as the sorted path: fp32 sum, one rounding


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
) -> torch.Tensor:  # [num_tokens, H]
    """The whole expert computation of one layer on 4-bit weights; no host synchronisation."""
    num_tokens, top_k = topk_ids.shape
    if config is None:
        shape = MoeShape(fmt, "w4a16", w13.shape[0], x.shape[-1], w13.shape[1] // 2, top_k)
        if shape in _TILE_TABLES:
            if torch.compiler.is_compiling():
                # The measured choice depends on the token count: picked at run time inside an
                # opaque op, so the trace is not specialised (and recompiled) per token bucket.
                return fused_moe_w4a16_measured(
                    x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights,
                    topk_ids, fmt,
                )  # fmt: skip
            config = tile_choice(shape, num_tokens)
    cfg = config or default_tile_config(num_tokens)
    if cfg.block_m == PAIR_MAJOR:
        return _fused_moe_w4a16_pairs(
            x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt,
            cfg,
        )  # fmt: skip
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    sorted_ids, expert_ids, npad = moe_align_block_size(topk_ids, w13.shape[0], cfg.block_m)
    inter = torch.empty(num_tokens * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    moe_w4a16_gate_up(
        x, w13, w13_scale, w13_global, sorted_ids, expert_ids, npad, inter, top_k, fmt, *tiles
    )
    y = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    moe_w4a16_down(
        inter, w2, w2_scale, w2_global, topk_weights, sorted_ids, expert_ids, npad, y, fmt, *tiles
    )
    return y.view(num_tokens, top_k, -1).sum(dim=1)  # torch accumulates the sum in fp32


# --------------------------------------------------------------------------------------------------
# W4A8: FP8 e4m3 activations against the same 4-bit weights (prefill rows, opt-in)
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


@dataclass(frozen=True)
class W4A8TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


W4A8_PREFILL_CONFIG = W4A8TileConfig(block_m=64, block_n=128, num_warps=8, num_stages=3)


# --------------------------------------------------------------------------------------------------
# Measured tile choices, installed by a higher layer (graphs/moe_tiles.py)
#
# Per layer shape, a config per token bucket (powers of two). A call with n tokens uses the choice of
# the smallest installed bucket >= n, or the largest bucket's above them all; a shape with nothing
# installed keeps the static table, and an explicit `config` wins over both. Lookups are a dict hit
# and a bisect (eagerly, or inside `fused_moe_w4a16_measured` under torch.compile).

ACTIVATIONS = ("w4a16", "w4a8")


class MoeShape(NamedTuple):
    """What a tile choice depends on besides the token count."""

    fmt: str  # "nvfp4" | "mxfp4"
    activations: str  # "w4a16" | "w4a8"
    num_experts: int
    hidden: int  # H: K of gate_up, N of down
    intermediate: int  # I: N of gate_up (per projection), K of down
    top_k: int


TileConfig = MoeTileConfig | W4A8TileConfig

_TILE_CHOICES: dict[MoeShape, dict[int, TileConfig]] = {}
# Derived from _TILE_CHOICES: shape -> (sorted buckets, their configs), for the bisect.
_TILE_TABLES: dict[MoeShape, tuple[tuple[int, ...], tuple[TileConfig, ...]]] = {}


def token_bucket(num_tokens: int) -> int:
    """The power of two a token count is tuned at: the smallest one >= num_tokens (1 for 0)."""
    if num_tokens < 0:
        raise _err(f"num_tokens must be >= 0, got {num_tokens}")
    return next_pow2(max(num_tokens, 1))


def check_tile_config(activations: str, config: TileConfig) -> None:
    """Raises MoeKernelError unless `config` is a valid tile config for these activations."""
    if activations not in ACTIVATIONS:
        raise _err(f"activations {activations!r} is not one of {', '.join(ACTIVATIONS)}")
    kind = MoeTileConfig if activations == "w4a16" else W4A8TileConfig
    if type(config) is not kind:
        raise _err(f"{activations} tiles need a {kind.__name__}, got {config!r}")
    for name, value in vars(config).items():
        if type(value) is not int or value < 1:
            raise _err(f"{name} must be a positive int, got {value!r}")
    powers = ("block_m", "block_n", "block_k", "num_warps")
    for name in (n for n in powers if hasattr(config, n)):
        value = getattr(config, name)
        if value & (value - 1):
            raise _err(f"{name} must be a power of two, got {value}")
    pair_major = isinstance(config, MoeTileConfig) and config.block_m == PAIR_MAJOR
    if config.block_m < 16 and not pair_major:
        raise _err(
            f"block_m must be >= 16 (tl.dot's minimum) or {PAIR_MAJOR} (W4A16 pair-major), "
            f"got {config.block_m}"
        )
    if isinstance(config, MoeTileConfig) and config.block_k < 32:
        raise _err(f"block_k must be >= 32, got {config.block_k}")


def install_tile_choice(shape: MoeShape, bucket: int, config: TileConfig) -> None:
    """From now on, calls of `shape` in `bucket`'s token range run `config` (see above)."""
    if not isinstance(shape, MoeShape):
        raise _err(f"shape must be a MoeShape, got {shape!r}")
    if shape.fmt not in FORMATS:
        raise _err(f"format {shape.fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    if bucket < 1 or bucket & (bucket - 1):
        raise _err(f"a token bucket is a power of two >= 1, got {bucket}")
    check_tile_config(shape.activations, config)
    choices = _TILE_CHOICES.setdefault(shape, {})
    choices[bucket] = config
    buckets = tuple(sorted(choices))
    _TILE_TABLES[shape] = (buckets, tuple(choices[b] for b in buckets))


def tile_choice(shape: MoeShape, num_tokens: int) -> TileConfig | None:
    """The installed choice for `num_tokens` rows of `shape`, or None (use the static table)."""
    table = _TILE_TABLES.get(shape)
    if table is None:
        return None
    buckets, configs = table
    return configs[min(bisect.bisect_left(buckets, num_tokens), len(configs) - 1)]


def installed_tile_choices() -> dict[MoeShape, dict[int, TileConfig]]:
    """A copy of every installed choice: shape -> bucket -> config."""
    return {shape: dict(choices) for shape, choices in _TILE_CHOICES.items()}


def clear_tile_choices() -> None:
    _TILE_CHOICES.clear()
    _TILE_TABLES.clear()


@torch.library.custom_op("libkk::fused_moe_w4a16_measured", mutates_args=())
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
) -> torch.Tensor:
    """`fused_moe_w4a16` with the installed tile choice for this call's token count, as one op
    that torch.compile does not look into."""
    return fused_moe_w4a16(
        x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt
    )


@fused_moe_w4a16_measured.register_fake
def _(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt):
    return x.new_empty(x.shape[0], w2.shape[1])


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
    g_gate = 1.0
    g_up = 1.0
    if IS_NVFP4:
        g_gate = tl.load(g_ptr + expert * 2)
        g_up = tl.load(g_ptr + expert * 2 + 1)
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
    gscale = 1.0
    if IS_NVFP4:
        gscale = tl.load(g_ptr + expert)
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


@torch.library.custom_op("libkk::moe_w4a8_gate_up", mutates_args=("out",))
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


@torch.library.custom_op("libkk::moe_w4a8_down", mutates_args=("out",))
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
) -> None:  # fmt: skip
    """Torch reference of `moe_w4a16_gate_up` on the dequantized weights."""
    num_pairs = out.shape[0]
    inter = w13.shape[1] // 2
    expert = _expert_of_pairs(sorted_ids, expert_ids, num_pairs, block_m)
    for e in expert.unique().tolist():
        if e < 0:
            continue
        pairs = torch.nonzero(expert == e).flatten().to(x.device)
        w = dequantize_w4_ref(w13[e : e + 1], w13_scale[e : e + 1], w13_global[e : e + 1], fmt,
                              x.dtype)[0]  # fmt: skip
        h = torch.nn.functional.linear(x[pairs // top_k], w)  # [count, 2I]
        gate, up = h[:, :inter], h[:, inter:]
        out[pairs] = torch.nn.functional.silu(gate) * up


def moe_w4a16_down_ref(
    a, w2, w2_scale, w2_global, topk_weights, sorted_ids, expert_ids, num_post_pad, out,
    fmt, block_m, block_n=0, block_k=0, num_warps=0, num_stages=0,
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
        y = torch.nn.functional.linear(a[pairs], w)
        out[pairs] = (y.float() * rw[pairs, None]).to(out.dtype)


def fused_moe_w4a16_ref(
    x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights, topk_ids, fmt,
    config: MoeTileConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """Torch reference of `fused_moe_w4a16`: dequantize, then the plain per-expert MLP loop."""
    num_tokens, top_k = topk_ids.shape
    w13_d = dequantize_w4_ref(w13, w13_scale, w13_global, fmt, x.dtype)
    w2_d = dequantize_w4_ref(w2, w2_scale, w2_global, fmt, x.dtype)
    inter = w13.shape[1] // 2
    y = torch.zeros(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    flat = topk_ids.reshape(-1).long()
    rw = topk_weights.reshape(-1)
    for e in flat.unique().tolist():
        pairs = torch.nonzero(flat == e).flatten()
        h = torch.nn.functional.linear(x[pairs // top_k], w13_d[e])
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        yy = torch.nn.functional.linear(act, w2_d[e])
        y[pairs] = (yy.float() * rw[pairs, None]).to(x.dtype)
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
