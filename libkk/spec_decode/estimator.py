"""Online estimate of the chance that each draft slot is accepted.

For draft slot k (0-based) of a request the estimator predicts

    p_k = sigmoid(w * f_k + b_k)

with one slope w shared by all slots and one intercept b_k per slot. The feature f_k is a property
of the draft *distribution* q_k, never of the drawn token:

    f_k = logit(max_x q_k(x)) = log(q_max / (1 - q_max)), clamped to [-40, 40]

(`draft_feature`). One-hot drafts (n-gram) and greedy rows carry no confidence information; they
get the constant `ONE_HOT_FEATURE` = 0, so for them p_k = sigmoid(b_k), the slot's base rate.

Labels come from verification: a request that verified n drafts and accepted a of them gives
y = 1 at slots 0 .. a-1, y = 0 at slot a when a < n (the first rejection), and nothing at later
slots (they were never judged).

Fitting is IRLS (Newton on the logistic log-likelihood), online. Each observation adds, at the
current parameters (p = sigmoid(w f + b_k), W = p (1 - p), r = y - p), to its slot's sums

    S_ff = sum W f^2,  S_f = sum W f,  S_w = sum W,  S_rf = sum r f,  S_r = sum r,  n

After a window of `first_refit_interval` steps that observed anything, one Newton step is
solved from the window's sums; each later window is twice as long as the one before, up to
`refit_interval` steps, except after a step that the trust region (below) had to cut: the fit is
far off then (a new session, or drafts that changed), and the next window is the first length
again, so the fit gets there in tens of steps, not hundreds.

The step's Hessian in (w, b_0 .. b_{K-1}) is an arrowhead matrix (a dense first row/column,
diagonal elsewhere), so it solves in closed form (Schur complement on w), with a ridge
lambda_w = lambda + slope_ridge * sum_k S_w[k] on the slope and lambda on the intercepts:

    c_k = S_f[k], sums over the slots with S_w[k] > 0:
    dw  = sum_k (S_rf[k] - c_k S_r[k] / S_w[k]) / (sum_k (S_ff[k] - c_k^2 / S_w[k]) + lambda_w)
    db_k = (S_r[k] - c_k dw) / (S_w[k] + lambda)

dw's numerator and denominator are the window's within-slot covariance of residual and feature
and within-slot feature variance (weighted). When the features do not vary within a slot
(one-hot drafts, or a drafter equally confident at every step), w and b_k cannot be told apart
and dw is 0 (up to rounding); a ridge on the intercepts in dw's formula would instead move w by
an amount the ridge alone decides, which later windows swing back. lambda_w, proportional to the
window's weight, keeps a barely varying feature from driving w, and leaves a slope the data
shows (variance well above slope_ridge) almost unchanged.

The step is then made safe: dw is damped by N / (N + 50) (N = observations in the window), clamped
to |dw| <= 1 (trust region) and w to [0, 4]; the intercepts are re-solved for the dw actually taken
(the exact minimizer of the quadratic model given that dw), damped by n_k / (n_k + 50), clamped to
|db_k| <= 1 and b_k to [-8, 8]. A slot with no observations in the window keeps its intercept.
Because every refit uses only its own window, evidence from a bad stretch (a run of confidently
wrong drafts) is outweighed as soon as new evidence arrives; the adaptive verifier's exploration
(`libkk.spec_decode.adaptive`) makes sure some always does.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
import numpy as np
import torch
from torch import Tensor

from libkk.errors import ConfigError, SpeculationInputError

# The feature of a one-hot draft distribution (n-gram drafts, greedy rows): no information about
# confidence, so the prediction is the slot's intercept alone.
ONE_HOT_FEATURE = 0.0
# |f| bound: logit(max q) of a near-one-hot distribution grows without limit.
FEATURE_CLAMP = 40.0


class EstimatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Observed steps between refits, once the windows have doubled up from the first one.
    refit_interval: Annotated[int, msgspec.Meta(ge=1)] = 100
    first_refit_interval: Annotated[int, msgspec.Meta(ge=1)] = 10
    # Ridge added to the Newton system's diagonal (keeps unobserved slots' steps at 0).
    ridge: Annotated[float, msgspec.Meta(gt=0.0)] = 1e-3
    # The slope's extra ridge, per unit of the window's total weight (see the module docstring).
    slope_ridge: Annotated[float, msgspec.Meta(ge=0.0)] = 1e-2
    # A refit's step is scaled by n / (n + damping) for n observations behind it.
    damping: Annotated[float, msgspec.Meta(ge=0.0)] = 50.0
    # Largest change of any parameter in one refit.
    trust_region: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    max_slope: Annotated[float, msgspec.Meta(gt=0.0)] = 4.0  # w in [0, max_slope]
    max_intercept: Annotated[float, msgspec.Meta(gt=0.0)] = 8.0  # |b_k| <= max_intercept
    init_slope: Annotated[float, msgspec.Meta(ge=0.0)] = 0.5
    init_intercept: float = -0.2


def draft_feature(draft_logits: Tensor, temperatures: Tensor | float) -> Tensor:
    """f = logit(max_x q(x)) for q = softmax(draft_logits / T), clamped to +-40.  # [...]

    draft_logits: [..., V] raw logits (before temperature); temperatures: a float or a tensor of
    the leading shape [...] (broadcastable), 0 = greedy: those rows get ONE_HOT_FEATURE.

    Computed without forming q: with z = logits / T and z* its max,
    logit(q_max) = -log(sum over every other token of exp(z - z*)), stable for any spread.
    """
    if draft_logits.dim() < 1 or draft_logits.shape[-1] < 1:
        raise SpeculationInputError(
            f"draft_logits must be [..., V] with V >= 1, got {tuple(draft_logits.shape)}"
        )
    lead = draft_logits.shape[:-1]
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=draft_logits.device)
    try:
        temps = temps.expand(lead)
    except RuntimeError as e:
        raise SpeculationInputError(
            f"temperatures of shape {tuple(temps.shape)} do not broadcast to {tuple(lead)}"
        ) from e
    if bool((temps < 0).any()):
        raise SpeculationInputError("temperatures must be >= 0")
    greedy = temps == 0
    z = draft_logits.float() / torch.where(greedy, 1.0, temps)[..., None]  # [..., V]
    top = z.argmax(dim=-1, keepdim=True)  # [..., 1]
    rest = (z - z.gather(-1, top)).scatter(-1, top, -math.inf)  # [..., V]; the max left out
    f = -torch.logsumexp(rest, dim=-1)  # [...]; +inf for one-hot q
    f = f.nan_to_num(nan=ONE_HOT_FEATURE).clamp(-FEATURE_CLAMP, FEATURE_CLAMP)
    return torch.where(greedy, ONE_HOT_FEATURE, f)


def feature_from_lse(max_logit: Tensor, lse: Tensor) -> Tensor:
    """logit(q_max) from the row max z* and log-sum-exp of the scaled logits.  # [...]

    For callers that already hold (max, lse) (vocab-parallel drafting): q_max = exp(z* - lse),
    logit(q_max) = -log(exp(lse - z*) - 1), clamped to +-40.
    """
    excess = (lse.double() - max_logit.double()).clamp(min=0.0)  # log(1 / q_max) >= 0
    f = -torch.log(torch.expm1(excess))
    return f.clamp(-FEATURE_CLAMP, FEATURE_CLAMP).float()


class AcceptanceEstimator:
    """p_k = sigmoid(w * f + b_k) per draft slot, refitted online (see the module docstring).

    State lives on the CPU in float64 (K + 1 parameters, 6 K sums); inputs on any device are
    copied there. Not thread-safe: the engine calls it from its step loop only.
    """

    def __init__(self, num_positions: int, config: EstimatorConfig | None = None) -> None:
        if not isinstance(num_positions, int) or num_positions < 1:
            raise ConfigError(f"num_positions must be an int >= 1, got {num_positions!r}")
        self.config = config if config is not None else EstimatorConfig()
        c = self.config
        if abs(c.init_intercept) > c.max_intercept or c.init_slope > c.max_slope:
            raise ConfigError(
                f"init_slope {c.init_slope} / init_intercept {c.init_intercept} lie outside "
                f"[0, {c.max_slope}] / [-{c.max_intercept}, {c.max_intercept}]"
            )
        self.num_positions = num_positions
        self.slope = float(c.init_slope)
        self.intercepts = torch.full((num_positions,), float(c.init_intercept), dtype=torch.float64)
        self.num_refits = 0
        self.observed_steps = 0  # steps that contributed at least one label
        self.total_observations = torch.zeros(num_positions, dtype=torch.int64)
        self._window = min(c.first_refit_interval, c.refit_interval)  # observed steps
        self._next_refit = self._window
        self._reset_window()

    def _reset_window(self) -> None:
        k = self.num_positions
        self._s_ff = torch.zeros(k, dtype=torch.float64)
        self._s_f = torch.zeros(k, dtype=torch.float64)
        self._s_w = torch.zeros(k, dtype=torch.float64)
        self._s_rf = torch.zeros(k, dtype=torch.float64)
        self._s_r = torch.zeros(k, dtype=torch.float64)
        self._n = torch.zeros(k, dtype=torch.float64)

    # NOTE: the per-step methods compute in numpy on views of the float64 state: a few dozen
    # operations on ~R * K values, where torch's per-call overhead would dominate.

    def _features(self, features: Tensor) -> np.ndarray:
        if features.dim() != 2 or features.shape[1] > self.num_positions:
            raise SpeculationInputError(
                f"features must be [R, K] with K <= {self.num_positions}, "
                f"got {tuple(features.shape)}"
            )
        if not features.is_floating_point():
            raise SpeculationInputError(f"features must be floating point, got {features.dtype}")
        f = features.detach().to("cpu", torch.float64).numpy()
        if np.isnan(f).any():
            raise SpeculationInputError("features contain NaN")
        return np.clip(f, -FEATURE_CLAMP, FEATURE_CLAMP)

    def _predict(self, f: np.ndarray) -> np.ndarray:
        z = self.slope * f + self.intercepts.numpy()[: f.shape[1]]
        return 1.0 / (1.0 + np.exp(-z))

    def predict(self, features: Tensor) -> Tensor:
        """p_k for each request and slot.  # [R, K] float64 (CPU)

        features: [R, K] (K <= num_positions; slot k of every row uses intercept b_k).
        """
        return torch.from_numpy(self._predict(self._features(features)))

    def survival(self, features: Tensor) -> Tensor:
        """Chance that slots 0..k are all accepted: prod_{j<=k} p_j.  # [R, K] float64 (CPU)"""
        return torch.from_numpy(np.cumprod(self._predict(self._features(features)), axis=-1))

    def observe(self, features: Tensor, num_draft: Tensor, num_accepted: Tensor) -> bool:
        """Record one step's verification results; returns whether it triggered a refit.

        features: [R, K] the features the drafts were chosen with; num_draft: [R] the drafts each
        request verified (<= K); num_accepted: [R] how many of them were accepted (<= num_draft).
        """
        f = self._features(features)
        num_rows, k = f.shape
        nd = _int_rows("num_draft", num_draft, num_rows).numpy()
        na = _int_rows("num_accepted", num_accepted, num_rows).numpy()
        if ((nd < 0) | (nd > k)).any():
            raise SpeculationInputError(f"num_draft must lie in [0, {k}], got {nd.tolist()}")
        if ((na < 0) | (na > nd)).any():
            raise SpeculationInputError(
                f"num_accepted must lie in [0, num_draft], got {na.tolist()} for {nd.tolist()}"
            )
        slots = np.arange(k)
        # Judged slots: the accepted ones and the first rejection; later slots are unobserved.
        observed = slots[None, :] < np.minimum(na + 1, nd)[:, None]  # [R, K]
        if not observed.any():
            return False
        y = slots[None, :] < na[:, None]  # [R, K]
        p = self._predict(f)  # [R, K]
        w = np.where(observed, p * (1.0 - p), 0.0)
        r = np.where(observed, y - p, 0.0)
        for total, add in (
            (self._s_ff, (w * f * f).sum(0)),
            (self._s_f, (w * f).sum(0)),
            (self._s_w, w.sum(0)),
            (self._s_rf, (r * f).sum(0)),
            (self._s_r, r.sum(0)),
            (self._n, observed.sum(0)),
            (self.total_observations, observed.sum(0)),
        ):
            total.numpy()[:k] += add
        self.observed_steps += 1
        if self.observed_steps < self._next_refit:
            return False
        self.refit()
        return True

    def refit(self) -> None:
        """One damped, trust-region-bounded Newton step from the window's sums; clears them."""
        c = self.config
        n = self._n
        if float(n.sum()) == 0.0:
            return
        steps = []  # each parameter's step before the trust region clamps it
        lam = c.ridge
        diag = self._s_w + lam  # [K]
        cross = self._s_f  # [K]
        # The slope step with the intercepts free: within-slot terms of the slots with weight.
        seen = self._s_w > 0
        s_w = torch.where(seen, self._s_w, 1.0)
        variance = float((self._s_ff - torch.where(seen, cross * cross / s_w, 0.0)).sum())
        covariance = float((self._s_rf - torch.where(seen, cross * self._s_r / s_w, 0.0)).sum())
        lam_w = lam + c.slope_ridge * float(self._s_w.sum())
        # NOTE: the variance is >= 0 up to rounding, so the denominator is about lam_w or more.
        dw = covariance / max(variance + lam_w, lam * 1e-6)
        total = float(n.sum())
        dw *= total / (total + c.damping)
        steps.append(abs(dw))
        dw = max(-c.trust_region, min(c.trust_region, dw))
        new_slope = max(0.0, min(c.max_slope, self.slope + dw))
        dw = new_slope - self.slope
        # Intercepts re-solved for the slope step actually taken.
        db = (self._s_r - cross * dw) / diag  # [K]
        db = db * (n / (n + c.damping))
        steps.append(float(db.abs().max()))
        db = db.clamp(-c.trust_region, c.trust_region)
        self.slope = new_slope
        self.intercepts = (self.intercepts + db).clamp(-c.max_intercept, c.max_intercept)
        self.num_refits += 1
        # The next window: back to the first length while steps hit the trust region (the fit
        # is far off: a new session, or the drafts changed), else twice as long, up to
        # refit_interval.
        first = min(c.first_refit_interval, c.refit_interval)
        far = max(steps) > c.trust_region
        self._window = first if far else min(2 * self._window, c.refit_interval)
        self._next_refit = self.observed_steps + self._window
        self._reset_window()


def _int_rows(name: str, t: Tensor, num_rows: int) -> Tensor:
    if not isinstance(t, Tensor) or t.shape != (num_rows,) or t.is_floating_point():
        raise SpeculationInputError(
            f"{name} must be an integer tensor of shape [{num_rows}], got "
            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
        )
    return t.detach().to("cpu", torch.int64)
