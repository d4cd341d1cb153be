"""gumbel_argmax: per row, argmax over token ids of logits + keyed Gumbel noise, in one pass.

The noise is libkk.sample.gumbel's (that module holds the torch reference, `gumbel_argmax_ref`;
kernels cannot import it): for row r and token t

    h = murmur3_32(seed=0x6C6B6B31, data=le32(seed_lo) le32(seed_hi) le32(pos) le32(t))
    u = ((h >> 8) | 1) * 2**-24,  g = -log(-log1p(-u))    (fp32)

The hash runs in uint32, whose multiply wraps mod 2**32 exactly as murmur3 wants, so `u` is
bit-identical to the reference's. On the GPU `log1p` and `log` are libdevice's, the functions
torch's CUDA kernels call, so `g` matches too; under Triton's interpreter they are numpy's and may
differ in the last ulp (1 - u is exact in fp32, so log(1 - u) stands in for log1p(-u)).

Ordering follows torch.argmax: NaN scores win (the first NaN), then the lowest token id among
equal maxima; -inf logits lose to any finite score and an all -inf row gives token 0.

Two launches, no atomics: a row's vocabulary is split into chunks (one program per row x chunk,
so a single row still spreads over the GPU), each writes its best score and first id, and a tiny
second kernel reduces each row's chunks in id order.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton.language.extra import libdevice

from ._jit import INTERPRETED, check_device, device_parallelism, jit, kernel_op, next_pow2

# murmur3_32 constants (the seed is libkk's; changing any of them changes every sample).
_HASH_SEED = tl.constexpr(0x6C6B6B31)
_C1 = tl.constexpr(0xCC9E2D51)
_C2 = tl.constexpr(0x1B873593)
_ROUND_ADD = tl.constexpr(0xE6546B64)
_FMIX1 = tl.constexpr(0x85EBCA6B)
_FMIX2 = tl.constexpr(0xC2B2AE35)
_MESSAGE_BYTES = tl.constexpr(16)  # seed_lo, seed_hi, position, token id
_NO_ID = tl.constexpr(2**31 - 1)  # above every token id: "no candidate"

# Chunk size bounds: at least ~4 programs per multiprocessor, without tiny chunks.
_MIN_BLOCK = 1024
_MAX_BLOCK = 8192
_PROGRAMS_PER_SM = 4


@jit
def _mix_block(k):
    """murmur3's per-block scramble of a uint32 word."""
    k = k * _C1
    k = (k << 15) | (k >> 17)
    return k * _C2


@jit
def _absorb(h, k):
    """One murmur3 body round: fold uint32 block k into state h."""
    h = h ^ _mix_block(k)
    h = (h << 13) | (h >> 19)
    return h * 5 + _ROUND_ADD


@jit
def _keyed_uniform(seed, position, ids):
    """u in (0, 1), fp32, for int64 scalars seed / position and int32 token ids."""
    # NOTE: int64 -> uint32 truncates, i.e. keeps the low word of the two's complement value;
    # `>>` on int64 is arithmetic, so the high word of a negative seed comes out right too.
    h = tl.full((), _HASH_SEED, tl.uint32)
    h = _absorb(h, seed.to(tl.uint32))
    h = _absorb(h, (seed >> 32).to(tl.uint32))
    h = _absorb(h, position.to(tl.uint32))
    h = _absorb(h, ids.to(tl.uint32))
    h = h ^ _MESSAGE_BYTES
    h = h ^ (h >> 16)
    h = h * _FMIX1
    h = h ^ (h >> 13)
    h = h * _FMIX2
    h = h ^ (h >> 16)
    # An odd integer below 2**24 times 2**-24: exact in fp32, never 0 or 1.
    return ((h >> 8) | 1).to(tl.float32) * (2.0**-24)


@jit
def _gumbel(u, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return -libdevice.log(-libdevice.log1p(-u))
    return -tl.log(-tl.log(1.0 - u))


@jit
def _first_max(score, ids, valid):
    """(best score, its lowest id) over the valid lanes, in torch.argmax's order (NaN first)."""
    is_nan = score != score
    clean = tl.where(valid & ~is_nan, score, float("-inf"))
    best = tl.max(clean, axis=0)
    first = tl.min(tl.where(valid & (clean == best), ids, _NO_ID), axis=0)
    first_nan = tl.min(tl.where(valid & is_nan, ids, _NO_ID), axis=0)
    has_nan = first_nan < _NO_ID
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first)


