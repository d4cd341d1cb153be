"""Adaptive verification: the cost model, the exact choice, synthetic acceptance."""

from __future__ import annotations

import itertools

import pytest
import torch

from libkk.errors import ConfigError
from libkk.spec_decode.adaptive import (
    AdaptiveVerifier,
    CostModel,
    context_features,
    objective,
    optimal_num_draft,
    proposal_features,
    rate_for_acceptance_length,
    synthetic_accept,
)
from libkk.spec_decode.estimator import (
    ONE_HOT_FEATURE,
    AcceptanceEstimator,
    SpeculationInputError,
    draft_feature,
)

# ---------------------------------------------------------------------------------------------
# Cost model


def test_cost_model_interpolates_piecewise_linearly() -> None:
    cost = CostModel(
        draft_ms=[(8, 2.0), (1, 1.0), (32, 5.0)],  # any order
        verify_ms=[(1, 10.0), (64, 10.0), (256, 30.0)],
    )
    assert cost.draft_points == [(1.0, 1.0), (8.0, 2.0), (32.0, 5.0)]
    assert cost.draft(1) == 1.0 and cost.draft(8) == 2.0 and cost.draft(32) == 5.0
    assert cost.draft(4.5) == pytest.approx(1.5)
    assert cost.draft(20) == pytest.approx(3.5)
    assert cost.verify(40) == pytest.approx(10.0)
    assert cost.verify(160) == pytest.approx(20.0)
    # Beyond the ends: the end segments' slopes, never below 0.
    assert cost.draft(56) == pytest.approx(8.0)
    assert cost.verify(512) == pytest.approx(30.0 + 256 * 20.0 / 192)
    assert cost.draft(0) == pytest.approx(1.0 - 1.0 / 7)
    steep = CostModel(draft_ms=[(4, 1.0), (5, 10.0)], verify_ms=[(3, 7.0)])
    assert steep.draft(0) == 0.0
    assert steep.verify(1000) == 7.0  # one point: constant
    # Tensors interpolate elementwise; step = draft(requests) + verify(tokens).
    tokens = torch.tensor([1, 64, 160, 512])
    expected = [10.0, 10.0, 20.0, 30.0 + 256 * 20.0 / 192]
    torch.testing.assert_close(cost.verify(tokens), torch.tensor(expected, dtype=torch.float64))
    assert cost.step(8, 160) == pytest.approx(22.0)


def test_cost_model_rejects_bad_points() -> None:
    with pytest.raises(ConfigError, match="draft_ms: at least one"):
        CostModel(draft_ms=[], verify_ms=[(1, 1.0)])
    with pytest.raises(ConfigError, match="verify_ms: two points at x = 4"):
        CostModel(draft_ms=[(1, 1.0)], verify_ms=[(4, 1.0), (4, 2.0)])
    with pytest.raises(ConfigError, match="finite and >= 0"):
        CostModel(draft_ms=[(1, -1.0)], verify_ms=[(1, 1.0)])
    with pytest.raises(ConfigError, match="finite and >= 0"):
        CostModel(draft_ms=[(1, 1.0)], verify_ms=[(1, float("nan"))])


def test_profile_times_each_count() -> None:
    now = [0.0]
    calls: list[tuple[str, int]] = []
    syncs = [0]

    def draft(n: int) -> None:
        calls.append(("draft", n))
        now[0] += 0.001 * (1 + n)  # 1 ms + 1 ms per request

    def verify(n: int) -> None:
        calls.append(("verify", n))
        # One slow outlier per count: the median ignores it.
        slow = sum(1 for c in calls if c == ("verify", n)) == 3
        now[0] += 0.002 * n + (1.0 if slow else 0.0)

    def sync() -> None:
        syncs[0] += 1

    cost = CostModel.profile(
        draft, verify, [1, 4], [8, 16], warmup=1, repeats=3, synchronize=sync, clock=lambda: now[0]
    )
    assert [p[0] for p in cost.draft_points] == [1, 4]
    assert cost.draft(1) == pytest.approx(2.0) and cost.draft(4) == pytest.approx(5.0)
    assert cost.verify(8) == pytest.approx(16.0) and cost.verify(16) == pytest.approx(32.0)
    assert len(calls) == 4 * (1 + 3)  # warmup + repeats per count
    assert syncs[0] == 4 * 3 * 2  # before and after every timed call
    with pytest.raises(ConfigError, match="repeats"):
        CostModel.profile(draft, verify, [1], [1], repeats=0)
    graphs: list[tuple[int, int]] = []

    def graph(n: int, q: int) -> None:
        graphs.append((n, q))
        now[0] += 0.001 * n * q

    cost = CostModel.profile(
        draft, verify, [1], [8], graph_step=graph, graph_shapes=[(1, 1), (1, 8), (4, 1), (4, 8)],
        warmup=0, repeats=1, clock=lambda: now[0],
    )  # fmt: skip
    assert graphs == [(1, 1), (1, 8), (4, 1), (4, 8)]
    assert cost.graph(4, 8) == pytest.approx(32.0) and cost.graph(1, 1) == pytest.approx(1.0)
    assert cost.graph_sizes == [1, 4] and cost.graph_query_lens == [1, 8]


