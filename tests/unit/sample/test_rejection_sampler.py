from __future__ import annotations

import math

import pytest
import torch
from chi2 import chi2_critical
from torch import Tensor

from libkk.sample.gumbel import DRAFT_POSITION_SALT, gumbel_argmax
from libkk.sample.rejection import rejection_sample

# ---------------------------------------------------------------------------------------------
# Helpers


def _one_hot_logits(tokens: list[list[int]], vocab_size: int) -> Tensor:
    """Logits [R, K+1, V] whose argmax at [r, k] is tokens[r][k]."""
    out = torch.zeros(len(tokens), len(tokens[0]), vocab_size)
    for r, row in enumerate(tokens):
        for k, t in enumerate(row):
            out[r, k, t] = 5.0
    return out


def _i64(values: list[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _greedy(
    target: list[list[int]], drafts: list[list[int]], num_draft: list[int], vocab_size: int = 8
) -> tuple[list[list[int]], list[int]]:
    num_rows = len(target)
    out, acc = rejection_sample(
        _one_hot_logits(target, vocab_size),
        _i64(drafts) if drafts[0] else torch.zeros(num_rows, 0, dtype=torch.int64),
        None,
        torch.zeros(num_rows),
        _i64(list(range(num_rows))),
        _i64([10] * num_rows),
        _i64(num_draft),
    )
    return out.tolist(), acc.tolist()


def _chi2(samples: Tensor, probs: Tensor) -> float:
    """Pearson statistic of samples [N] against probs [V] (all > 0)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    assert float(expected.min()) >= 5.0, "too few samples for the chi-square approximation"
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------------------------
# Greedy


def test_greedy_all_accepted_emits_bonus_argmax() -> None:
    out, acc = _greedy([[1, 2, 3, 4]], [[1, 2, 3]], [3])
    assert acc == [3]
    assert out == [[1, 2, 3, 4]]


def test_greedy_first_mismatch_emits_target_argmax() -> None:
    out, acc = _greedy([[1, 5, 3, 4], [6, 2, 3, 4]], [[1, 2, 3], [1, 2, 3]], [3, 3])
    assert acc == [1, 0]
    # Row 0: d0 accepted, d1 = 2 rejected -> target argmax 5; row 1 rejects at once.
    assert out == [[1, 5, -1, -1], [6, -1, -1, -1]]


def test_greedy_partial_num_draft_and_padding() -> None:
    # Row 0 verifies 2 of 3 drafts: both accepted, bonus from target row 2 even though the padded
    # draft at k = 2 would also match. Row 1 verifies none: only the target argmax at row 0.
    # Padded draft ids may be anything, including -1.
    out, acc = _greedy([[1, 2, 3, 4], [7, 2, 3, 4]], [[1, 2, 3], [-1, -1, -1]], [2, 0])
    assert acc == [2, 0]
    assert out == [[1, 2, 3, -1], [7, -1, -1, -1]]


def test_greedy_no_draft_slots() -> None:
    out, acc = _greedy([[4], [2]], [[]], [0, 0])
    assert acc == [0, 0]
    assert out == [[4], [2]]


def test_greedy_ignores_draft_probs() -> None:
    logits = _one_hot_logits([[1, 2, 3]], 8)
    probs = torch.full((1, 2, 8), 1.0 / 8)
    args = (torch.zeros(1), _i64([0]), _i64([0]), _i64([2]))
    out_none, _ = rejection_sample(logits, _i64([[1, 0]]), None, *args)
    out_probs, _ = rejection_sample(logits, _i64([[1, 0]]), probs, *args)
    assert out_none.tolist() == out_probs.tolist() == [[1, 2, -1]]


# ---------------------------------------------------------------------------------------------
# Random rows: structure


def test_one_hot_draft_of_certain_token_is_always_accepted() -> None:
    # p puts all its mass on the drafted tokens: every draft is accepted for every seed.
    num_rows, vocab_size = 64, 5
    logits = torch.full((num_rows, 3, vocab_size), -math.inf)
    logits[:, 0, 3] = 0.0
    logits[:, 1, 1] = 0.0
    logits[:, 2] = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(0))
    drafts = _i64([[3, 1]] * num_rows)
    seeds = torch.arange(num_rows, dtype=torch.int64)
    positions = _i64([7] * num_rows)
    out, acc = rejection_sample(
        logits, drafts, None, torch.ones(num_rows), seeds, positions, _i64([2] * num_rows)
    )
    assert acc.tolist() == [2] * num_rows
    assert out[:, :2].tolist() == [[3, 1]] * num_rows
    # The bonus is the plain sampler's token at position + 2.
    assert out[:, 2].tolist() == gumbel_argmax(logits[:, 2], seeds, positions + 2).tolist()


def test_one_hot_rejection_never_resamples_the_draft() -> None:
    # With q one-hot at d, the residual max(p - q, 0) has no mass on d.
    num_rows, vocab_size = 2000, 4
    logits = torch.tensor([0.0, 1.0, 0.5, -0.5]).expand(num_rows, 1 + 1, vocab_size).clone()
    drafts = torch.full((num_rows, 1), 1, dtype=torch.int64)
    out, acc = rejection_sample(
        logits,
        drafts,
        None,
        torch.ones(num_rows),
        torch.arange(num_rows, dtype=torch.int64),
        torch.zeros(num_rows, dtype=torch.int64),
        torch.ones(num_rows, dtype=torch.int64),
    )
    rejected = acc == 0
    assert 0 < int(rejected.sum()) < num_rows
    assert not bool((out[rejected, 0] == 1).any())
    assert (out[rejected, 1] == -1).all()


def test_one_hot_drafts_emit_the_plain_samplers_draws() -> None:
    """A one-hot draft is accepted exactly when it is the plain sampler's draw at its position
    (keyed Gumbel argmax of the row), and the token after the accepted run is that position's
    draw too: every emitted token is the plain sampler's, whichever drafts were proposed. Rows
    with a drawn q (here mixed in) keep the ratio test."""
    num_rows, k, vocab_size = 40, 4, 12
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(num_rows, k + 1, vocab_size, generator=g) * 1.5
    seeds = torch.arange(num_rows, dtype=torch.int64) * 31 + 7
    positions = torch.randint(0, 500, (num_rows,), generator=g)
    steps = torch.arange(k + 1)
    draws = gumbel_argmax(
        logits.reshape(-1, vocab_size),
        seeds.repeat_interleave(k + 1),
        (positions[:, None] + steps).reshape(-1),
    ).view(num_rows, k + 1)
    # Drafts: the draws with one replaced at a random slot (or none), so every depth occurs.
    drafts = draws[:, :k].clone()
    wrong = torch.randint(0, k + 1, (num_rows,), generator=g)
    for r in range(num_rows):
        if wrong[r] < k:
            drafts[r, wrong[r]] = (drafts[r, wrong[r]] + 1) % vocab_size
    num_draft = torch.randint(0, k + 1, (num_rows,), generator=g)
    out, acc = rejection_sample(
        logits, drafts, None, torch.ones(num_rows), seeds, positions, num_draft
    )
    for r in range(num_rows):
        n = int(acc[r])
        assert n == min(int(wrong[r]), int(num_draft[r]))
        assert out[r, : n + 1].tolist() == draws[r, : n + 1].tolist()
    assert {int(a) for a in acc} == set(range(k + 1))
    # A probabilistic q (not one-hot) for half the rows leaves the one-hot rows as they were.
    q = torch.softmax(torch.randn(num_rows, k, vocab_size, generator=g), dim=-1)
    one_hot = torch.zeros(num_rows, dtype=torch.bool)
    one_hot[::2] = True
    q[one_hot] = torch.nn.functional.one_hot(drafts[one_hot], vocab_size).float()
    mixed, _ = rejection_sample(
        logits, drafts, q, torch.ones(num_rows), seeds, positions, num_draft
    )
    assert torch.equal(mixed[one_hot], out[one_hot])


def test_excluded_token_is_never_accepted() -> None:
    # The target filtered the drafted token out (-inf): rejected whatever q says.
    logits = torch.zeros(16, 2, 4)
    logits[:, 0, 2] = -math.inf
    probs = torch.tensor([0.0, 0.0, 1.0, 0.0]).expand(16, 1, 4)
    out, acc = rejection_sample(
        logits,
        torch.full((16, 1), 2, dtype=torch.int64),
        probs,
        torch.ones(16),
        torch.arange(16, dtype=torch.int64),
        torch.zeros(16, dtype=torch.int64),
        torch.ones(16, dtype=torch.int64),
    )
    assert acc.tolist() == [0] * 16
    assert not bool((out[:, 0] == 2).any())


# ---------------------------------------------------------------------------------------------
# Random rows: exactness


def _spec_batch(
    num_rows: int, vocab_size: int, k: int, one_hot: bool, seed: int
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor]:
    """Same target / draft distributions for every row; drafts sampled from q with the draft
    stream's keyed noise, one seed per row."""
    g = torch.Generator().manual_seed(seed)
    target = (torch.randn(k + 1, vocab_size, generator=g) * 1.5).expand(num_rows, -1, -1)
    draft_logits = (torch.randn(k, vocab_size, generator=g) * 1.5).expand(num_rows, -1, -1)
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=g, dtype=torch.int64)
    positions = torch.full((num_rows,), 123, dtype=torch.int64)
    drafts = torch.stack(
        [
            gumbel_argmax(draft_logits[:, i], seeds, positions + i + DRAFT_POSITION_SALT)
            for i in range(k)
        ],
        dim=1,
    )  # [R, K]
    probs = None if one_hot else torch.softmax(draft_logits, dim=-1)
    return target.contiguous(), drafts, probs, seeds, positions, torch.full_like(seeds, k)


@pytest.mark.parametrize(
    ("temperature", "one_hot"), [(1.0, False), (0.7, False), (1.3, True)], ids=str
)
def test_emitted_tokens_follow_target_distribution(temperature: float, one_hot: bool) -> None:
    num_rows, vocab_size, k = 100_000, 6, 2
    target, drafts, probs, seeds, positions, num_draft = _spec_batch(
        num_rows, vocab_size, k, one_hot, seed=1
    )
    temps = torch.full((num_rows,), temperature)
    out, acc = rejection_sample(target, drafts, probs, temps, seeds, positions, num_draft)
    p = torch.softmax(target[0] / temperature, dim=-1)  # [K+1, V]
    crit = chi2_critical(vocab_size - 1)

    # First token: accepted draft or residual sample, distributed as p_0.
    assert _chi2(out[:, 0], p[0]) < crit
    # Second token given the first draft accepted: distributed as p_1.
    first_ok = acc >= 1
    assert int(first_ok.sum()) > 1000
    assert _chi2(out[first_ok, 1], p[1]) < crit
    # Third token (bonus) given both accepted: distributed as p_2.
    both_ok = acc == 2
    assert int(both_ok.sum()) > 1000
    assert _chi2(out[both_ok, 2], p[2]) < crit
    # Accepted drafts are copied through; nothing after the emitted token.
    steps = torch.arange(k + 1)
    assert torch.equal(out[:, :k][steps[:k] < acc[:, None]], drafts[steps[:k] < acc[:, None]])
    assert ((out >= 0) == (steps <= acc[:, None])).all()


def test_acceptance_rate_matches_theory() -> None:
    # P(accept d_0) = sum_x min(p(x), q(x)).
    num_rows, vocab_size = 40_000, 6
    target, drafts, probs, seeds, positions, num_draft = _spec_batch(
        num_rows, vocab_size, 1, False, seed=2
    )
    _, acc = rejection_sample(
        target, drafts, probs, torch.ones(num_rows), seeds, positions, num_draft
    )
    assert probs is not None
    rate = float(torch.minimum(torch.softmax(target[0, 0], -1), probs[0, 0]).sum())
    observed = float(acc.double().mean())
    sigma = math.sqrt(rate * (1 - rate) / num_rows)
    assert abs(observed - rate) < 4.5 * sigma, (observed, rate)


# ---------------------------------------------------------------------------------------------
# Determinism and batch independence


def _mixed_batch() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    num_rows, k, vocab_size = 12, 3, 10
    target = torch.randn(num_rows, k + 1, vocab_size, generator=g)
    probs = torch.softmax(torch.randn(num_rows, k, vocab_size, generator=g), dim=-1)
    drafts = torch.randint(0, vocab_size, (num_rows, k), generator=g)
    temps = torch.tensor([0.0, 1.0, 0.5, 2.0] * 3)
    seeds = torch.randint(0, 2**40, (num_rows,), generator=g)
    positions = torch.randint(0, 1000, (num_rows,), generator=g)
    num_draft = torch.tensor([3, 2, 1, 0] * 3)
    return target, drafts, probs, temps, seeds, positions, num_draft


def test_same_seeds_same_output() -> None:
    args = _mixed_batch()
    out_a, acc_a = rejection_sample(*args)
    out_b, acc_b = rejection_sample(*args)
    assert torch.equal(out_a, out_b) and torch.equal(acc_a, acc_b)


def test_row_result_independent_of_batch() -> None:
    target, drafts, probs, temps, seeds, positions, num_draft = _mixed_batch()
    out, acc = rejection_sample(target, drafts, probs, temps, seeds, positions, num_draft)
    for r in range(target.shape[0]):
        sl = slice(r, r + 1)
        out_r, acc_r = rejection_sample(
            target[sl], drafts[sl], probs[sl], temps[sl], seeds[sl], positions[sl], num_draft[sl]
        )
        assert torch.equal(out_r[0], out[r]) and int(acc_r[0]) == int(acc[r]), r
    # Reversed order gives the reversed result.
    flip = torch.arange(target.shape[0] - 1, -1, -1)
    out_f, acc_f = rejection_sample(
        target[flip],
        drafts[flip],
        probs[flip],
        temps[flip],
        seeds[flip],
        positions[flip],
        num_draft[flip],
    )
    assert torch.equal(out_f, out[flip]) and torch.equal(acc_f, acc[flip])


def test_different_seeds_differ() -> None:
    target, drafts, probs, seeds, positions, num_draft = _spec_batch(256, 6, 2, False, 4)
    temps = torch.ones(256)
    out_a, _ = rejection_sample(target, drafts, probs, temps, seeds, positions, num_draft)
    out_b, _ = rejection_sample(target, drafts, probs, temps, seeds + 1, positions, num_draft)
    assert not torch.equal(out_a, out_b)


def test_rejects_bad_num_draft() -> None:
    target, drafts, probs, temps, seeds, positions, num_draft = _mixed_batch()
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample(target, drafts, probs, temps, seeds, positions, num_draft + 1)
