"""Routing (top-k over router probabilities) and the alignment of (token, expert) pairs into expert
blocks for the sorted expert GEMMs."""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import check_device, jit, kernel_op, next_pow2, pdl_args, wait_for_previous
from .common import SCORING, _err

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
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
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


@kernel_op("libkk::moe_topk_routing", mutates_args=())
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
        **pdl_args(dev),
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
def _chunk_hits(ids_ptr, num_pairs, pid, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk `pid`'s pair indices [CHUNK] and which expert each pair picks [CHUNK, E_PAD]
    (0/1 int32; pairs past num_pairs pick none)."""
    p = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    return p, (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)


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
    p, hit = _chunk_hits(ids_ptr, num_pairs, pid, E_PAD, CHUNK)
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
    p, hit = _chunk_hits(ids_ptr, num_pairs, pid, E_PAD, CHUNK)
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


@kernel_op("libkk::moe_align_block_size", mutates_args=())
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


@jit
def _tile_pairs(sorted_ptr, expert_ptr, num_pairs, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert, its M tile of (token, expert) pair ids and their validity, and its
    N tile of output columns and their mask."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, pair, pair < num_pairs, n, n < N


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
