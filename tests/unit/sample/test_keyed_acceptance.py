"""The keyed acceptance shared by rejection_sample, the vocab-parallel verifier and
runtime.verify: uniforms, the random test, the accepted prefix and the output layout."""

from __future__ import annotations

import math

import torch

from libkk.sample.gumbel import keyed_uniform_at
from libkk.sample.rejection import (
    ACCEPT_POSITION_SALT,
    acceptance_uniforms,
    accepted_output,
    accepted_prefix,
    random_accepts,
)

SEEDS = [7, 1234, 7]
POSITIONS = [5, 100, 5]
DRAFTS = [[3, 9, 2], [0, 11, 4], [3, 9, 2]]


def _i64(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _direct_uniform(r: int, k: int) -> float:
    """The acceptance uniform of draft k of row r, one token at a time."""
    return keyed_uniform_at(
        _i64([SEEDS[r]]), _i64([POSITIONS[r] + k + ACCEPT_POSITION_SALT]), _i64([DRAFTS[r][k]])
    ).item()


def test_acceptance_uniforms_are_the_keyed_uniform_of_each_slot() -> None:
    u = acceptance_uniforms(_i64(SEEDS), _i64(POSITIONS), _i64(DRAFTS))
    direct = [[_direct_uniform(r, k) for k in range(3)] for r in range(3)]
    assert u.dtype == torch.float32 and u.shape == (3, 3)
    assert u.tolist() == direct
    # pinned: the key is (seed, position + k + ACCEPT_POSITION_SALT, draft token)
    expected = [[0.994693, 0.908750, 0.903944], [0.009517, 0.264474, 0.992673]]
    torch.testing.assert_close(u[:2], torch.tensor(expected), rtol=0, atol=1e-6)
    assert u[2].tolist() == u[0].tolist()  # same key, same uniform


def test_random_accepts_matches_the_direct_rule() -> None:
    # rows 0 and 1: q = 1 except row 1 slot 2 (p / q = 1); row 2: the target excludes slot 0
    p = [[0.999, 0.5, 0.95], [0.02, 0.3, 0.5], [0.0, 0.95, 0.95]]
    q = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.5], [0.0, 1.0, 1.0]]
    got = random_accepts(
        torch.tensor(p).log(), torch.tensor(q).log(), _i64(SEEDS), _i64(POSITIONS), _i64(DRAFTS)
    )
    direct = [
        [
            p[r][k] > 0 and math.log(p[r][k]) >= math.log(_direct_uniform(r, k)) + math.log(q[r][k])
            for k in range(3)
        ]
        for r in range(3)
    ]
    assert got.tolist() == direct
    assert direct == [[True, False, True], [True, True, True], [False, True, True]]


def test_accepted_prefix_counts_leading_passes_up_to_num_draft() -> None:
    accept = torch.tensor(
        [[True, False, True], [True, True, True], [False, True, True], [True, True, True]]
    )
    assert accepted_prefix(accept, _i64([3, 2, 3, 0])).tolist() == [1, 2, 0, 0]
    assert accepted_prefix(accept, _i64([3, 3, 3, 3])).tolist() == [1, 3, 0, 3]


def test_accepted_output_layout() -> None:
    out = accepted_output(_i64(DRAFTS[:2]), _i64([1, 3]), _i64([5, 6]))
    assert out.dtype == torch.int64
    assert out.tolist() == [[3, 5, -1, -1], [0, 11, 4, 6]]
    empty = accepted_output(torch.zeros(2, 0, dtype=torch.int64), _i64([0, 0]), _i64([8, 9]))
    assert empty.tolist() == [[8], [9]]
