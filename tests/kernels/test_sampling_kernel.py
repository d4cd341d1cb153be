"""Fused keyed Gumbel sampling (Triton) against the torch reference of libkk.sample.gumbel.

The kernel's uniforms must be bit-identical to keyed_uniform's; its sampled tokens must equal
gumbel_argmax_ref's on random rows (a mismatch would need a tie within the last ulp of log), on
exact ties (lowest id), and on NaN / +-inf logits, for every logits dtype and chunking.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_env import DEVICE, RUNS_KERNELS
from libkk.kernels.sampling import (
    default_block_size,
    gumbel_argmax,
    keyed_uniform,
    keyed_uniform_at,
)

from libkk.sample import gumbel as reference

pytestmark = RUNS_KERNELS

# Both halves of 64-bit seeds (negative ones included) and positions up to 2**32 - 1.
EDGE_SEEDS = [0, 1, -1, -(2**63), 2**63 - 1, 0x1234_5678_9ABC_DEF0, -0x0F0F_0F0F_0F0F_0F0F, 42]
EDGE_POSITIONS = [0, 1, 2**32 - 1, 2**31, 2**30 + 7, 2**31 + 2**30, 99_999, 65_536]


def keys(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 64-bit seeds and 32-bit positions, the edge cases first."""
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**63), 2**63 - 1, (num_rows,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2**32, (num_rows,), generator=g, dtype=torch.int64)
    n = min(num_rows, len(EDGE_SEEDS))
    seeds[:n] = torch.tensor(EDGE_SEEDS[:n])
    positions[:n] = torch.tensor(EDGE_POSITIONS[:n])
    return seeds.to(DEVICE), positions.to(DEVICE)


def random_logits(num_rows: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, vocab, generator=g) * 3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("vocab", [1, 17, 1000, 3001])
def test_uniforms_bit_identical(vocab: int):
    seeds, positions = keys(12, seed=vocab)
    got = keyed_uniform(seeds, positions, vocab)
    assert torch.equal(got, reference.keyed_uniform(seeds, positions, vocab))


@pytest.mark.parametrize("n", [1, 7, 300])
def test_uniforms_at_tokens_bit_identical(n: int):
    """The fused per-triple uniforms equal the torch hash's, edge seeds and positions included,
    token ids up to 2**32 - 1; through the sampling module's entry for [R, K] ids too."""
    seeds, positions = keys(n, seed=n + 3)
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    ids[0] = 2**32 - 1
    ids = ids.to(DEVICE)
    want = reference.keyed_uniform_at(seeds.cpu(), positions.cpu(), ids.cpu())
    assert torch.equal(keyed_uniform_at(seeds, positions, ids).cpu(), want)
    # keys broadcast to every id (an expand()ed view, stride 0), as for [1, K] ids
    one = (seeds[:1].expand(n), positions[:1].expand(n))
    want_one = reference.keyed_uniform_at(*(k.cpu().contiguous() for k in one), ids.cpu())
    assert torch.equal(keyed_uniform_at(*one, ids).cpu(), want_one)
    grid = torch.randint(0, 50_000, (n, 5), generator=g, dtype=torch.int64).to(DEVICE)
    want = reference.keyed_uniform_at(seeds.cpu(), positions.cpu(), grid.cpu())
    assert torch.equal(reference.keyed_uniform_at(seeds, positions, grid).cpu(), want)
    with pytest.raises(ValueError, match="token_ids"):
        keyed_uniform_at(seeds, positions, ids.int())
    torch.library.opcheck(torch.ops.libkk.keyed_uniform_at.default, (seeds, positions, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 4999])
def test_matches_reference_on_random_rows(vocab: int, dtype: torch.dtype):
    seeds, positions = keys(48, seed=vocab)
    logits = random_logits(48, vocab, seed=vocab + 1, dtype=dtype)
    want = reference.gumbel_argmax_ref(logits, seeds, positions)
    assert torch.equal(gumbel_argmax(logits, seeds, positions), want)
    # Samples, not the argmax of the logits: the noise decides most rows.
    assert (want != logits.float().argmax(dim=-1)).sum() > 10


@pytest.mark.parametrize("block_size", [16, 64, 1024, 8192])
def test_any_chunking_gives_the_same_tokens(block_size: int):
    seeds, positions = keys(8, seed=3)
    logits = random_logits(8, 2500, seed=4)
    want = reference.gumbel_argmax_ref(logits, seeds, positions)
    assert torch.equal(gumbel_argmax(logits, seeds, positions, block_size), want)


def test_chunks_fill_the_device_and_stay_in_bounds():
    dev = torch.device(DEVICE)
    one_row = default_block_size(1, 151_936, dev)
    assert one_row < 151_936 // 8  # one row is split across many programs
    assert default_block_size(4096, 151_936, dev) <= 8192
    assert default_block_size(64, 10, dev) == 16  # never far beyond the vocabulary


