"""The online acceptance estimator: features, convergence, safety bounds, recovery, exploration."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from libkk.errors import ConfigError
from libkk.spec_decode.adaptive import AdaptiveConfig, AdaptiveVerifier, CostModel
from libkk.spec_decode.estimator import (
    FEATURE_CLAMP,
    ONE_HOT_FEATURE,
    AcceptanceEstimator,
    EstimatorConfig,
    SpeculationInputError,
    draft_feature,
    feature_from_lse,
)

# Verifying a token costs as much as the fixed part: a slot pays only when likely accepted.
STEEP = CostModel(draft_ms=[(1, 1.0), (64, 1.0)], verify_ms=[(0, 0.0), (1000, 1000.0)])


def _accepted(true_p: Tensor, num_draft: Tensor, g: torch.Generator) -> Tensor:
    """Sequential acceptance: slot k accepted with probability true_p[r, k] until a rejection."""
    num_rows, k = true_p.shape
    ok = torch.rand(num_rows, k, generator=g, dtype=torch.float64) < true_p
    ok &= torch.arange(k)[None, :] < num_draft[:, None]
    return ok.long().cumprod(dim=-1).sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Features


def test_feature_is_logit_of_max_probability() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    temps = torch.tensor([0.6, 0.8, 1.0, 1.3, 2.0, 0.7])
    f = draft_feature(logits, temps)
    q_max = torch.softmax(logits.double() / temps[:, None].double(), dim=-1).amax(dim=-1)
    torch.testing.assert_close(f.double(), torch.log(q_max / (1 - q_max)), rtol=1e-5, atol=1e-5)
    # The same from (max, lse), as vocab-parallel drafting has them.
    z = logits / temps[:, None]
    torch.testing.assert_close(
        feature_from_lse(z.amax(dim=-1), torch.logsumexp(z, dim=-1)), f, rtol=1e-3, atol=1e-3
    )


def test_feature_constant_for_greedy_and_clamped_for_one_hot() -> None:
    logits = torch.full((3, 2, 10), -1e4)
    logits[..., 3] = 0.0  # one-hot in fp32: logit(q_max) = +inf before the clamp
    logits[2, :] = torch.linspace(-1, 1, 10)
    temps = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    f = draft_feature(logits, temps)
    assert f[0].tolist() == [FEATURE_CLAMP, FEATURE_CLAMP]
    assert f[1].tolist() == [ONE_HOT_FEATURE, ONE_HOT_FEATURE]
    assert f[2, 0] == ONE_HOT_FEATURE and -FEATURE_CLAMP < f[2, 1] < 0
    # Two tied maxima: q_max = 1/2 -> 0; flat over V: logit(1/V).
    tied = torch.tensor([[-1e4, 5.0, 5.0, -1e4]])
    assert abs(float(draft_feature(tied, 1.0))) < 1e-6
    flat = torch.zeros(1, 8)
    assert float(draft_feature(flat, 1.0)) == pytest.approx(math.log(1 / 7), abs=1e-6)


def test_feature_bad_inputs() -> None:
    with pytest.raises(SpeculationInputError, match="temperatures must be >= 0"):
        draft_feature(torch.zeros(2, 4), torch.tensor([1.0, -1.0]))
    with pytest.raises(SpeculationInputError, match="do not broadcast"):
        draft_feature(torch.zeros(2, 4), torch.ones(3))


# ---------------------------------------------------------------------------------------------
# Fitting


def test_converges_on_known_per_position_rates() -> None:
    # One-hot drafts: p_k = sigmoid(b_k) must reach each slot's true rate.
    rates = torch.tensor([0.9, 0.75, 0.5, 0.3], dtype=torch.float64)
    est = AcceptanceEstimator(4)
    g = torch.Generator().manual_seed(1)
    feats = torch.full((16, 4), ONE_HOT_FEATURE)
    for _ in range(3000):
        nd = torch.full((16,), 4)
        est.observe(feats, nd, _accepted(rates.expand(16, 4), nd, g))
    # Every 100 observed steps once the windows have grown; more often early on.
    assert 30 <= est.num_refits <= 40
    torch.testing.assert_close(est.predict(feats[:1])[0], rates, rtol=0, atol=0.04)


def test_converges_on_slope_and_intercepts() -> None:
    true_w, true_b = 1.2, torch.tensor([1.0, 0.4, -0.2, -0.8], dtype=torch.float64)
    est = AcceptanceEstimator(4)
    g = torch.Generator().manual_seed(2)
    fits = []
    for step in range(6000):
        f = torch.rand(32, 4, generator=g, dtype=torch.float64) * 8 - 4
        nd = torch.randint(1, 5, (32,), generator=g)
        refitted = est.observe(f, nd, _accepted(torch.sigmoid(true_w * f + true_b), nd, g))
        if refitted and step >= 2000:
            fits.append(torch.cat([torch.tensor([est.slope]), est.intercepts]))
    # Each refit is one Newton step on its own window, so a fit scatters around the truth by
    # about the window's standard error (largest at the rarely reached slot 3); the fits of the
    # second half average to it.
    mean = torch.stack(fits).mean(dim=0)
    torch.testing.assert_close(mean, torch.cat([torch.tensor([true_w]), true_b]), rtol=0, atol=0.1)
    assert est.slope == pytest.approx(true_w, abs=0.15)
    torch.testing.assert_close(est.intercepts, true_b, rtol=0, atol=0.6)
    f = torch.linspace(-4, 4, 9, dtype=torch.float64)[:, None].expand(9, 4)
    truth = torch.sigmoid(true_w * f + true_b)
    torch.testing.assert_close(est.predict(f)[:, :3], truth[:, :3], rtol=0, atol=0.08)


def test_refit_windows_double_and_restart_while_the_fit_is_far_off() -> None:
    feats = torch.full((16, 4), ONE_HOT_FEATURE)
    for rate, want in ((0.45, [10, 30, 70, 150, 250, 350]), (0.97, [10, 20, 30, 50, 90, 170])):
        # 0.45: about the initial guess (sigmoid(-0.2)), so every window doubles, up to 100.
        # 0.97: the first steps hit the trust region, so windows stay at 10 until the fit is near.
        est = AcceptanceEstimator(4)
        g = torch.Generator().manual_seed(1)
        at = []
        while len(at) < len(want):
            nd = torch.full((16,), 4)
            rates = torch.full((16, 4), rate, dtype=torch.float64)
            if est.observe(feats, nd, _accepted(rates, nd, g)):
                at.append(est.observed_steps)
        assert at == want, rate
        torch.testing.assert_close(
            est.predict(feats[:1])[0],
            torch.full((4,), rate, dtype=torch.float64),
            rtol=0,
            atol=0.05,
        )


def test_refit_solves_the_arrowhead_system_exactly() -> None:
    # Without damping, trust region or bounds in the way, one refit is the ridge Newton step.
    cfg = EstimatorConfig(
        refit_interval=1000, first_refit_interval=1000, damping=0.0, trust_region=1e6,
        max_slope=1e6, max_intercept=1e6,
    )  # fmt: skip
    est = AcceptanceEstimator(3, cfg)
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(20):
        f = torch.randn(8, 3, generator=g, dtype=torch.float64) * 2
        nd = torch.randint(0, 4, (8,), generator=g)
        na = _accepted(torch.sigmoid(2 * f + 0.3), nd, g)  # the slope step is positive
        est.observe(f, nd, na)
        rows.append((f, nd, na))
    w0, b0 = est.slope, est.intercepts.clone()
    # Dense Hessian and gradient of the log-likelihood in (w, b_0, b_1, b_2).
    hess = torch.zeros(4, 4, dtype=torch.float64)
    grad = torch.zeros(4, dtype=torch.float64)
    for f, nd, na in rows:
        for r in range(f.shape[0]):
            for k in range(min(int(na[r]) + 1, int(nd[r]))):
                p = torch.sigmoid(w0 * f[r, k] + b0[k])
                x = torch.zeros(4, dtype=torch.float64)
                x[0], x[1 + k] = f[r, k], 1.0
                hess += p * (1 - p) * torch.outer(x, x)
                grad += (float(k < na[r]) - p) * x
    # The slope's step: the Newton step with ridge lambda_w on the slope alone (every slot has
    # weight here); then each intercept's step given it, with ridge lambda.
    lam_w = cfg.ridge + cfg.slope_ridge * hess.diagonal()[1:].sum()
    dw = torch.linalg.solve(hess + torch.diag(torch.tensor([lam_w, 0.0, 0.0, 0.0])), grad)[0]
    db = (grad[1:] - hess[0, 1:] * dw) / (hess.diagonal()[1:] + cfg.ridge)
    assert bool((hess.diagonal()[1:] > 0).all())
    est.refit()
    assert est.slope - w0 == pytest.approx(float(dw), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(est.intercepts - b0, db, rtol=1e-9, atol=1e-12)


def test_a_feature_constant_within_every_slot_leaves_the_slope_alone() -> None:
    # Slope and intercepts cannot be told apart from such a window: the refit moves only b_k.
    est = AcceptanceEstimator(3, EstimatorConfig(refit_interval=1000, first_refit_interval=1000))
    g = torch.Generator().manual_seed(6)
    f = torch.tensor([[6.0, 2.0, -1.0]]).expand(16, 3)
    for _ in range(30):
        nd = torch.full((16,), 3)
        est.observe(f, nd, _accepted(torch.full((16, 3), 0.9, dtype=torch.float64), nd, g))
    w0, b0 = est.slope, est.intercepts.clone()
    est.refit()
    assert est.slope == pytest.approx(w0, abs=1e-9)
    assert bool((est.intercepts - b0).abs().max() > 0.1)


def test_labels_stop_at_the_first_rejection() -> None:
    cfg = EstimatorConfig(refit_interval=1000)
    est = AcceptanceEstimator(4, cfg)
    f = torch.zeros(3, 4)
    # Row 0: 2 of 3 accepted -> slots 0, 1 (y=1), 2 (y=0). Row 1: none verified. Row 2: 4 of 4.
    est.observe(f, torch.tensor([3, 0, 4]), torch.tensor([2, 0, 4]))
    assert est.total_observations.tolist() == [2, 2, 2, 1]
    # y - p summed per slot at p = sigmoid(-0.2)
    p = torch.sigmoid(torch.tensor(-0.2, dtype=torch.float64))
    expected = [2 * (1 - p), 2 * (1 - p), (1 - p) + (0 - p), 1 - p]
    torch.testing.assert_close(est._s_r, torch.stack(expected))
    assert not est.observe(f, torch.tensor([0, 0, 0]), torch.tensor([0, 0, 0]))
    assert est.observed_steps == 1  # a step that verified nothing is not counted


def test_trust_region_and_bounds_hold() -> None:
    est = AcceptanceEstimator(2, EstimatorConfig(refit_interval=10))
    g = torch.Generator().manual_seed(4)
    nd = torch.full((64,), 2)
    # Confident drafts, all rejected: every refit moves each parameter by at most 1.
    history = [(est.slope, est.intercepts.clone())]
    for _ in range(400):
        f = 10 + torch.rand(64, 2, generator=g)
        est.observe(f, nd, torch.zeros(64, dtype=torch.int64))
        if est.observed_steps % 10 == 0:
            history.append((est.slope, est.intercepts.clone()))
    for (w0, b0), (w1, b1) in zip(history, history[1:], strict=False):
        assert abs(w1 - w0) <= 1.0 + 1e-12
        assert float((b1 - b0).abs().max()) <= 1.0 + 1e-12
    assert 0.0 <= est.slope < 1e-6  # pushed down to (about) the lower bound
    assert float(est.intercepts[0]) == -8.0  # slot 0 saw only rejections: at the bound
    # All accepted with large features: the slope may not pass 4 nor intercepts 8.
    for _ in range(400):
        f = 30 + torch.rand(64, 2, generator=g)
        est.observe(f, nd, nd)
    assert 0.0 <= est.slope <= 4.0
    assert float(est.intercepts.abs().max()) <= 8.0


def test_bad_inputs_raise() -> None:
    with pytest.raises(ConfigError, match="num_positions"):
        AcceptanceEstimator(0)
    with pytest.raises(ConfigError, match="init_slope"):
        AcceptanceEstimator(2, EstimatorConfig(init_slope=5.0))
    est = AcceptanceEstimator(2)
    with pytest.raises(SpeculationInputError, match="features must be"):
        est.predict(torch.zeros(2, 3))
    with pytest.raises(SpeculationInputError, match="num_accepted must lie"):
        est.observe(torch.zeros(2, 2), torch.tensor([1, 1]), torch.tensor([2, 0]))
    with pytest.raises(SpeculationInputError, match="num_draft must be"):
        est.observe(torch.zeros(2, 2), torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    with pytest.raises(SpeculationInputError, match="NaN"):
        est.predict(torch.full((1, 2), math.nan))


# ---------------------------------------------------------------------------------------------
# Exploration and recovery


def test_exploration_after_n_idle_steps() -> None:
    est = AcceptanceEstimator(3)
    est.intercepts[:] = -8.0  # predicts (almost) nothing will be accepted
    n = 5
    verifier = AdaptiveVerifier(est, STEEP, AdaptiveConfig(explore_after=n))
    feats = torch.zeros(4, 3)
    avail = torch.tensor([3, 1, 0, 2])
    for cycle in range(3):
        for _ in range(n):
            assert verifier.choose(feats, avail).tolist() == [0, 0, 0, 0]
            assert not verifier.explored_last_step
        # The (n+1)-th step verifies one draft for every request that has one.
        assert verifier.choose(feats, avail).tolist() == [1, 1, 0, 1]
        assert verifier.explored_last_step
        assert verifier.num_explorations == cycle + 1
    # Steps without any drafts do not count as idle.
    verifier = AdaptiveVerifier(est, STEEP, AdaptiveConfig(explore_after=2))
    for _ in range(5):
        assert verifier.choose(feats, torch.zeros(4, dtype=torch.int64)).tolist() == [0] * 4
    assert verifier.choose(feats, avail).tolist() == [0, 0, 0, 0]
    assert verifier.choose(feats, avail).tolist() == [0, 0, 0, 0]
    assert verifier.choose(feats, avail).tolist() == [1, 1, 0, 1]


def test_exploration_probes_a_starved_deeper_slot() -> None:
    est = AcceptanceEstimator(3)
    est.intercepts[:] = torch.tensor([8.0, -8.0, -8.0], dtype=torch.float64)
    verifier = AdaptiveVerifier(est, STEEP, AdaptiveConfig(explore_after=3))
    feats = torch.zeros(2, 3)
    for _ in range(3):
        assert verifier.choose(feats).tolist() == [1, 1]
    assert verifier.choose(feats).tolist() == [2, 2]
    assert verifier.choose(feats).tolist() == [1, 1]


# A GPU-like profile: a verified token costs a tenth of the fixed step cost.
MILD = CostModel(draft_ms=[(1, 1.0)], verify_ms=[(0, 0.0), (1000, 100.0)])


@pytest.mark.parametrize("explore", [True, False], ids=["exploring", "never_exploring"])
def test_recovers_after_confidently_wrong_drafts(explore: bool) -> None:
    g = torch.Generator().manual_seed(5)
    est = AcceptanceEstimator(4)
    config = AdaptiveConfig(explore_after=8 if explore else 10**9)
    verifier = AdaptiveVerifier(est, MILD, config)
    num_rows = 8
    feats = torch.full((num_rows, 4), 6.0)  # the drafter is confident throughout

    def run(steps: int, rate: float) -> float:
        verified = 0
        for _ in range(steps):
            nd = verifier.choose(feats)
            na = _accepted(torch.full((num_rows, 4), rate, dtype=torch.float64), nd, g)
            verifier.observe(feats, nd, na)
            verified += int(nd.sum())
        return verified / steps / num_rows

    assert run(10, 0.0) == 4.0  # the cold start verifies everything
    # A run of confident drafts that are all wrong: speculation stops.
    run(1500, 0.0)
    assert verifier.choose(feats).sum() == 0
    assert float(est.predict(feats)[0, 0]) < 0.3
    # The drafter turns good. With exploration the estimator gets evidence again and every
    # request is back to verifying (nearly) all 4 drafts, the optimum at a 0.95 rate; without
    # it the wrong fit would stop speculation for good.
    before = verifier.num_explorations
    run(1500, 0.95)
    if explore:
        assert verifier.num_explorations > before
        assert float(est.predict(feats)[0, 0]) > 0.85
        assert run(200, 0.95) > 3.5
    else:
        assert verifier.num_explorations == 0
        assert float(est.predict(feats)[0, 0]) < 0.3
        assert run(200, 0.95) == 0.0
