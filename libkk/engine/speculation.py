"""Speculative decoding in the engine: one `Speculation` object, built once from the config, owns
the proposer, adaptive verification and (under tensor parallelism) the calls every rank makes;
`NoSpeculation` stands in when speculation is off, so the engine checks nothing per feature.

The engine calls it at fixed points: `after_step` once a step's tokens are appended (drafts for
each request that goes on: the proposer's, cut by adaptive verification), `learn` while the
device runs the next step, `drop` when a request ends or is preempted, `stats` for the session.

With `adaptive_verification=True`, after the proposer drafts, `AdaptiveDrafts.trim` asks the
`AdaptiveVerifier` (libkk/spec_decode/adaptive.py) for each request's draft count, from the draft
distributions' features, the online acceptance estimate and the step costs, and cuts the drafts
to it; after the step, `observe` takes each request's verified and accepted counts, which `learn`
feeds to the estimator while the device runs the next step. Trimming only decides how many drafts
are verified, from features of the draft distributions (never of the drawn tokens), so the output
keeps the target's distribution.

Structured output: proposers draw without the grammar (`_drafting_row`), and the drafts of a
constrained request are cut at the first token its grammar forbids, with the masks of the rows
that verify them, as soon as they are taken (`Request.constrain_drafts`), before any trim.

The step costs are profiled once at start-up (`profile_costs`): the target forward over n tokens
of a request in the null block (verify cost vs tokens, for steps no graph runs), every captured
decode/verification graph replayed on padding rows with its logits (verify cost per graph), and
the proposer drafting for r stand-in requests whose context is in place (draft cost vs
requests; their state is removed afterwards).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from libkk.config import EngineConfig
from libkk.distributed import get_tp_size
from libkk.engine.request import Request, RequestStatus
from libkk.engine.scheduler import Scheduler
from libkk.layers.forward_context import null_prefill_metadata, set_forward_context
from libkk.runtime.io import RunnerOutput, SchedulerOutput
from libkk.runtime.model_runner import ModelRunner
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import SamplingRow
from libkk.spec_decode import LOOK_DRAFTS
from libkk.spec_decode.adaptive import (
    MAX_PROFILED_REQUESTS,
    AdaptiveVerifier,
    CostModel,
    context_features,
    proposal_features,
)
from libkk.spec_decode.base import Proposer, ProposeRequest
from libkk.spec_decode.estimator import AcceptanceEstimator

logger = logging.getLogger(__name__)

_PROFILE_PREFIX = "__libkk_profile_"


class AdaptiveDrafts:
    def __init__(
        self, cost: CostModel, num_speculative_tokens: int, autoregressive_sampling: bool
    ) -> None:
        """cost: the step costs (`profile_costs`); autoregressive_sampling: the drafter draws each
        draft from a distribution that depends on the earlier drawn drafts (a probabilistic draft
        model): slot 0's feature stands for every slot then, so the choice never depends on a
        drawn token."""
        logger.info(
            "adaptive verification costs (ms): draft %s, verify %s",
            [(int(n), round(ms, 3)) for n, ms in cost.draft_points],
            [(int(n), round(ms, 3)) for n, ms in cost.verify_points],
        )
        verifier = AdaptiveVerifier(AcceptanceEstimator(num_speculative_tokens), cost)
        self.verifier = verifier
        self.autoregressive_sampling = autoregressive_sampling
        self.num_positions = verifier.estimator.num_positions
        self._features: dict[str, torch.Tensor] = {}  # request id -> [K] features of its drafts
        # Taken by observe / record_step, not yet learned from: (features, verified, accepted)
        # per step, and (drafts per request, wall ms) per decode step.
        self._observed: list[tuple[list[torch.Tensor], list[int], list[int]]] = []
        self._timed: list[tuple[np.ndarray, float]] = []

    def trim(self, requests: Sequence[Request]) -> None:
        """Cuts each request's drafts to the verifier's choice; remembers their features."""
        requests = [r for r in requests if r.spec_token_ids]
        if not requests:
            return
        features = proposal_features(
            [r.draft_logits for r in requests],
            [r.params.temperature for r in requests],
            self.num_positions,
        )  # [R, K]
        if self.autoregressive_sampling:
            features = context_features(features)
        num_proposed = torch.tensor([len(r.spec_token_ids) for r in requests])
        chosen = self.verifier.choose(features, num_proposed).tolist()
        for request, row, n in zip(requests, features, chosen, strict=True):
            self._features[request.request_id] = row
            if n == 0:
                request.clear_drafts()
                continue
            request.spec_token_ids = request.spec_token_ids[:n]
            if request.draft_logits is not None:
                request.draft_logits = request.draft_logits[:n]

    def observe(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> None:
        """Takes the verified and accepted draft counts of this step for the estimator; `learn`
        feeds them to it."""
        rows, verified, accepted = [], [], []
        for scheduled in sched_out.requests:
            row = self._features.pop(scheduled.request_id, None)
            tokens = runner_out.sampled_token_ids.get(scheduled.request_id)
            if row is None or tokens is None:
                continue
            rows.append(row)
            verified.append(scheduled.num_spec_tokens)
            accepted.append(len(tokens) - 1)  # the accepted drafts, then one target token
        if rows:
            self._observed.append((rows, verified, accepted))

    def record_step(self, sched_out: SchedulerOutput, seconds: float) -> None:
        """Takes a decode step's wall time (schedule to proposal) for the cost model's overhead;
        steps with prompt tokens are left out. `learn` feeds it to the model."""
        requests = sched_out.requests
        if any(r.num_new_tokens != 1 + r.num_spec_tokens for r in requests):
            return
        drafts = np.fromiter((r.num_spec_tokens for r in requests), np.int64, len(requests))
        self._timed.append((drafts, seconds * 1e3))

    def learn(self) -> None:
        """Feeds what `observe` and `record_step` took to the estimator and the cost model.

        The engine calls it while the device runs the next step: the next choice is then made
        without the last step's outcome (one step late, which an online estimate refitted every
        10 to 100 steps does not feel), and the work leaves the path between a step's read-back
        and the next launch."""
        for rows, verified, accepted in self._observed:
            self.verifier.observe(torch.stack(rows), torch.tensor(verified), torch.tensor(accepted))
        for drafts, ms in self._timed:
            self.verifier.cost.observe_step(drafts, ms)
        self._observed.clear()
        self._timed.clear()

    def forget(self, request_id: str) -> None:
        self._features.pop(request_id, None)


@dataclasses.dataclass
class _Backoff:
    accepted: float = 0.0  # drafts accepted, older verifications decayed
    rejected: float = 0.0  # verifications that rejected a draft, decayed alike
    skip: int = 0  # steps left without drafts
    wait: int = 0  # the next pause
    looked: bool = False  # verified drafts at least once (else its next drafts are a look)


class DraftBackoff:
    """Stops drafting for a request whose drafts do not pay for themselves, then looks again.

    Each draft is taken to be accepted with one rate a: from a request's verifications (drafts
    accepted, and whether one was rejected; older verifications decayed by DECAY each) a is
    estimated as (accepted + 1) / (accepted + rejected + 2), which one unlucky verification does
    not push far, and k drafts are worth (1 - a^(k+1)) / (1 - a) tokens a verification. In a
    step of n requests, a request drafts `num_drafts` (K) while K drafts are worth
    `break_even(n, K)` (a step of n requests that draft and verify K each over a plain step of
    n, in time, measured at start-up: near 1 for one request on a GPU, about 2 for 32, where the
    verification's tokens make the forward compute-bound); below it, it drafts nothing for a
    pause, then looks: it drafts LOOK_DRAFTS, as it does at its first step. A look emits its
    expected length where plain steps would have emitted `break_even(n, LOOK_DRAFTS)` tokens in
    its time: the pause is long enough for looks to lose LOOK_LOSS of the request's tokens at
    that rate, and at least doubles each time (FIRST_PAUSE up to MAX_PAUSE steps). Greedy output
    is the plain output whatever is decided; which steps verify drafts depends on the batch.
    """

    DECAY = 0.9
    FIRST_PAUSE, MAX_PAUSE = 8, 128
    LOOK_DRAFTS = LOOK_DRAFTS
    LOOK_LOSS = 0.01

    def __init__(self, break_even: Callable[[int, int], float], num_drafts: int) -> None:
        """break_even(num_requests, num_drafts): the acceptance length at which a step of
        num_requests requests drafting num_drafts each pays (`break_even_length`)."""
        self._break_even = functools.cache(break_even)
        self.num_drafts = num_drafts
        self._requests: dict[str, _Backoff] = {}

    def break_even(self, num_requests: int, num_drafts: int) -> float:
        return self._break_even(max(num_requests, 1), num_drafts)

    def drafts_next(self, request_id: str) -> bool:
        """Whether the next `drafts_for` of the request gives drafts (it is not paused)."""
        state = self._requests.get(request_id)
        return state is None or state.skip == 0

    def drafts_for(self, request_id: str, num_requests: int) -> int:
        """The drafts the request may propose for its next step, in a step of about
        num_requests requests: K while drafting pays, a look's at its first step and after a
        pause, 0 while paused (counting the step)."""
        state = self._requests.get(request_id)
        if not self.drafts_next(request_id):
            state.skip -= 1
            return 0
        if state is not None and state.looked and self._pays(state, num_requests):
            return self.num_drafts
        return self.LOOK_DRAFTS

    def observe(
        self, request_id: str, num_emitted: int, num_verified: int, num_requests: int
    ) -> None:
        """A verification of `num_verified` drafts of the request, in a step of num_requests
        requests, emitted `num_emitted` tokens (the accepted drafts and one more)."""
        state = self._requests.setdefault(request_id, _Backoff())
        accepted = num_emitted - 1
        state.accepted = self.DECAY * state.accepted + accepted
        state.rejected = self.DECAY * state.rejected + (accepted < num_verified)
        state.looked = True
        if self._pays(state, num_requests):
            state.wait = state.skip = 0
            return
        # A pause of P plain steps and a look of look_break_even steps' time lose `loss` tokens.
        look_break_even = self.break_even(num_requests, self.LOOK_DRAFTS)
        loss = max(look_break_even - self.expected_length(state, self.LOOK_DRAFTS), 0.0)
        pause = max(loss / self.LOOK_LOSS - look_break_even, 2 * state.wait, self.FIRST_PAUSE)
        state.wait = state.skip = int(min(pause, self.MAX_PAUSE))

    def _pays(self, state: _Backoff, num_requests: int) -> bool:
        k = self.num_drafts
        return self.expected_length(state, k) >= self.break_even(num_requests, k)

    def expected_length(self, state: _Backoff, num_drafts: int) -> float:
        """Tokens a verification of num_drafts drafts emits at the request's estimated rate."""
        rate = (state.accepted + 1) / (state.accepted + state.rejected + 2)
        return sum(rate**i for i in range(num_drafts + 1))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def break_even_length(cost: CostModel, num_requests: int, num_drafts: int) -> float:
    """The acceptance length at which drafting pays for a step of num_requests requests that
    draft num_drafts each: that step's time over a plain step's (captured graphs' times where
    the steps replay graphs)."""
    drafting = cost.step_ms(num_requests, np.full(num_requests, num_drafts))
    plain = cost.step_ms(num_requests, np.zeros(num_requests, np.int64))
    plain -= float(cost.draft(num_requests))
    # Never below 1: a drafting step cheaper than a plain one is a timing fluke (then drafting
    # always goes on).
    return max(drafting / max(plain, 1e-9), 1.0)


class Speculation:
    """The engine's one speculative-decoding component (see the module docstring)."""

    def __init__(
        self,
        proposer: Proposer,
        adaptive: AdaptiveDrafts | None,
        *,
        num_speculative_tokens: int,
        max_model_len: int,
        vocab_size: int,
        backoff: DraftBackoff | None = None,
    ) -> None:
        self.proposer = proposer
        self.adaptive = adaptive
        self.backoff = backoff
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def after_step(
        self,
        sched_out: SchedulerOutput,
        runner_out: RunnerOutput,
        updated: list[Request],
        live: dict[str, Request],
    ) -> None:
        """Drafts for the next step of every request that sampled and goes on. `live`: the
        scheduler's unfinished requests."""
        for rid in sched_out.preempted_request_ids:
            self.drop(rid)
        if self.adaptive is not None:
            self.adaptive.observe(sched_out, runner_out)
        # The backoff's break-evens are those of a step of this one's size (the next is
        # about as large).
        batch = len(sched_out.requests)
        if self.backoff is not None:
            for scheduled in sched_out.requests:
                tokens = runner_out.sampled_token_ids.get(scheduled.request_id)
                if scheduled.num_spec_tokens and tokens:
                    self.backoff.observe(
                        scheduled.request_id, len(tokens), scheduled.num_spec_tokens, batch
                    )
        for rid, (start, hidden) in runner_out.aux_hidden.items():
            request = live.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.proposer.add_context(rid, start, hidden)
        asks: list[tuple[Request, ProposeRequest]] = []
        for request in updated:
            if request.finished:
                self.drop(request.request_id)
                continue
            allowed = (
                self.num_speculative_tokens
                if self.backoff is None
                else self.backoff.drafts_for(request.request_id, batch)
            )
            max_drafts = min(
                allowed,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if max_drafts > 0:
                # The live token list, not a copy (O(length) per request and step): proposers
                # read it during the call only.
                ask = ProposeRequest(
                    request.request_id, request.all_token_ids, _drafting_row(request), max_drafts
                )
                asks.append((request, ask))
        if asks:
            self._take_drafts(asks)

    def _take_drafts(self, asks: list[tuple[Request, ProposeRequest]]) -> None:
        proposal = self.proposer.propose([ask for _, ask in asks])
        for (request, ask), drafts, logits in zip(
            asks, proposal.token_ids, proposal.draft_logits, strict=True
        ):
            drafts = [int(t) for t in drafts[: ask.max_drafts]]
            if not drafts or any(not 0 <= t < self.vocab_size for t in drafts):
                request.clear_drafts()
                continue
            request.spec_token_ids = drafts
            request.draft_logits = None if logits is None else logits[: len(drafts)]
            request.constrain_drafts()  # structured output: cut where the grammar refuses
        if self.adaptive is not None:
            self.adaptive.trim([request for request, _ in asks])

    def drafts_next(self, request: Request) -> bool:
        """Whether the request may draft once its in-flight step is done: the engine then
        finishes that step before scheduling the next (asynchronous scheduling runs ahead of
        paused requests only)."""
        return self.backoff is None or self.backoff.drafts_next(request.request_id)

    def record_step(self, sched_out: SchedulerOutput, seconds: float) -> None:
        """A step's wall time, schedule to proposal (adaptive verification's overhead)."""
        if self.adaptive is not None:
            self.adaptive.record_step(sched_out, seconds)

    def learn(self) -> None:
        """What the last steps taught adaptive verification (while the device runs)."""
        if self.adaptive is not None:
            self.adaptive.learn()

    def drop(self, request_id: str) -> None:
        """Forgets a request's draft state (it finished or was preempted)."""
        self.proposer.remove(request_id)
        if self.adaptive is not None:
            self.adaptive.forget(request_id)
        if self.backoff is not None:
            self.backoff.forget(request_id)

    def stats(self, scheduler: Scheduler) -> dict[str, int | float]:
        """Drafts verified and accepted, and the mean acceptance length (tokens emitted per
        request-step that verified drafts)."""
        rows = scheduler.num_verify_rows
        return {
            "spec_num_draft_tokens": scheduler.num_draft_tokens,
            "spec_num_accepted_tokens": scheduler.num_accepted_tokens,
            "spec_num_verify_steps": rows,
            "spec_mean_acceptance_length": (scheduler.num_verified_emitted / rows if rows else 0.0),
        }


def _drafting_row(request: Request) -> SamplingRow:
    """The row a proposer drafts with: the request's, without its grammar mask. Drafters draw
    without the grammar on every rank (a tensor-parallel worker has no matcher to advance along
    the drafts), so that verification knows each draft's law: q, restricted to the tokens the
    grammar allows once `Request.constrain_drafts` has cut the drafts it forbids."""
    row = request.sampling_row()
    if row.grammar_mask is None:
        return row
    return dataclasses.replace(row, grammar_mask=None)


class NoSpeculation(Speculation):
    """Speculation off: every call does nothing."""

    def __init__(self) -> None:
        self.proposer = None
        self.adaptive = self.backoff = None

    def after_step(self, sched_out, runner_out, updated, live) -> None:  # noqa: ANN001
        pass

    def drafts_next(self, request: Request) -> bool:
        return False

    def record_step(self, sched_out: SchedulerOutput, seconds: float) -> None:
        pass

    def learn(self) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass

    def stats(self, scheduler: Scheduler) -> dict[str, int | float]:
        return {}


def build_speculation(
    config: EngineConfig,
    proposer: Proposer | None,
    runner: ModelRunner,
    *,
    max_model_len: int,
    hidden_size: int,
    vocab_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Speculation:
    """The engine's speculation for `config` (its proposer built by the rank; the cost profile
    of adaptive verification runs here, on `runner`)."""
    spec = config.speculative
    if proposer is None:
        return NoSpeculation()
    # Backoff and adaptive verification time steps on this rank alone: one process only.
    backs_off = spec.draft_backoff and get_tp_size() == 1
    cost = None
    if spec.adaptive_verification or backs_off:
        # The backoff alone reads break-evens at a few batch sizes, with steadier figures: the
        # graphs of powers of two (each stands for the sizes up to it), the forward without
        # graphs for one request.
        powers = _counts(min(config.scheduler.max_num_seqs, MAX_PROFILED_REQUESTS))
        backoff_only = {"warmup": 2, "repeats": 7, "graph_sizes": powers}
        cost = profile_costs(
            runner,
            proposer,
            num_speculative_tokens=spec.num_speculative_tokens,
            max_num_seqs=config.scheduler.max_num_seqs if spec.adaptive_verification else 1,
            block_size=config.cache.block_size,
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            device=device,
            dtype=dtype,
            **({} if spec.adaptive_verification else backoff_only),
        )
    adaptive = backoff = None
    if spec.adaptive_verification:
        adaptive = AdaptiveDrafts(
            cost,
            spec.num_speculative_tokens,
            autoregressive_sampling=(
                spec.method == "draft_model" and spec.draft_sampling == "probabilistic"
            ),
        )
    if backs_off:
        k = spec.num_speculative_tokens
        # Break-evens are read where steps were timed: the profiled graphs' sizes, or one
        # request where no graph runs (a forward's time beyond the timed token counts is a
        # guess); a larger batch takes the largest size's.
        sizes = cost.graph_sizes or [1]

        def break_even(num_requests: int, num_drafts: int) -> float:
            return break_even_length(cost, min(num_requests, sizes[-1]), num_drafts)

        backoff = DraftBackoff(break_even, k)
        logger.info(
            "drafting pays from an acceptance length of %s (a look: %s) at batch %s",
            *([round(break_even(n, d), 2) for n in sizes] for d in (k, LOOK_DRAFTS)),
            sizes,
        )
    return Speculation(
        proposer,
        adaptive,
        num_speculative_tokens=spec.num_speculative_tokens,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        backoff=backoff,
    )


def _counts(limit: int) -> list[int]:
    """1, 2, 4, ... up to limit, and limit itself."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    return [*out, limit]


# NOTE: no_grad, not inference_mode, around the proposer: it may grow its KV pool here, and
# tensors made under inference_mode could not be written by the steps that follow (they propose
# outside it).
@torch.no_grad()
def profile_costs(
    runner: ModelRunner,
    proposer: Proposer,
    *,
    num_speculative_tokens: int,
    max_num_seqs: int,
    block_size: int,
    hidden_size: int,
    vocab_size: int,
    device: torch.device,
    dtype: torch.dtype,
    warmup: int = 1,
    repeats: int = 3,
    graph_sizes: Sequence[int] | None = None,
) -> CostModel:
    """Start-up cost tables: the target forward and logits over n tokens (up to max_num_seqs
    requests' verifications), each captured graph of up to max_num_seqs requests (replay and
    logits), the proposer over r requests (as many as either), all up to MAX_PROFILED_REQUESTS
    requests.
    `graph_sizes`, when given, are the graph sizes timed instead (those captured among them)."""
    k = num_speculative_tokens
    max_tokens = min(max_num_seqs, MAX_PROFILED_REQUESTS) * (1 + k)
    captured = [(n, q) for n, q in runner.graph_shapes() if n <= MAX_PROFILED_REQUESTS]
    if graph_sizes is None:
        graph_shapes = [(n, q) for n, q in captured if n <= max_num_seqs]
    else:
        graph_shapes = [(n, q) for n, q in captured if n in graph_sizes]
    max_requests = max([min(max_num_seqs, MAX_PROFILED_REQUESTS)] + [n for n, _ in graph_shapes])
    forward = runner.forward
    context = list(range(1, 17))  # stand-in prompt; ids past the vocabulary are never drawn
    context = [t % vocab_size for t in context]

    def verify_step(n: int) -> None:
        # inference_mode and inference-tensor inputs as the runner's steps: a compiled forward
        # guards on the grad mode and on its inputs' dispatch keys
        with (
            torch.inference_mode(),
            set_forward_context(
                null_prefill_metadata(n, block_size, device, runner.num_kv_groups), runner.model
            ),
        ):
            ids = torch.zeros(n, dtype=torch.int64, device=device)
            positions = torch.arange(n, dtype=torch.int64, device=device)
            # every verified position's logits (a graph's time includes them too)
            runner.model.compute_logits(forward(ids, positions))

    width = len(getattr(proposer, "target_layer_ids", ())) * hidden_size
    row = SamplingRow(
        params=SamplingParams(temperature=0.0),
        seed=0,
        position=len(context),
        prompt_token_ids=context,
        output_token_ids=[],
        banned_token_ids=(),
    )
    ids = [f"{_PROFILE_PREFIX}{i}" for i in range(max_requests)]
    if width:  # model drafters read the target's hidden states of the context first
        hidden = torch.zeros(len(context), width, device=device, dtype=dtype)
        for rid in ids:
            proposer.add_context(rid, 0, hidden)

    def draft_step(r: int) -> None:
        proposer.propose([ProposeRequest(rid, list(context), row, k) for rid in ids[:r]])

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    try:
        return CostModel.profile(
            draft_step,
            verify_step,
            _counts(max_requests),
            _counts(max_tokens),
            graph_step=runner.verify_on_graph,
            graph_shapes=graph_shapes,
            warmup=warmup,
            repeats=repeats,
            synchronize=sync,
        )
    finally:
        for rid in ids:
            proposer.remove(rid)