def tie_pairs(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> list[tuple[int, int]]:
    """Per row, two token ids with bit-identical noise (u has 2**23 values: pairs are common)."""
    u = reference.keyed_uniform(seeds.cpu(), positions.cpu(), vocab)
    pairs = []
    for row in u:
        values, inverse, counts = torch.unique(row, return_inverse=True, return_counts=True)
        dup = int(torch.nonzero(counts > 1)[0, 0])
        ids = torch.nonzero(inverse == dup).flatten()
        pairs.append((int(ids[0]), int(ids[1])))
    return pairs


@pytest.mark.parametrize("block_size", [0, 64])
def test_exact_ties_go_to_the_lowest_id(block_size: int):
    vocab = 8192  # large enough that every row has a repeated u
    seeds, positions = keys(6, seed=11)
    pairs = tie_pairs(seeds, positions, vocab)
    logits = torch.full((6, vocab), -math.inf)
    for r, (a, b) in enumerate(pairs):
        logits[r, a] = logits[r, b] = 1.5  # equal logits + equal noise: an exact tie
    logits = logits.to(DEVICE)
    got = gumbel_argmax(logits, seeds, positions, block_size)
    assert got.tolist() == [min(p) for p in pairs]
    assert torch.equal(got, reference.gumbel_argmax_ref(logits, seeds, positions))


@pytest.mark.parametrize("block_size", [0, 16])
def test_special_values_follow_the_reference(block_size: int):
    vocab = 300
    rows = torch.randn(7, vocab, generator=torch.Generator().manual_seed(5))
    rows[0] = -math.inf  # all -inf: token 0, as torch.argmax
    rows[1, :] = -math.inf
    rows[1, [37, 250]] = 0.0  # only these two can win
    rows[2, [40, 90, 291]] = math.inf  # +inf ties: the lowest id
    rows[3, [120, 45]] = math.nan  # NaN wins, the first one
    rows[4, 10] = math.inf
    rows[4, 200] = math.nan  # NaN above +inf
    rows[5, :] = -math.inf
    rows[5, 299] = -1e30  # the last id, the only finite one
    rows[6, ::2] = -math.inf
    seeds, positions = keys(7, seed=6)
    logits = rows.to(DEVICE)
    got = gumbel_argmax(logits, seeds, positions, block_size)
    assert torch.equal(got, reference.gumbel_argmax_ref(logits, seeds, positions))
    assert got[0] == 0 and got[1] in (37, 250) and got[2] == 40 and got[3] == 45
    assert got[4] == 200 and got[5] == 299 and got[6] % 2 == 1


def test_strided_and_empty_inputs():
    seeds, positions = keys(5, seed=8)
    wide = random_logits(5, 3000, seed=9)
    view = wide[:, 500:2500]  # rows of stride 3000
    want = reference.gumbel_argmax_ref(view.contiguous(), seeds, positions)
    assert torch.equal(gumbel_argmax(view, seeds, positions), want)
    transposed = view.t().contiguous().t()  # stride(-1) != 1
    assert torch.equal(gumbel_argmax(transposed, seeds, positions), want)
    empty = gumbel_argmax(wide[:0], seeds[:0], positions[:0])
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_bad_inputs_raise():
    seeds, positions = keys(3, seed=10)
    logits = random_logits(3, 100, seed=11)
    with pytest.raises(ValueError, match="seeds must be int64"):
        gumbel_argmax(logits, seeds.int(), positions)
    with pytest.raises(ValueError, match="positions must be int64"):
        gumbel_argmax(logits, seeds, positions[:2])
    with pytest.raises(ValueError, match="floating"):
        gumbel_argmax(logits.long(), seeds, positions)
    with pytest.raises(ValueError, match="floating"):
        gumbel_argmax(logits[0], seeds, positions)
    with pytest.raises(ValueError, match="vocab size"):
        gumbel_argmax(logits[:, :0], seeds, positions)
    with pytest.raises(ValueError, match="power of two"):
        gumbel_argmax(logits, seeds, positions, 48)
    with pytest.raises(ValueError, match="vocab size"):
        keyed_uniform(seeds, positions, 0)


def test_ops_pass_opcheck():
    seeds, positions = keys(2, seed=12)
    logits = random_logits(2, 40, seed=13)
    torch.library.opcheck(torch.ops.libkk.gumbel_argmax.default, (logits, seeds, positions, 16))
    torch.library.opcheck(torch.ops.libkk.keyed_uniform.default, (seeds, positions, 40))


def test_traces_as_one_op_under_torch_compile():
    seeds, positions = keys(3, seed=14)
    logits = random_logits(3, 700, seed=15)

    def sample(x):
        return gumbel_argmax(x * 0.5, seeds, positions)

    # fullgraph: compiling fails unless the traced call goes through the custom op.
    compiled = torch.compile(sample, backend="aot_eager", fullgraph=True)
    want = reference.gumbel_argmax_ref(logits * 0.5, seeds, positions)
    assert torch.equal(compiled(logits), want)
