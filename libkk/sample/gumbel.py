"""Keyed Gumbel noise: sampling randomness as a pure function of (seed, position, token id).

The noise for token `t` at position `pos` of a request with seed `s` is

    h = murmur3_32(seed=0x6C6B6B31, data=le32(s_lo) le32(s_hi) le32(pos) le32(t))  # 16 bytes
    u = ((h >> 8) | 1) * 2**-24     # odd multiples of 2**-24 in (0, 1), exact in fp32
    g = -log(-log1p(-u))            # fp32

(s_lo, s_hi: the two 32-bit halves of the two's complement seed; pos and t below 2**32.)

so a request's tokens do not depend on the batch it runs in, on chunking or on graph capture, and
speculative drafts can re-derive the exact noise of any (position, token). The hash is computed
with int64 torch ops on values kept in [0, 2**32): every product is split so that it stays below
2**49, so nothing ever overflows and CPU and CUDA give bit-identical `u`. (`g` goes through the
device's log/log1p, which may differ in the last ulp between CPU and CUDA.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from libkk.kernels.sampling import gumbel_argmax as fused_gumbel_argmax
from libkk.kernels.sampling import keyed_uniform_at as fused_keyed_uniform_at

# The draft stream adds this to positions so a draft never shares noise with the target at the
# same position (positions stay far below it).
DRAFT_POSITION_SALT = 2**30

_M32 = 0xFFFFFFFF
_HASH_SEED = 0x6C6B6B31  # murmur3 seed; any fixed constant, changing it changes every sample
_C1 = 0xCC9E2D51  # murmur3_32 block constants
_C2 = 0x1B873593
_MESSAGE_BYTES = 16  # seed_lo, seed_hi, position, token id
_CPU_BLOCK_ELEMS = 1 << 20


def _mul32_(x: Tensor, c: int) -> Tensor:
    """x = x * c mod 2**32, in place, for x in [0, 2**32) and a 32-bit constant c.

    NOTE: x * c could reach 2**64 and wrap int64; splitting c into 16-bit halves keeps every
    intermediate below 2**49: x*c mod 2**32 = (x*c_lo + ((x*c_hi) mod 2**16) << 16) mod 2**32.
    """
    hi = x * (c >> 16)
    hi.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(hi).bitwise_and_(_M32)


def _rotl32(x: Tensor, r: int) -> Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _mix_block(k: Tensor) -> Tensor:
    """murmur3's per-block scramble of a 32-bit word (new tensor)."""
    k = _mul32_(k.clone(), _C1)
    return _mul32_(_rotl32(k, 15), _C2)


def _absorb(h: Tensor, k: Tensor) -> Tensor:
    """One murmur3 body round: fold block k into state h (new tensor)."""
    h = _rotl32(h ^ _mix_block(k), 13)
    return h.mul_(5).add_(0xE6546B64).bitwise_and_(_M32)


def _fmix32_(h: Tensor) -> Tensor:
    """murmur3's finalizer, in place: full avalanche of a 32-bit word."""
    h.bitwise_xor_(h >> 16)
    _mul32_(h, 0x85EBCA6B)
    h.bitwise_xor_(h >> 13)
    _mul32_(h, 0xC2B2AE35)
    return h.bitwise_xor_(h >> 16)


def _check_keys(seeds: Tensor, positions: Tensor) -> None:
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise TypeError(f"seeds and positions must be int64, got {seeds.dtype}, {positions.dtype}")
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(
            f"seeds {tuple(seeds.shape)} and positions {tuple(positions.shape)} must both be [R]"
        )


def _row_state(seeds: Tensor, positions: Tensor) -> Tensor:
    """murmur3 state after the first three blocks (seed low, seed high, position). [R]"""
    _check_keys(seeds, positions)
    # NOTE: `>>` on a negative int64 is arithmetic; masking after the shift gives the two's
    # complement high word, so both halves of a signed 64-bit seed are mixed.
    seed_lo = seeds & _M32
    seed_hi = (seeds >> 32) & _M32
    h = torch.full_like(seeds, _HASH_SEED)
    h = _absorb(h, seed_lo)
    h = _absorb(h, seed_hi)
    return _absorb(h, positions & _M32)


def _finish(row_state: Tensor, token_ids: Tensor) -> Tensor:
    """Absorb the token block, finalize, map to fp32 u in (0, 1). Shapes broadcast."""
    # rotl distributes over xor, so the rotation is done on the small row / token operands.
    h = _rotl32(row_state, 13) ^ _rotl32(_mix_block(token_ids & _M32), 13)  # [R, V] or [R]
    h.mul_(5).add_(0xE6546B64).bitwise_and_(_M32)
    h.bitwise_xor_(_MESSAGE_BYTES)
    _fmix32_(h)
    # Top 24 bits with the lowest forced to 1: an odd integer below 2**24 times 2**-24 is exact in
    # fp32 and never 0 or 1.
    h.bitwise_right_shift_(8).bitwise_or_(1)
    return h.to(torch.float32).mul_(2.0**-24)