def test_profile_ratios_hold_while_the_machine_slows_down() -> None:
    """The counts are timed round robin, repeat after repeat: a machine that gets slower through
    the profile (a CPU another process starts loading) stretches every point alike, so a
    verification's cost over a plain step's stays what it is (here 3), where timing each count's
    repeats together would have put the later counts' on the slower machine."""
    now, calls = [0.0], [0]

    def run(ms: float) -> None:
        calls[0] += 1
        now[0] += ms / 1e3 * (1 + calls[0] / 10)  # 10% slower every call

    cost = CostModel.profile(
        lambda n: run(1.0), lambda n: run(10.0 * (1 + (n > 1) * 2)), [1], [1, 8],
        warmup=1, repeats=7, clock=lambda: now[0],
    )  # fmt: skip
    assert cost.verify(8) / cost.verify(1) == pytest.approx(3.0, rel=0.1)


# ---------------------------------------------------------------------------------------------
# The choice


def _brute_force(
    survival: torch.Tensor,
    avail: list[int],
    cost: CostModel,
    other: int = 0,
    budget: int | None = None,
) -> float:
    best = -1.0
    for n in itertools.product(*[range(a + 1) for a in avail]):
        if budget is not None and len(avail) + other + sum(n) > budget:
            continue
        best = max(best, objective(survival, torch.tensor(n), cost, other))
    return best


def _random_cost(g: torch.Generator) -> CostModel:
    # Non-convex verify curves too (flat then a jump, as with graph padding).
    xs = sorted(set(torch.randint(1, 30, (4,), generator=g).tolist()))
    ys = torch.rand(len(xs), generator=g).cumsum(0) * 5
    if bool(torch.rand(1, generator=g) < 0.5):
        ys = ys.flip(0).cummin(0).values.flip(0)  # keep it monotone anyway
    return CostModel(
        draft_ms=[(1, float(torch.rand(1, generator=g)) * 3), (8, 4.0)],
        verify_ms=list(zip(xs, ys.tolist(), strict=True)),
    )


def test_choice_maximizes_the_objective_against_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        num_rows = int(torch.randint(1, 4, (1,), generator=g))
        k = int(torch.randint(1, 4, (1,), generator=g))
        p = torch.rand(num_rows, k, generator=g, dtype=torch.float64)
        if trial % 5 == 0:
            p = (p * 4).round() / 4  # ties between rows and slots
        survival = p.cumprod(dim=-1)
        avail = torch.randint(0, k + 1, (num_rows,), generator=g)
        cost = _random_cost(g)
        cost.overhead_ms = float(torch.rand(1, generator=g)) * 3 * (trial % 2)
        other = int(torch.randint(0, 3, (1,), generator=g))
        budget = (
            None if trial % 3 else num_rows + other + int(torch.randint(0, 5, (1,), generator=g))
        )
        chosen = optimal_num_draft(
            survival, avail, cost, other_tokens=other, max_verify_tokens=budget
        )
        assert bool((chosen <= avail).all()) and bool((chosen >= 0).all())
        if budget is not None:
            assert num_rows + other + int(chosen.sum()) <= max(budget, num_rows + other)
        got = objective(survival, chosen, cost, other)
        want = _brute_force(survival, avail.tolist(), cost, other, budget)
        assert got == pytest.approx(want, rel=1e-12), (trial, chosen.tolist())


