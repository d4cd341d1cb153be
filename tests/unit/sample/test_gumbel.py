"""Keyed noise: a pure function of (seed, position, token id), well mixed and uniform."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from chi2 import chi2_critical

from libkk.sample.gumbel import (
    DRAFT_POSITION_SALT,
    gumbel_argmax,
    gumbel_argmax_at,
    gumbel_noise,
    keyed_uniform,
    keyed_uniform_at,
)


def chi2_uniform(samples: torch.Tensor, bins: int) -> float:
    counts = torch.bincount((samples * bins).long().clamp(max=bins - 1), minlength=bins).double()
    expected = samples.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


# A plain-Python murmur3_32 (Austin Appleby, public domain): the definition the tensors implement.
def murmur3_32(data: bytes, seed: int) -> int:
    m = 0xFFFFFFFF
    h = seed
    for i in range(0, len(data) - len(data) % 4, 4):
        k = struct.unpack_from("<I", data, i)[0]
        k = (k * 0xCC9E2D51) & m
        k = ((k << 15) | (k >> 17)) & m
        k = (k * 0x1B873593) & m
        h ^= k
        h = ((h << 13) | (h >> 19)) & m
        h = (h * 5 + 0xE6546B64) & m
    assert len(data) % 4 == 0  # the keyed noise only hashes whole 32-bit words
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def reference_uniform(seed: int, position: int, token_id: int) -> float:
    h = murmur3_32(struct.pack("<qII", seed, position, token_id), 0x6C6B6B31)
    return ((h >> 8) | 1) * 2.0**-24


SEEDS = [0, 1, -1, 42, 2**32, -(2**32), 2**63 - 1, -(2**63) + 1, 123456789012345678]


def _rows(seeds: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(seeds, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)


def test_murmur3_reference_vectors() -> None:
    # Published murmur3_32 test vectors, so the reference below is the real murmur3.
    assert murmur3_32(b"", 0) == 0
    assert murmur3_32(b"", 1) == 0x514E28B7
    assert murmur3_32(b"test", 0) == 0xBA6BD213


def test_matches_reference_hash_bit_for_bit() -> None:
    positions = [0, 1, 17, 4095, DRAFT_POSITION_SALT + 3, 2**31 + 5, 2**32 - 1, 9, 77]
    seeds, pos = _rows(SEEDS, positions)
    u = keyed_uniform(seeds, pos, 70)  # [9, 70]
    for r, (s, p) in enumerate(zip(SEEDS, positions, strict=True)):
        for t in range(70):
            assert u[r, t].item() == reference_uniform(s, p, t), (s, p, t)


def test_range_and_dtype() -> None:
    seeds, pos = _rows(SEEDS, list(range(len(SEEDS))))
    u = keyed_uniform(seeds, pos, 50_000)
    assert u.dtype == torch.float32 and u.shape == (len(SEEDS), 50_000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    # Odd multiples of 2**-24: exact in fp32, never 0 or 1.
    scaled = u.double() * 2**24
    assert bool((scaled == scaled.round()).all()) and bool((scaled.long() % 2 == 1).all())
    g = gumbel_noise(seeds, pos, 50_000)
    assert bool(torch.isfinite(g).all())
    assert torch.equal(g, -torch.log(-torch.log1p(-u)))


def test_deterministic_and_independent_of_batch() -> None:
    seeds, pos = _rows(SEEDS, [3, 1, 4, 1, 5, 9, 2, 6, 5])
    full = keyed_uniform(seeds, pos, 1000)
    assert torch.equal(full, keyed_uniform(seeds, pos, 1000))
    perm = torch.randperm(len(SEEDS), generator=torch.Generator().manual_seed(0))
    assert torch.equal(keyed_uniform(seeds[perm], pos[perm], 1000), full[perm])
    for r in range(len(SEEDS)):
        assert torch.equal(keyed_uniform(seeds[r : r + 1], pos[r : r + 1], 1000), full[r : r + 1])
    # A wider vocab does not change the noise of the first token ids.
    assert torch.equal(keyed_uniform(seeds, pos, 3000)[:, :1000], full)


def test_blocked_computation_matches_rowwise() -> None:
    # Enough rows that the CPU path computes in several blocks.
    n = 70
    seeds = torch.arange(n, dtype=torch.int64) * 7919 - 100
    pos = torch.arange(n, dtype=torch.int64)
    big = keyed_uniform(seeds, pos, 49_152)
    for r in (0, 20, 21, 42, 69):
        assert torch.equal(big[r], keyed_uniform(seeds[r : r + 1], pos[r : r + 1], 49_152)[0])


def test_different_keys_give_unrelated_noise() -> None:
    v = 100_000
    base_seed, base_pos = 1234, 50
    variants = [
        (base_seed + 1, base_pos),
        (base_seed + 2**32, base_pos),  # differs only in the high half
        (-base_seed, base_pos),
        (base_seed, base_pos + 1),
        (base_seed, base_pos + DRAFT_POSITION_SALT),  # the draft stream
    ]
    seeds, pos = _rows(
        [base_seed] + [s for s, _ in variants], [base_pos] + [p for _, p in variants]
    )
    u = keyed_uniform(seeds, pos, v).double()  # [6, V]
    for r in range(1, u.shape[0]):
        # Equal values happen with probability 2**-23 each; a related stream shows many.
        assert int((u[r] == u[0]).sum()) <= 2
        corr = torch.corrcoef(torch.stack([u[0], u[r]]))[0, 1].item()
        assert abs(corr) < 4.0 / math.sqrt(v), (r, corr)
    # Neighbouring token ids in one row are unrelated too.
    lag = torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1].item()
    assert abs(lag) < 4.0 / math.sqrt(v)


def test_uniformity() -> None:
    seeds = torch.arange(64, dtype=torch.int64) * 1_000_003 - 2**40
    pos = torch.arange(64, dtype=torch.int64) * 3
    u = keyed_uniform(seeds, pos, 16_384).flatten().double()  # 1M draws
    n = u.numel()
    # Kolmogorov-Smirnov: critical value 1.9495 / sqrt(n) at alpha = 1e-3.
    sorted_u = u.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = max((grid - sorted_u).max().item(), (sorted_u - (grid - 1.0 / n)).max().item())
    assert d < 1.9495 / math.sqrt(n)
    assert chi2_uniform(u, 1000) < chi2_critical(999)
    # Pairs of neighbouring tokens fill the unit square evenly (16 x 16 cells).
    a, b = u[0::2], u[1::2]
    cells = (a * 16).long() * 16 + (b * 16).long()
    counts = torch.bincount(cells, minlength=256).double()
    expected = cells.numel() / 256
    assert float(((counts - expected) ** 2 / expected).sum()) < chi2_critical(255)
    # Each hashed bit is balanced.
    bits = (u * 2**24).long()
    for k in range(1, 24):  # bit 0 is the forced 1
        ones = int(((bits >> k) & 1).sum())
        assert abs(ones - n / 2) < 3.3 * math.sqrt(n / 4), k


def test_uniformity_across_seeds_and_positions_for_one_token() -> None:
    # The noise of one token id across many (seed, position) keys: what sampling consumes.
    seeds = torch.arange(100_000, dtype=torch.int64) // 100
    pos = torch.arange(100_000, dtype=torch.int64) % 100
    u = keyed_uniform_at(seeds, pos, torch.full_like(seeds, 7)).double()
    assert chi2_uniform(u, 200) < chi2_critical(199)


def test_gumbel_moments() -> None:
    seeds, pos = _rows([5, 6, 7, 8], [0, 0, 1, 1])
    g = gumbel_noise(seeds, pos, 250_000).double()
    euler_gamma = 0.5772156649
    assert abs(g.mean().item() - euler_gamma) < 0.01
    assert abs(g.var().item() - math.pi**2 / 6) < 0.02


def test_keyed_uniform_at_matches_full_rows() -> None:
    seeds, pos = _rows(SEEDS, [0, 5, 2**20, 7, 11, DRAFT_POSITION_SALT, 1, 2, 3])
    full = keyed_uniform(seeds, pos, 5000)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        tokens = torch.randint(0, 5000, (len(SEEDS),), generator=gen)
        at = keyed_uniform_at(seeds, pos, tokens)
        assert torch.equal(at, full.gather(1, tokens[:, None])[:, 0])


def test_keyed_uniform_at_takes_candidate_lists() -> None:
    seeds, pos = _rows(SEEDS, [4] * len(SEEDS))
    full = keyed_uniform(seeds, pos, 2000)
    tokens = torch.randint(0, 2000, (len(SEEDS), 37), generator=torch.Generator().manual_seed(4))
    assert torch.equal(keyed_uniform_at(seeds, pos, tokens), full.gather(1, tokens))


def test_gumbel_argmax_at_equals_full_rows_when_the_rest_is_excluded() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab, k = 3000, 64
    logits = torch.randn(50, vocab, generator=gen)
    seeds = torch.randint(-(2**40), 2**40, (50,), generator=gen)
    pos = torch.randint(0, 1000, (50,), generator=gen)
    cand = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(50)])  # [R, K]
    masked = torch.full_like(logits, -math.inf).scatter(1, cand, logits.gather(1, cand))
    want = gumbel_argmax(masked, seeds, pos)
    assert torch.equal(gumbel_argmax_at(logits.gather(1, cand), cand, seeds, pos), want)
    # Exact ties in logits + noise go to the lowest id, as argmax over the full row does.
    same = torch.tensor([[5, 9, 2]])
    one = torch.tensor([7])
    tied = gumbel_argmax_at(torch.full((1, 3), -math.inf), same, one, one)
    assert tied.tolist() == [2]


def test_gumbel_argmax_equals_explicit_noise() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 30_000, generator=gen) * 2
    logits[:, 100:200] = -math.inf
    seeds = torch.randint(-(2**62), 2**62, (40,), generator=gen)
    pos = torch.randint(0, 10_000, (40,), generator=gen)
    expected = (logits + gumbel_noise(seeds, pos, 30_000)).argmax(dim=-1)
    tokens = gumbel_argmax(logits, seeds, pos)
    assert torch.equal(tokens, expected)
    assert not bool(((tokens >= 100) & (tokens < 200)).any())
    assert torch.equal(
        gumbel_argmax(logits.bfloat16(), seeds, pos),
        gumbel_argmax(logits.bfloat16().float(), seeds, pos),
    )


def test_rejects_bad_inputs() -> None:
    with pytest.raises(TypeError):
        keyed_uniform(torch.tensor([1], dtype=torch.int32), torch.tensor([0]), 10)
    with pytest.raises(ValueError):
        keyed_uniform(torch.tensor([1, 2]), torch.tensor([0]), 10)
    with pytest.raises(ValueError):
        keyed_uniform_at(torch.tensor([1]), torch.tensor([0]), torch.tensor([1, 2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    seeds = torch.randint(-(2**63), 2**63 - 1, (33,), generator=gen)
    pos = torch.randint(0, 2**31, (33,), generator=gen)
    cpu = keyed_uniform(seeds, pos, 151_936)
    gpu = keyed_uniform(seeds.cuda(), pos.cuda(), 151_936)
    assert torch.equal(cpu, gpu.cpu())
    tokens = torch.randint(0, 151_936, (33,), generator=gen)
    assert torch.equal(
        keyed_uniform_at(seeds, pos, tokens),
        keyed_uniform_at(seeds.cuda(), pos.cuda(), tokens.cuda()).cpu(),
    )