def _chunk_rows(num_rows: int, vocab_size: int, device: torch.device) -> int:
    # NOTE: the hash is ~25 elementwise int64 passes; on CPU, blocks of ~1M elements keep the
    # intermediates cache-resident (about 2x faster at [64, 49152]). One launch per op on GPUs.
    if device.type != "cpu":
        return max(num_rows, 1)
    return max(1, _CPU_BLOCK_ELEMS // max(vocab_size, 1))


def keyed_uniform(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Uniform noise in (0, 1) for every token id of every row.  # [R, V] float32

    seeds: [R] int64 (any 64-bit signed value); positions: [R] int64 in [0, 2**32).
    """
    state = _row_state(seeds, positions)  # [R]
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    out = torch.empty(state.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    step = _chunk_rows(state.shape[0], vocab_size, seeds.device)
    for i in range(0, state.shape[0], step):
        out[i : i + step] = _finish(state[i : i + step, None], token_ids[None, :])
    return out


def keyed_uniform_at(seeds: Tensor, positions: Tensor, token_ids: Tensor) -> Tensor:
    """keyed_uniform(seeds, positions, V)[r, token_ids[r]] without the full rows.

    token_ids: [R] or [R, K] int64; the result has the same shape (float32). CUDA tensors go
    through the fused kernel (libkk.kernels.sampling), others through the torch hash.
    """
    if (
        token_ids.dtype != torch.int64
        or token_ids.dim() not in (1, 2)
        or (token_ids.shape[0] != seeds.shape[0])
    ):
        raise ValueError(
            f"token_ids must be int64 of shape [{seeds.shape[0]}] or [{seeds.shape[0]}, K], "
            f"got {token_ids.dtype} {tuple(token_ids.shape)}"
        )
    if token_ids.is_cuda:  # one fused launch
        _check_keys(seeds, positions)
        shape = token_ids.shape
        if token_ids.dim() == 2:
            seeds = seeds[:, None].expand(shape)
            positions = positions[:, None].expand(shape)
        flat = (seeds.reshape(-1), positions.reshape(-1), token_ids.reshape(-1))
        return fused_keyed_uniform_at(*flat).view(shape)
    state = _row_state(seeds, positions)  # [R]
    return _finish(state if token_ids.dim() == 1 else state[:, None], token_ids)


def uniform_to_gumbel_(u: Tensor) -> Tensor:
    """g = -log(-log1p(-u)), in place on fp32 u in (0, 1)."""
    return u.neg_().log1p_().neg_().log_().neg_()


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise keyed by (seed, position, token id).  # [R, V] float32"""
    return uniform_to_gumbel_(keyed_uniform(seeds, positions, vocab_size))


def gumbel_argmax(logits: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """argmax(logits + gumbel_noise(seeds, positions, V)) per row, ties to the lowest id.  # [R]

    A sample from softmax(logits); -inf logits are never chosen (unless a row is all -inf: then
    token 0). CUDA logits go through the fused kernel (libkk.kernels.sampling: hash, noise and
    argmax in one pass over the logits), others through the torch reference.
    """
    if logits.is_cuda:
        return fused_gumbel_argmax(logits, seeds, positions)
    return gumbel_argmax_ref(logits, seeds, positions)


def gumbel_argmax_ref(logits: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """Torch reference of gumbel_argmax (any device).  # [R]

    Same result as materializing the noise, computed block by block without the [R, V] copy.
    """
    num_rows, vocab_size = logits.shape
    state = _row_state(seeds, positions)  # [R]
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=logits.device)  # [V]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    step = _chunk_rows(num_rows, vocab_size, logits.device)
    for i in range(0, num_rows, step):
        g = uniform_to_gumbel_(_finish(state[i : i + step, None], token_ids[None, :]))
        out[i : i + step] = g.add_(logits[i : i + step].float()).argmax(dim=-1)
    return out


def gumbel_argmax_at(logits: Tensor, token_ids: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """gumbel_argmax restricted to K candidate tokens per row.  # [R]

    logits [R, K] are the logits of token_ids [R, K] (-inf: excluded). When every token outside
    the candidates is excluded this equals gumbel_argmax on the full rows, ties included (the
    lowest token id wins), at the cost of K hashes per row instead of V.
    """
    score = uniform_to_gumbel_(keyed_uniform_at(seeds, positions, token_ids))  # [R, K]
    score.add_(logits.float())
    best = score.amax(dim=-1, keepdim=True)  # [R, 1]
    return torch.where(score == best, token_ids, torch.iinfo(torch.int64).max).amin(dim=-1)