def _graph_cost(g: torch.Generator, sizes: list[int], query_lens: list[int]) -> CostModel:
    """Random graph times, rising with the padded tokens (not necessarily linearly)."""
    graph_ms = {}
    for n in sizes:
        for q in query_lens:
            graph_ms[n, q] = n * q * (0.5 + float(torch.rand(1, generator=g))) + 3.0
    return CostModel(
        draft_ms=[(1, float(torch.rand(1, generator=g)))],
        verify_ms=[(1, 1.0), (64, 100.0)],  # never used: every step is a graph's
        graph_ms=graph_ms,
    )


def test_choice_under_graphs_maximizes_the_objective_against_brute_force() -> None:
    g = torch.Generator().manual_seed(3)
    for trial in range(150):
        num_rows = int(torch.randint(1, 4, (1,), generator=g))
        k = int(torch.randint(1, 5, (1,), generator=g))
        p = torch.rand(num_rows, k, generator=g, dtype=torch.float64)
        if trial % 5 == 0:
            p = (p * 4).round() / 4
        survival = p.cumprod(dim=-1)
        avail = torch.randint(0, k + 1, (num_rows,), generator=g)
        # Graphs of 1 and 1 + K tokens always (as the runner captures), some lengths between.
        middle = [q for q in range(2, k + 1) if bool(torch.rand(1, generator=g) < 0.5)]
        cost = _graph_cost(g, [1, 2, 4], [1, *middle, k + 1])
        cost.overhead_ms = float(torch.rand(1, generator=g)) * 10
        chosen = optimal_num_draft(survival, avail, cost)
        assert bool((chosen <= avail).all()) and bool((chosen >= 0).all())
        got = objective(survival, chosen, cost)
        want = _brute_force(survival, avail.tolist(), cost)
        assert got == pytest.approx(want, rel=1e-12), (trial, chosen.tolist())


def _padded_graph_case() -> tuple[CostModel, torch.Tensor]:
    """Graphs of 2 and 4 requests whose q = 3 costs 2 ms extra, and three requests' survivals."""
    cost = CostModel(
        draft_ms=[(1, 0.0)],
        verify_ms=[(0, 4.0), (100, 14.0)],
        graph_ms={(n, q): 4.0 + 0.25 * n * q + 2.0 * (q == 3) for n in (2, 4) for q in (1, 2, 3)},
    )
    return cost, torch.tensor([[0.9, 0.85]] + [[0.6, 0.3]] * 2, dtype=torch.float64)


def test_choice_under_graphs_pays_for_the_padded_shape() -> None:
    # Three requests pad to the graph of 4, whose q = 3 costs 9 ms against 6 for q = 2: a second
    # draft of any one request costs the q = 3 graph for all of them. Costed by token count the
    # same survivals would take every draft.
    cost, survival = _padded_graph_case()
    assert cost.graph_shape(3, 2) == (4, 2) and cost.graph_shape(5, 2) is None
    # q = 2: (3 + 2.1) / 6 = 0.85 beats q = 3: (3 + 3.55) / 9 = 0.73 and q = 1: 3 / 5
    assert optimal_num_draft(survival, torch.tensor([2, 2, 2]), cost).tolist() == [1, 1, 1]
    ragged = optimal_num_draft(survival, torch.tensor([2, 2, 2]), cost, other_tokens=1)
    assert ragged.tolist() == [2, 2, 2]  # a prefill chunk in the step: no graph runs it
    # More requests than the largest graph: costed by token count, each request on its own.
    wide = torch.tensor([[0.9, 0.85]] + [[0.6, 0.1]] * 4, dtype=torch.float64)
    assert optimal_num_draft(wide, torch.tensor([2] * 5), cost).tolist() == [2, 1, 1, 1, 1]
    with pytest.raises(ConfigError, match="every \\(size, query length\\)"):
        CostModel(draft_ms=[(1, 0.0)], verify_ms=[(1, 1.0)], graph_ms={(1, 1): 1.0, (2, 2): 1.0})