@jit
def _chunk_kernel(
    logits_ptr,
    seeds_ptr,
    positions_ptr,
    best_ptr,  # [R, num_chunks] fp32
    first_ptr,  # [R, num_chunks] int64
    stride_row,
    vocab_size,
    num_chunks,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)  # int32: vocab_size < 2**31
    valid = ids < vocab_size
    logits = tl.load(logits_ptr + row * stride_row + ids, mask=valid, other=float("-inf"))
    u = _keyed_uniform(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), ids)
    score = logits.to(tl.float32) + _gumbel(u, LIBDEVICE)
    best, first = _first_max(score, ids, valid)
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(first_ptr + row * num_chunks + chunk, first.to(tl.int64))


@jit
def _reduce_kernel(best_ptr, first_ptr, out_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    valid = c < num_chunks
    best = tl.load(best_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
    first = tl.load(first_ptr + row * num_chunks + c, mask=valid, other=_NO_ID)
    # Chunks are in id order and carry their own first ids: the lowest id still wins ties.
    _, winner = _first_max(best, first, valid)
    tl.store(out_ptr + row, winner)


@jit
def _uniform_kernel(seeds_ptr, positions_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = _keyed_uniform(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), ids)
    tl.store(out_ptr + row * vocab_size + ids, u, mask=ids < vocab_size)


@jit
def _uniform_at_kernel(seeds_ptr, positions_ptr, ids_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    seed = tl.load(seeds_ptr + i, mask=m, other=0)
    position = tl.load(positions_ptr + i, mask=m, other=0)
    ids = tl.load(ids_ptr + i, mask=m, other=0)
    tl.store(out_ptr + i, _keyed_uniform(seed, position, ids), mask=m)


def default_block_size(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Chunk length: enough programs to fill the device, from shapes only (graph-safe)."""
    want = -(-num_rows * vocab_size // (_PROGRAMS_PER_SM * device_parallelism(device)))
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, next_pow2(want)))
    return min(block, max(16, next_pow2(vocab_size)))


def _check_vocab(vocab_size: int) -> None:
    if not 0 < vocab_size < 2**31:
        raise ValueError(f"vocab size must lie in [1, 2**31), got {vocab_size}")


def _check_keys(seeds: torch.Tensor, positions: torch.Tensor, num_rows: int) -> None:
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.dtype != torch.int64 or t.shape != (num_rows,):
            raise ValueError(f"{name} must be int64 [{num_rows}], got {t.dtype} {tuple(t.shape)}")
    if seeds.device != positions.device:
        raise ValueError(f"seeds are on {seeds.device}, positions on {positions.device}")


def _check(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, block: int) -> None:
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"logits must be a floating [rows, vocab] tensor, got {logits.dtype} "
            f"{tuple(logits.shape)}"
        )
    _check_vocab(logits.shape[1])
    _check_keys(seeds, positions, logits.shape[0])
    if seeds.device != logits.device:
        raise ValueError(f"seeds and positions are on {seeds.device}, logits on {logits.device}")
    if block != 0 and (block < 16 or block & (block - 1)):
        raise ValueError(f"block_size must be 0 (auto) or a power of two >= 16, got {block}")


def gumbel_argmax(
    logits: torch.Tensor,  # [R, V] fp32 / bf16 / fp16 / fp64
    seeds: torch.Tensor,  # [R] int64, any 64-bit value
    positions: torch.Tensor,  # [R] int64 in [0, 2**32)
    block_size: int = 0,  # vocab chunk per program, a power of two; 0 picks one from the shapes
) -> torch.Tensor:
    """argmax(logits + keyed Gumbel noise) per row, ties to the lowest id.  # [R] int64"""
    # NOTE: the custom op's dispatch costs about as much host time as both launches (~25 us per
    # call on an H200 host, where one row's kernels take ~5 us of GPU time): eager calls go
    # straight to the launches; traced code (torch.compile) needs the op.
    if torch.compiler.is_compiling():
        return _gumbel_argmax_op(logits, seeds, positions, block_size)
    return _launch_gumbel_argmax(logits, seeds, positions, block_size)


def _launch_gumbel_argmax(
    logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    _check(logits, seeds, positions, block_size)
    check_device(logits)
    num_rows, vocab_size = logits.shape
    dev = logits.device
    out = torch.empty(num_rows, dtype=torch.int64, device=dev)
    if num_rows == 0:
        return out
    block = block_size or default_block_size(num_rows, vocab_size, dev)
    num_chunks = -(-vocab_size // block)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    best = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=dev)
    first = out.view(num_rows, 1) if num_chunks == 1 else torch.empty_like(best, dtype=torch.int64)
    _chunk_kernel[(num_rows, num_chunks)](
        logits,
        seeds.contiguous(),  # the kernels index keys with unit stride (an expand()ed view is not)
        positions.contiguous(),
        best,
        first,
        logits.stride(0),
        vocab_size,
        num_chunks,
        BLOCK=block,
        LIBDEVICE=not INTERPRETED,
        num_warps=max(4, min(8, block // 512)),
    )
    if num_chunks > 1:
        _reduce_kernel[(num_rows,)](
            best, first, out, num_chunks, CHUNKS_PAD=next_pow2(num_chunks), num_warps=1
        )
    return out


@kernel_op("libkk::gumbel_argmax", mutates_args=())
def _gumbel_argmax_op(
    logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, block_size: int = 0
) -> torch.Tensor:
    return _launch_gumbel_argmax(logits, seeds, positions, block_size)


@_gumbel_argmax_op.register_fake
def _(logits, seeds, positions, block_size=0):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@kernel_op("libkk::keyed_uniform", mutates_args=())
def keyed_uniform(
    seeds: torch.Tensor,  # [R] int64
    positions: torch.Tensor,  # [R] int64 in [0, 2**32)
    vocab_size: int,
) -> torch.Tensor:
    """The noise's uniforms u for every token id of every row.  # [R, V] fp32

    Bit-identical to libkk.sample.gumbel.keyed_uniform; gumbel_argmax never materializes them.
    """
    _check_vocab(vocab_size)
    if seeds.dim() != 1:
        raise ValueError(f"seeds must be [R], got {tuple(seeds.shape)}")
    _check_keys(seeds, positions, seeds.shape[0])
    check_device(seeds)
    num_rows = seeds.shape[0]
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=seeds.device)
    if num_rows:
        block = min(_MAX_BLOCK, max(16, next_pow2(vocab_size)))
        _uniform_kernel[(num_rows, -(-vocab_size // block))](
            seeds.contiguous(), positions.contiguous(), out, vocab_size, BLOCK=block, num_warps=4
        )
    return out


@keyed_uniform.register_fake
def _(seeds, positions, vocab_size):
    return seeds.new_empty(seeds.shape[0], vocab_size, dtype=torch.float32)


_AT_BLOCK = 256


@kernel_op("libkk::keyed_uniform_at", mutates_args=())
def keyed_uniform_at(
    seeds: torch.Tensor,  # [N] int64
    positions: torch.Tensor,  # [N] int64 in [0, 2**32)
    token_ids: torch.Tensor,  # [N] int64 in [0, 2**32)
) -> torch.Tensor:
    """The uniform u of each (seed, position, token id) triple.  # [N] fp32

    Bit-identical to libkk.sample.gumbel.keyed_uniform_at: one launch where the torch hash runs
    some forty elementwise ops (acceptance uniforms of every verification with sampled rows)."""
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        raise ValueError(
            f"token_ids must be int64 [N], got {token_ids.dtype} {tuple(token_ids.shape)}"
        )
    _check_keys(seeds, positions, token_ids.shape[0])
    check_device(seeds)
    n = token_ids.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=seeds.device)
    if n:
        _uniform_at_kernel[(-(-n // _AT_BLOCK),)](
            seeds.contiguous(), positions.contiguous(), token_ids.contiguous(), out, n,
            BLOCK=_AT_BLOCK, num_warps=4,
        )  # fmt: skip
    return out


@keyed_uniform_at.register_fake
def _(seeds, positions, token_ids):
    return seeds.new_empty(token_ids.shape[0], dtype=torch.float32)
