"""Adaptive verification: how many of its drafts each request verifies this step.

Objective. A step verifies n_r of request r's drafts (0 <= n_r <= its proposed count). With
s_{r,k} = prod_{j<=k} p_{r,j} the estimated chance that slots 0..k are all accepted
(`AcceptanceEstimator.survival`), the step emits in expectation

    tokens(n) = R + sum_r sum_{k < n_r} s_{r,k}

tokens (every request emits one target token plus its accepted drafts), at the cost

    cost(n) = draft_ms(R) + verify_ms(R + other_tokens + sum_r n_r) + overhead_ms

from start-up profiles (`CostModel`), overhead_ms being the rest of a step's wall time (host work
the device waits for), learned from the steps that ran (`CostModel.observe_step`).
`AdaptiveVerifier.choose` returns the n maximizing tokens(n) / cost(n). It is solved exactly: the
cost depends on n only through m = sum_r n_r, and s_{r,k} never grows with k, so for each m the
best n takes the m largest survivals of the batch (a prefix of every row); the best m is found by
trying every m (`optimal_num_draft`).

Graphs. A step of R requests that a captured CUDA graph runs costs what its graph costs: every
request is padded to the graph's query length q (the smallest captured one >= 1 + max_r n_r)
and R to the graph's size, so verify_ms is then `CostModel.graph(size, q)`, measured per graph
at start-up. For a given q every n_r <= q - 1 costs the same, so the best n under graphs verifies
min(proposed_r, q - 1) drafts of every request, for the best q.

Lossless. The choice is a function of draft-distribution features (`draft_feature`), the
estimator's state and the cost tables, never of the drawn draft tokens or the target's logits, so
verifying a shorter prefix leaves the output distribution exactly the target's (each emitted
token is an accepted draft, a residual sample or a bonus sample from p). This holds when the
features of later slots do not depend on earlier drawn tokens: block drafters (DFlash, all slots
from one forward), one-hot drafts (constant feature) and greedy rows (deterministic output). An
autoregressive probabilistic drafter, whose q_{k+1} depends on the drawn d_k, must pass
`context_features(features)` instead: every slot then carries slot 0's feature, which depends on
the context only. (Otherwise whether d_k is verified could depend on d_k through f_{k+1}, and
the output distribution would drift from the target's.)

Exploration. When the estimator predicts too little, the verifier would verify nothing and the
estimator would never see the evidence that could correct it. So after `explore_after`
consecutive steps that had drafts but verified none, one step verifies one draft per request.
The same rule applies deeper: after `explore_after` consecutive steps in which some request could
have verified slot k next but none did, one step extends those requests by one slot.

`synthetic_accept` gives benchmark acceptance at configured per-position rates
(rejection_sample_method="synthetic"): deterministic, keyed like every other random choice.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated

import msgspec
import numpy as np
import torch
from torch import Tensor

from libkk.errors import ConfigError, SpeculationInputError
from libkk.sample.gumbel import keyed_uniform_at
from libkk.spec_decode.estimator import (
    ONE_HOT_FEATURE,
    AcceptanceEstimator,
    _int_rows,
    draft_feature,
)

# Positions salt of the synthetic acceptance uniforms: apart from the target (0), draft (2**30)
# and acceptance (2**31) streams; positions + salt stay below 2**32 for positions < 2**30.
SYNTHETIC_POSITION_SALT = 3 * 2**30


# Requests per step up to which start-up profiles time every captured graph, and the runner
# captures the verification lengths between 1 and 1 + K (larger steps pad to 1 + K).
MAX_PROFILED_REQUESTS = 64


class AdaptiveConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Consecutive steps with a starved slot (drafts available, none verified) before a probe.
    explore_after: Annotated[int, msgspec.Meta(ge=1)] = 8


# ---------------------------------------------------------------------------------------------
# Cost model


class _Curve:
    """Piecewise-linear interpolation of measured (x, ms) points; linear beyond the ends, >= 0."""

    def __init__(self, name: str, points: Sequence[tuple[float, float]]) -> None:
        pts = sorted((float(x), float(y)) for x, y in points)
        if not pts:
            raise ConfigError(f"{name}: at least one (x, ms) point is needed")
        for (x0, _), (x1, _) in zip(pts, pts[1:], strict=False):
            if x0 == x1:
                raise ConfigError(f"{name}: two points at x = {x0}")
        for x, y in pts:
            if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
                raise ConfigError(f"{name}: points must be finite and >= 0, got ({x}, {y})")
        self.points = pts
        self._x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
        self._y = torch.tensor([p[1] for p in pts], dtype=torch.float64)

    def __call__(self, x: Tensor) -> Tensor:
        return torch.from_numpy(self.array(x.detach().double().cpu().numpy()))

    def array(self, x: np.ndarray) -> np.ndarray:
        """The curve at every value of a float64 array."""
        if len(self.points) == 1:
            return np.full(x.shape, self.points[0][1])
        xs, ys = self._x.numpy(), self._y.numpy()
        # Segment i spans points i, i+1; ends extrapolate with their segment's slope.
        i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return np.maximum(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)

    def at(self, x: float) -> float:
        """The same for one value, in plain Python."""
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        i = min(max(bisect.bisect_right([p[0] for p in pts], x) - 1, 0), len(pts) - 2)
        (x0, y0), (x1, y1) = pts[i], pts[i + 1]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class CostModel:
    """Step cost in ms: draft_ms(num_requests) + verify_ms(num_tokens), from measured points;
    for steps a captured graph runs, its measured time instead of verify_ms."""

    def __init__(
        self,
        draft_ms: Sequence[tuple[float, float]],
        verify_ms: Sequence[tuple[float, float]],
        graph_ms: Mapping[tuple[int, int], float] | None = None,
    ) -> None:
        """draft_ms: (requests, ms) points; verify_ms: (tokens in the target forward, ms);
        graph_ms: (size, query length) -> ms of the verification forward replayed from that
        captured graph, for every size and query length captured (a full grid)."""
        self._draft = _Curve("draft_ms", draft_ms)
        self._verify = _Curve("verify_ms", verify_ms)
        # A step's wall time beyond the tables (the host work the device waits for), learned.
        self.overhead_ms = 0.0
        self._graph = {(int(n), int(q)): float(ms) for (n, q), ms in (graph_ms or {}).items()}
        self.graph_sizes = sorted({n for n, _ in self._graph})
        self.graph_query_lens = sorted({q for _, q in self._graph})
        for (n, q), ms in self._graph.items():
            if n < 1 or q < 1 or not math.isfinite(ms) or ms < 0:
                raise ConfigError(f"graph_ms: ({n}, {q}) -> {ms} is not a shape and a time >= 0")
        if len(self._graph) != len(self.graph_sizes) * len(self.graph_query_lens):
            raise ConfigError(
                "graph_ms must hold every (size, query length) of its sizes and lengths"
            )
        # Per size: ms of its graphs in graph_query_lens order (the per-step choice reads rows).
        self._graph_rows = {
            n: np.array([self._graph[n, q] for q in self.graph_query_lens])
            for n in self.graph_sizes
        }

    @property
    def draft_points(self) -> list[tuple[float, float]]:
        return list(self._draft.points)

    @property
    def verify_points(self) -> list[tuple[float, float]]:
        return list(self._verify.points)

    def draft(self, num_requests: int | Tensor | np.ndarray) -> float | Tensor | np.ndarray:
        return _apply(self._draft, num_requests)

    def verify(self, num_tokens: int | Tensor | np.ndarray) -> float | Tensor | np.ndarray:
        return _apply(self._verify, num_tokens)

    def step(self, num_requests: int, num_tokens: int | Tensor) -> float | Tensor:
        """draft(num_requests) + verify(num_tokens)."""
        return self.draft(num_requests) + self.verify(num_tokens)

    def step_ms(self, num_requests: int, num_draft: np.ndarray, other_tokens: int = 0) -> float:
        """The tables' time of a step (no overhead): its graph's when one runs it."""
        shape = self.graph_shape(num_requests, 1 + int(num_draft.max(initial=0)), other_tokens)
        if shape is not None:
            verify_ms = self.graph(*shape)
        else:
            verify_ms = float(self.verify(num_requests + other_tokens + int(num_draft.sum())))
        return float(self.draft(num_requests)) + verify_ms

    def observe_step(self, num_draft: np.ndarray, wall_ms: float, weight: float = 0.1) -> None:
        """Moves overhead_ms toward what a decode step (num_draft [R] drafts verified per
        request, no prefill in it) took beyond the tables, by an exponential average."""
        if num_draft.size:
            extra = max(wall_ms - self.step_ms(num_draft.size, num_draft), 0.0)
            self.overhead_ms += weight * (extra - self.overhead_ms)

    def graph(self, size: int, query_len: int) -> float:
        """ms of the verification forward replayed from the graph of that shape."""
        return self._graph[size, query_len]

    def graph_times(self, size: int) -> np.ndarray:
        """ms of the graphs of that size, one per `graph_query_lens` entry."""
        return self._graph_rows[size]

    def graph_shape(
        self, num_requests: int, max_query_len: int, other_tokens: int = 0
    ) -> tuple[int, int] | None:
        """(size, query length) of the graph that runs a step of these requests, the longest
        asking max_query_len tokens; None when no graph runs it: other tokens in the forward
        (prefill chunks), no graphs, or none that large."""
        if other_tokens or not num_requests:
            return None
        size = next((n for n in self.graph_sizes if n >= num_requests), None)
        q = next((q for q in self.graph_query_lens if q >= max_query_len), None)
        return None if size is None or q is None else (size, q)

    @classmethod
    def profile(
        cls,
        draft_step: Callable[[int], object],
        verify_step: Callable[[int], object],
        request_counts: Sequence[int],
        token_counts: Sequence[int],
        *,
        graph_step: Callable[[int, int], object] | None = None,
        graph_shapes: Sequence[tuple[int, int]] = (),
        warmup: int = 2,
        repeats: int = 5,
        synchronize: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> CostModel:
        """Time draft_step(num_requests) and verify_step(num_tokens) at each count, and
        graph_step(size, query_len) at each of `graph_shapes` (the captured graphs).

        Each point is the median of `repeats` timed calls after `warmup` untimed ones.
        `synchronize` (e.g. torch.cuda.synchronize) runs before the clock is read, so that
        asynchronous device work is counted.
        """
        if graph_shapes and graph_step is None:
            raise ConfigError("graph_shapes need a graph_step to time them")
        if warmup < 0 or repeats < 1:
            raise ConfigError(f"warmup must be >= 0 and repeats >= 1, got {warmup}, {repeats}")
        if not request_counts or not token_counts:
            raise ConfigError("profile needs at least one request count and one token count")

        points = (
            [("draft", draft_step, (n,)) for n in request_counts]
            + [("verify", verify_step, (n,)) for n in token_counts]
            + [("graph", graph_step, shape) for shape in graph_shapes]
        )
        for _ in range(warmup):
            for _, fn, args in points:
                fn(*args)
        # Round robin, repeat after repeat: a drift of the machine's speed (a loaded CPU) then
        # shifts every point alike instead of the ones timed last, and the ratios hold.
        samples: list[list[float]] = [[] for _ in points]
        for _ in range(repeats):
            for times, (_, fn, args) in zip(samples, points, strict=True):
                if synchronize is not None:
                    synchronize()
                start = clock()
                fn(*args)
                if synchronize is not None:
                    synchronize()
                times.append((clock() - start) * 1e3)
        medians = {(kind, args): statistics.median(times)
                   for times, (kind, _, args) in zip(samples, points, strict=True)}  # fmt: skip
        return cls(
            draft_ms=[(n, medians["draft", (n,)]) for n in request_counts],
            verify_ms=[(n, medians["verify", (n,)]) for n in token_counts],
            graph_ms={shape: medians["graph", shape] for shape in graph_shapes},
        )


def _apply(curve: _Curve, x: int | float | Tensor | np.ndarray) -> float | Tensor | np.ndarray:
    if isinstance(x, Tensor):
        return curve(x)
    if isinstance(x, np.ndarray):
        return curve.array(x.astype(np.float64))
    return curve.at(float(x))


# ---------------------------------------------------------------------------------------------
# The choice


def objective(survival: Tensor, num_draft: Tensor, cost: CostModel, other_tokens: int = 0) -> float:
    """tokens(n) / cost(n) of a choice (see the module docstring).

    survival: [R, K] prod_{j<=k} p_j; num_draft: [R] drafts verified per request.
    """
    s = survival.detach().double().cpu().numpy()
    n = num_draft.detach().cpu().long().numpy()
    num_rows, k = s.shape
    taken = np.arange(k)[None, :] < n[:, None]  # [R, K]
    tokens = num_rows + float((s * taken).sum())
    return tokens / (cost.step_ms(num_rows, n, other_tokens) + cost.overhead_ms)


def optimal_num_draft(
    survival: Tensor,
    num_proposed: Tensor,
    cost: CostModel,
    *,
    other_tokens: int = 0,
    max_verify_tokens: int | None = None,
) -> Tensor:
    """The num_draft [R] maximizing `objective`, exactly (ties: the fewest drafts).

    survival: [R, K] non-increasing along K; num_proposed: [R] drafts available per request;
    max_verify_tokens: a cap on R + other_tokens + sum num_draft (the step's token budget).
    A step that graphs run (the cost model has graphs of R requests and 1 + K tokens; no other
    tokens) takes the best uniform cap; under a budget, the best cap that fits it.
    """
    # NOTE: numpy, not torch: a few dozen operations on arrays of ~R * K values, once a step.
    s = survival.detach().double().cpu().numpy()
    avail = num_proposed.detach().cpu().long().numpy()
    num_rows, k = s.shape
    if num_rows == 0 or k == 0:
        return torch.zeros(num_rows, dtype=torch.int64)
    usable = np.arange(k)[None, :] < avail[:, None]  # [R, K]
    if cost.graph_shape(num_rows, 1, other_tokens) is not None:
        chosen = _best_uniform(np.where(usable, s, 0.0), avail, cost, max_verify_tokens)
    else:
        chosen = _best_ragged(s, usable, cost, other_tokens, max_verify_tokens)
    return torch.from_numpy(chosen)


def _best_ragged(
    s: np.ndarray, usable: np.ndarray, cost: CostModel, other_tokens: int, budget: int | None
) -> np.ndarray:
    """Cost by token count: the m largest survivals of the batch for the best m."""
    num_rows = s.shape[0]
    # NOTE: order by survival, ties to the lower slot: flatten slot-major before a stable sort,
    # so the m best always form a prefix of every row.
    values = np.where(usable, s, -1.0).T.reshape(-1)  # [K * R], slot-major
    order = np.argsort(-values, kind="stable")[: int(usable.sum())]
    best_sum = np.concatenate([[0.0], np.cumsum(values[order])])  # [M + 1]
    tokens = num_rows + other_tokens + np.arange(order.size + 1)
    step_ms = float(cost.draft(num_rows)) + cost.verify(tokens) + cost.overhead_ms
    ratio = (num_rows + best_sum) / step_ms
    if budget is not None:
        ratio = np.where(tokens <= budget, ratio, -np.inf)
    best_m = int(ratio.argmax())  # first max: the fewest drafts among equals
    return np.bincount(order[:best_m] % num_rows, minlength=num_rows).astype(np.int64)


def _best_uniform(
    s: np.ndarray, avail: np.ndarray, cost: CostModel, budget: int | None
) -> np.ndarray:
    """Cost by graph: min(proposed, q - 1) drafts of every request for the best captured q."""
    num_rows, k = s.shape
    prefix = np.zeros((num_rows, k + 1))
    np.cumsum(s, axis=1, out=prefix[:, 1:])  # prefix[r, n]: expected accepted of n drafts
    lens = np.asarray(cost.graph_query_lens)  # ascending: the first best has the fewest drafts
    n = np.minimum(avail[None, :], lens[:, None] - 1)  # [Q, R]: each cap's drafts
    gained = prefix[np.arange(num_rows)[None, :], n].sum(axis=1)  # [Q]
    shape = cost.graph_shape(num_rows, 1)
    assert shape is not None  # graphs run this step
    # A cap's step runs the graph of the shortest captured length holding its longest request.
    graph_ms = cost.graph_times(shape[0])[np.searchsorted(lens, 1 + n.max(axis=1))]
    ratio = (num_rows + gained) / (float(cost.draft(num_rows)) + cost.overhead_ms + graph_ms)
    if budget is not None:
        ratio[n.any(axis=1) & (num_rows + n.sum(axis=1) > budget)] = -math.inf
    best = int(ratio.argmax())  # the first maximum
    if ratio[best] == -math.inf:
        return np.zeros(num_rows, dtype=np.int64)
    return n[best].astype(np.int64)


def proposal_features(
    draft_logits: Sequence[Tensor | None], temperatures: Sequence[float], num_positions: int
) -> Tensor:
    """Features [R, K] (CPU fp32) for a `DraftProposal`'s per-request draft logits.

    draft_logits[r]: [n_r, V] raw logits of request r's drafts, or None for one-hot drafts;
    temperatures[r]: its sampling temperature (0 = greedy). Slots without logits, and slots
    beyond n_r, get ONE_HOT_FEATURE.
    """
    if len(draft_logits) != len(temperatures):
        raise SpeculationInputError(
            f"got {len(draft_logits)} draft logits for {len(temperatures)} temperatures"
        )
    out = torch.full((len(draft_logits), num_positions), ONE_HOT_FEATURE)
    for r, (logits, temp) in enumerate(zip(draft_logits, temperatures, strict=True)):
        if logits is None or logits.shape[0] == 0:
            continue
        if logits.dim() != 2 or logits.shape[0] > num_positions:
            raise SpeculationInputError(
                f"draft_logits[{r}] must be [n <= {num_positions}, V], got {tuple(logits.shape)}"
            )
        out[r, : logits.shape[0]] = draft_feature(logits, float(temp)).cpu()
    return out


def context_features(features: Tensor) -> Tensor:
    """Slot 0's feature at every slot.  # [R, K]

    For autoregressive probabilistic drafters (see "Lossless" above): slot 0's distribution
    depends only on the context, so a choice made from these never depends on a drawn draft.
    """
    if features.dim() != 2:
        raise SpeculationInputError(f"features must be [R, K], got {tuple(features.shape)}")
    return features[:, :1].expand(features.shape).clone()


class AdaptiveVerifier:
    """Per step: choose how many drafts each request verifies, then learn from the outcome.

    Engine use, once per step with speculation:
        features = proposal_features(proposal.draft_logits, temperatures, K)   # [R, K]
        # autoregressive probabilistic drafters: features = context_features(features)
        num_draft = verifier.choose(features, num_proposed)     # [R]
        ... verify the first num_draft[r] drafts of each request ...
        verifier.observe(features, num_draft, num_accepted)
    """

    def __init__(
        self,
        estimator: AcceptanceEstimator,
        cost: CostModel,
        config: AdaptiveConfig | None = None,
    ) -> None:
        self.estimator = estimator
        self.cost = cost
        self.config = config if config is not None else AdaptiveConfig()
        # Per slot: consecutive steps in which some request could verify it next and none did.
        self._idle = [0] * estimator.num_positions
        self.explored_last_step = False
        self.num_explorations = 0

    def choose(
        self,
        features: Tensor,
        num_proposed: Tensor | None = None,
        *,
        other_tokens: int = 0,
        max_verify_tokens: int | None = None,
    ) -> Tensor:
        """num_draft [R] int64 (CPU) for draft features [R, K].

        num_proposed: [R] drafts each request has (default K each); other_tokens: tokens of other
        work in the same target forward (prefill chunks), counted in the cost only;
        max_verify_tokens: a cap on the forward's tokens (R + other_tokens + sum num_draft),
        which exploration respects too.
        """
        survival = self.estimator.survival(features)  # [R, K]
        num_rows, k = survival.shape
        if num_proposed is None:
            avail = np.full(num_rows, k, dtype=np.int64)
        else:
            avail = _int_rows("num_proposed", num_proposed, num_rows).numpy()
            if ((avail < 0) | (avail > k)).any():
                raise SpeculationInputError(
                    f"num_proposed must lie in [0, {k}], got {avail.tolist()}"
                )
        chosen = optimal_num_draft(
            survival,
            torch.from_numpy(avail),
            self.cost,
            other_tokens=other_tokens,
            max_verify_tokens=max_verify_tokens,
        ).numpy()
        self.explored_last_step = False
        slots = np.arange(k)
        # Per slot: some request would verify it next / some request verifies it.
        next_here = (avail[:, None] > slots) & (chosen[:, None] == slots)  # [R, K]
        verified = (chosen[:, None] > slots).any(axis=0)  # [K]
        starved = next_here.any(axis=0) & ~verified
        explore_after = self.config.explore_after
        probe = next((i for i in range(k) if starved[i] and self._idle[i] >= explore_after), None)
        if probe is not None:
            rows = np.flatnonzero(next_here[:, probe])
            if max_verify_tokens is not None:
                room = max_verify_tokens - (num_rows + other_tokens + int(chosen.sum()))
                rows = rows[: max(room, 0)]
            if rows.size:
                chosen[rows] += 1
                verified[probe] = True
                starved[probe] = False
                self.explored_last_step = True
                self.num_explorations += 1
        for slot in range(k):
            if starved[slot]:
                self._idle[slot] += 1
            elif verified[slot]:
                self._idle[slot] = 0
        return torch.from_numpy(chosen)

    def observe(self, features: Tensor, num_draft: Tensor, num_accepted: Tensor) -> bool:
        """Feed one step's results to the estimator (see AcceptanceEstimator.observe)."""
        return self.estimator.observe(features, num_draft, num_accepted)


# ---------------------------------------------------------------------------------------------
# Synthetic acceptance (benchmarks)


def synthetic_accept(
    rates: Sequence[float] | Tensor,
    num_draft: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> Tensor:
    """Accept draft k with probability rates[k], stopping at the first rejection.  # [R] int64

    rates: [K] per-slot acceptance rates in [0, 1]; num_draft: [R] drafts verified (<= K);
    seeds: [R] int64; positions: [R] int64 (< 2**30), the position of the first draft.
    Draft k of row r is accepted when keyed_uniform(seed, position + k + salt) < rates[k], so the
    result is deterministic and independent of the batch.
    """
    rate = torch.as_tensor(rates, dtype=torch.float64).reshape(-1)
    k = rate.numel()
    if k == 0 or bool(((rate < 0) | (rate > 1) | rate.isnan()).any()):
        raise SpeculationInputError(f"rates must be K >= 1 values in [0, 1], got {rate.tolist()}")
    num_rows = seeds.shape[0] if seeds.dim() == 1 else -1
    for name, t in (("seeds", seeds), ("positions", positions), ("num_draft", num_draft)):
        if t.dtype != torch.int64 or t.shape != (num_rows,):
            raise SpeculationInputError(
                f"{name} must be int64 [R] like seeds, got {t.dtype} {tuple(t.shape)}"
            )
    if bool(((num_draft < 0) | (num_draft > k)).any()):
        raise SpeculationInputError(f"num_draft must lie in [0, {k}], got {num_draft.tolist()}")
    if bool(((positions < 0) | (positions + k > 2**30)).any()):
        raise SpeculationInputError("positions must lie in [0, 2**30 - K]")
    device = seeds.device
    slots = torch.arange(k, device=device)
    u = keyed_uniform_at(
        seeds.repeat_interleave(k),
        (positions[:, None] + slots[None, :] + SYNTHETIC_POSITION_SALT).reshape(-1),
        torch.zeros(num_rows * k, dtype=torch.int64, device=device),
    ).view(num_rows, k)  # [R, K]
    accept = (u.double() < rate.to(device)[None, :]) & (slots[None, :] < num_draft[:, None])
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def rate_for_acceptance_length(length: float, num_positions: int) -> float:
    """The constant per-slot rate a with 1 + sum_{k=1..K} a^k = length (mean tokens per step).

    length lies in [1, K + 1]; e.g. K = 7 and length 3.5 give a ~= 0.72.
    """
    if num_positions < 1 or not (1.0 <= length <= num_positions + 1):
        raise SpeculationInputError(
            f"length must lie in [1, {num_positions + 1}] for K = {num_positions}, got {length}"
        )
    lo, hi = 0.0, 1.0
    for _ in range(100):  # bisection: the mean length grows with a
        mid = (lo + hi) / 2
        if 1 + sum(mid**i for i in range(1, num_positions + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