def test_step_overhead_is_learned_and_weighs_for_more_drafts() -> None:
    from libkk.engine.speculation import AdaptiveDrafts
    from libkk.runtime.io import ScheduledRequest, SchedulerOutput

    cost, survival = _padded_graph_case()
    assert optimal_num_draft(survival, torch.tensor([2, 2, 2]), cost).tolist() == [1, 1, 1]
    adaptive = AdaptiveDrafts(cost, 2, autoregressive_sampling=False)

    def step(drafts: list[int], prompt: bool = False) -> SchedulerOutput:
        return SchedulerOutput(requests=[
            ScheduledRequest(f"r{i}", [1] * (1 + n + 5 * prompt), 9, [[1]], None, [2] * n)
            for i, n in enumerate(drafts)
        ])  # fmt: skip

    # Three requests verifying 1 draft each run the (4, 2) graph: 6 ms by the tables. Steps
    # that took 12 ms teach about 6 ms of overhead (an exponential average); prompt steps and
    # faster-than-the-tables steps teach nothing beyond 0. The engine calls `learn` while the
    # next step runs: what record_step takes waits for it.
    for _ in range(60):
        adaptive.record_step(step([1, 1, 1]), 0.012)
        adaptive.record_step(step([1, 1, 1], prompt=True), 1.0)
    assert cost.overhead_ms == 0.0
    adaptive.learn()
    assert cost.overhead_ms == pytest.approx(6.0, abs=0.05)
    # A fixed 6 ms per step makes the q = 3 graph worth it: (3 + 3.55) / 15 > (3 + 2.1) / 12.
    assert optimal_num_draft(survival, torch.tensor([2, 2, 2]), cost).tolist() == [2, 2, 2]
    for _ in range(200):
        adaptive.record_step(step([1, 1, 1]), 0.001)
        adaptive.learn()
    assert cost.overhead_ms < 1e-6


def test_choice_verifies_likely_slots_and_skips_unlikely_ones() -> None:
    cost = CostModel(draft_ms=[(1, 1.0)], verify_ms=[(0, 0.0), (100, 10.0)])
    survival = torch.tensor([[0.9, 0.8, 0.05], [0.5, 0.01, 0.001]], dtype=torch.float64)
    # Each verified token costs 0.1 ms against a ratio near 2 tokens/ms: keep s >= ~0.2.
    assert optimal_num_draft(survival, torch.tensor([3, 3]), cost).tolist() == [2, 1]
    assert optimal_num_draft(survival, torch.tensor([1, 0]), cost).tolist() == [1, 0]
    # A budget of one draft token takes the best slot.
    capped = optimal_num_draft(survival, torch.tensor([3, 3]), cost, max_verify_tokens=3)
    assert capped.tolist() == [1, 0]


def test_context_features_make_the_choice_independent_of_later_slots() -> None:
    # An autoregressive drafter's later features depend on its drawn tokens; with
    # context_features the choice cannot.
    cost = CostModel(draft_ms=[(1, 1.0)], verify_ms=[(0, 0.0), (100, 10.0)])
    est = AcceptanceEstimator(4)
    est.slope = 1.0
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(6, 4, generator=g) * 3
    choices = set()
    for _ in range(20):
        other = feats.clone()
        other[:, 1:] = torch.randn(6, 3, generator=g) * 3  # what other draws would give
        verifier = AdaptiveVerifier(est, cost)
        ctx = context_features(other)
        assert torch.equal(ctx, feats[:, :1].expand(6, 4))
        choices.add(tuple(verifier.choose(ctx).tolist()))
    assert len(choices) == 1
    # ... while the raw later features do move it.
    raw = {
        tuple(AdaptiveVerifier(est, cost).choose(torch.randn(6, 4, generator=g) * 3).tolist())
        for _ in range(20)
    }
    assert len(raw) > 1


def test_proposal_features() -> None:
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 11, generator=g)
    b = torch.randn(1, 11, generator=g)
    f = proposal_features([a, None, b, torch.zeros(0, 11)], [0.7, 1.0, 0.0, 1.0], 4)
    assert f.shape == (4, 4)
    torch.testing.assert_close(f[0, :3], draft_feature(a, 0.7))
    assert f[0, 3] == ONE_HOT_FEATURE
    assert bool((f[1:] == ONE_HOT_FEATURE).all())  # one-hot, greedy and empty rows
    with pytest.raises(SpeculationInputError, match="draft_logits\\[0\\] must be"):
        proposal_features([torch.zeros(5, 11)], [1.0], 4)
    with pytest.raises(SpeculationInputError, match="temperatures"):
        proposal_features([None], [1.0, 1.0], 4)


def test_verifier_rejects_bad_num_proposed() -> None:
    cost = CostModel(draft_ms=[(1, 1.0)], verify_ms=[(1, 1.0)])
    verifier = AdaptiveVerifier(AcceptanceEstimator(2), cost)
    with pytest.raises(SpeculationInputError, match="num_proposed must lie"):
        verifier.choose(torch.zeros(2, 2), torch.tensor([3, 0]))
    with pytest.raises(SpeculationInputError, match="num_proposed must be"):
        verifier.choose(torch.zeros(2, 2), torch.tensor([1]))


# ---------------------------------------------------------------------------------------------
# Synthetic acceptance


def _rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003 - 5
    positions = torch.arange(n, dtype=torch.int64) * 13 % 4096
    return seeds, positions


def test_synthetic_accept_rates_and_determinism() -> None:
    rates = [0.9, 0.8, 0.6, 0.4]
    n = 20000
    seeds, positions = _rows(n)
    nd = torch.full((n,), 4)
    acc = synthetic_accept(rates, nd, seeds, positions)
    # P(accepted >= k + 1) = prod_{j <= k} rates[j]
    expected = torch.tensor(rates, dtype=torch.float64).cumprod(0)
    for k in range(4):
        frac = float((acc >= k + 1).double().mean())
        assert abs(frac - float(expected[k])) < 4 * (float(expected[k]) / n) ** 0.5 + 1e-3
    # Deterministic and batch-independent.
    assert torch.equal(acc, synthetic_accept(rates, nd, seeds, positions))
    sub = synthetic_accept(rates, nd[7:9], seeds[7:9], positions[7:9])
    assert torch.equal(sub, acc[7:9])
    # num_draft caps it; rate 0 and 1 are exact.
    capped = synthetic_accept(rates, torch.full((n,), 2), seeds, positions)
    assert torch.equal(capped, acc.clamp(max=2))
    assert synthetic_accept([1.0, 1.0], torch.tensor([2, 1, 0]), *_rows(3)).tolist() == [2, 1, 0]
    assert synthetic_accept([0.0, 1.0], torch.tensor([2, 2]), *_rows(2)).tolist() == [0, 0]


def test_synthetic_accept_bad_inputs() -> None:
    seeds, positions = _rows(2)
    with pytest.raises(SpeculationInputError, match="rates"):
        synthetic_accept([1.5], torch.tensor([1, 1]), seeds, positions)
    with pytest.raises(SpeculationInputError, match="num_draft must lie"):
        synthetic_accept([0.5], torch.tensor([2, 1]), seeds, positions)
    with pytest.raises(SpeculationInputError, match="positions must be int64"):
        synthetic_accept([0.5], torch.tensor([1, 1]), seeds, positions.float())


def test_rate_for_acceptance_length() -> None:
    for length in (1.0, 2.0, 3.5, 5.0, 8.0):
        a = rate_for_acceptance_length(length, 7)
        assert 1 + sum(a**i for i in range(1, 8)) == pytest.approx(length, abs=1e-9)
    # The synthetic acceptance with that rate gives that mean length.
    a = rate_for_acceptance_length(3.5, 7)
    n = 20000
    acc = synthetic_accept([a] * 7, torch.full((n,), 7), *_rows(n))
    assert float(acc.double().mean()) + 1 == pytest.approx(3.5, abs=0.06)
    with pytest.raises(SpeculationInputError, match="length must lie"):
        rate_for_acceptance_length(9.0, 7)


def test_choice_under_graphs_and_a_budget_takes_the_best_cap_that_fits() -> None:
    g = torch.Generator().manual_seed(4)
    for trial in range(100):
        num_rows = int(torch.randint(1, 5, (1,), generator=g))
        k = int(torch.randint(1, 6, (1,), generator=g))
        survival = torch.rand(num_rows, k, generator=g, dtype=torch.float64).cumprod(dim=-1)
        avail = torch.randint(0, k + 1, (num_rows,), generator=g)
        cost = _graph_cost(g, [1, 2, 4], list(range(1, k + 2)))
        cost.overhead_ms = float(torch.rand(1, generator=g)) * 10
        budget = num_rows + int(torch.randint(0, num_rows * k + 1, (1,), generator=g))
        chosen = optimal_num_draft(survival, avail, cost, max_verify_tokens=budget)
        caps = [avail.clamp(max=c) for c in range(k + 1)]
        fitting = [n for n in caps if not n.any() or num_rows + int(n.sum()) <= budget]
        want = max(objective(survival, n, cost) for n in fitting)
        assert num_rows + int(chosen.sum()) <= max(budget, num_rows), trial
        assert any(torch.equal(chosen, n) for n in fitting), (trial, chosen.tolist())
        assert objective(survival, chosen, cost) == pytest.approx(want, rel=1e-12), trial
