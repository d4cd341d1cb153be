"""Continuous batching under one token budget per step.

Each step gives each scheduled request a number of tokens: running requests first (in admission
order), then waiting ones. A request that cannot get KV blocks preempts the newest running request
(recompute: its blocks are freed, it goes back to the front of the queue and later recomputes its
prompt and output). Chunked prefill, prefix hits and resumption after preemption are only different
counts in the same model.

With `prefill_compute_share = s`, the two classes of work (prefill: requests that owe more than one
token; decode: requests that owe exactly one) are weighted-fair-queued by measured step time while
both have work: a step runs one class only, the one with the smaller virtual runtime, and its time
is charged as elapsed / s (prefill) or elapsed / (1 - s) (decode). Without contention each class
runs freely.

Speculative drafts (`Request.spec_token_ids`) ride on a decode: it is scheduled for 1 + n tokens,
the drafts trimmed to the step's budget and to what max_tokens leaves, and their KV slots
allocated like any other. After verification `num_computed_tokens` counts the anchor and the
accepted drafts only; rejected drafts' slots are overwritten by later tokens. Preemption drops
drafts.

KV blocks are asked for step by step (`allocate_slots` for the step's tokens). In a KV group
whose layers have a sliding window the cache manager first releases the request's blocks before
its window, so there a request needs blocks for its window and its step, not its whole length; the
scheduler assumes only that an allocation either fits or changes nothing, and tells the manager
when a step has finished (`step_finished`), after which that step's window may be released.

Every step goes the same way: counts advance when it is launched (`after_launch`: its tokens are
computed, drafts aside, and a sampling request's next token is in flight,
`Request.num_pending_tokens`), and `append` takes its tokens when they reach the host. Async
scheduling (engine.py) schedules step k before step k-1's tokens arrive: the in-flight token is a
placeholder in the scheduled token ids, and a request whose in-flight tokens reach max_tokens is
not scheduled again. A step's time is charged to the prefill / decode share when its tokens
arrive.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from libkk.cache.kv_cache_manager import KVCacheManager
from libkk.config import SchedulerConfig
from libkk.engine.request import Request, RequestStatus
from libkk.engine.timeline import Timeline
from libkk.runtime.io import (
    DECODE_STEP,
    PLACEHOLDER_TOKEN_ID,
    PREFILL_STEP,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from libkk.sample.grammar import compute_next_masks

PREFILL, DECODE = PREFILL_STEP, DECODE_STEP
# "auto" share: bounds and the most it moves per step.
AUTO_SHARE_MIN, AUTO_SHARE_MAX, AUTO_SHARE_RATE = 0.2, 0.8, 0.02


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        share = config.prefill_compute_share
        self.share: float | None = 0.5 if share == "auto" else share
        self.vruntime = {PREFILL: 0.0, DECODE: 0.0}
        self.num_preemptions = 0
        # Speculative decoding: drafts verified, accepted, request-steps that verified drafts and
        # tokens those steps emitted (before stop truncation).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_rows = 0
        self.num_verified_emitted = 0

    # ---- queue ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (abort, stop string, error) and frees its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.finished:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.clear_drafts()
        request.num_pending_tokens = 0  # an in-flight token of a finished request is dropped
        request.status = status
        request.timeline.finished = time.monotonic()
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = time.monotonic()
        has_decode, has_prefill = False, bool(self.waiting)
        for r in self.running:  # one pass: these properties are read per request and step
            if not r.is_decode:
                has_prefill = True
            elif not has_decode:
                has_decode = not r.reaches_length_in_flight
        step_class = self._pick_class(has_prefill, has_decode)
        budget = cfg.scheduled_token_cap
        if cfg.uncap_prefill_only_steps and (not has_decode or step_class == PREFILL):
            budget = cfg.max_num_batched_tokens

        out = SchedulerOutput(
            kind=step_class
            or ("mixed" if has_decode and has_prefill else DECODE if has_decode else PREFILL)
        )
        scheduled: dict[str, int] = {}
        budget = self._schedule_running(step_class, budget, scheduled, out)
        if step_class != DECODE:
            self._schedule_waiting(budget, scheduled, now)
        # The masks the scheduled grammar rows sample with, all at once (a token in flight: later).
        compute_next_masks(
            r.grammar
            for r in self.running
            if r.grammar is not None and r.num_pending_tokens == 0 and r.request_id in scheduled
        )
        for request in self.running:
            num_new = scheduled.get(request.request_id)
            if num_new is not None:
                out.requests.append(self._scheduled_request(request, num_new))
                request.timeline.last_progress = now
        return out

    def _schedule_running(
        self, step_class: str | None, budget: int, scheduled: dict[str, int], out: SchedulerOutput
    ) -> int:
        """Running requests first, oldest first; the newest are preempted when blocks run out.
        Fills `scheduled` (request id -> tokens); returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if step_class is not None and (DECODE if request.is_decode else PREFILL) != step_class:
                i += 1
                continue
            num_new = min(request.num_owed_tokens, budget)
            if num_new == 0 or request.reaches_length_in_flight:
                i += 1
                continue
            if request.spec_token_ids:
                num_new += self._trim_drafts(request, budget - num_new)
            while self.kv_cache.allocate_slots(request, num_new) is None:
                if request.spec_token_ids:
                    # Out of blocks: give up the drafts before preempting anyone.
                    num_new -= len(request.spec_token_ids)
                    request.clear_drafts()
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing newer is left to run
        return budget

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int], now: float) -> None:
        """Then waiting requests, in arrival order (preempted ones were put back in front)."""
        cfg = self.config
        j = 0  # skips only requests preempted with their last token in flight
        while j < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[j]
            if request.reaches_length_in_flight:
                j += 1  # finishes when its token arrives: recomputing it would be wasted
                continue
            hit_blocks, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            if self.kv_cache.allocate_slots(request, num_new, hit_blocks) is None:
                break
            del self.waiting[j]
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if request.timeline.first_scheduled is None:
                request.timeline.first_scheduled = now
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new

    def _trim_drafts(self, request: Request, room: int) -> int:
        """Keeps at most `room` drafts, and no more than max_tokens leaves room for (n drafts
        can add n + 1 tokens); returns how many are kept."""
        n = min(
            len(request.spec_token_ids), room, request.max_tokens - request.num_output_tokens - 1
        )
        n = max(n, 0)
        if n < len(request.spec_token_ids):
            request.spec_token_ids = request.spec_token_ids[:n]
            if request.draft_logits is not None:
                request.draft_logits = request.draft_logits[:n] if n else None
        if n == 0:
            request.clear_drafts()
        return n

    def _scheduled_request(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        spec = request.spec_token_ids
        num_new -= len(spec)
        sampling = None
        if start + num_new == request.num_tokens:
            sampling = request.sampling_row()
        token_ids = request.all_token_ids[start : start + num_new]
        # Async scheduling: the token the previous step samples is not known yet.
        num_in_flight = num_new - len(token_ids)
        assert num_in_flight <= 1, "only the previous step's token can be in flight"
        if num_in_flight:
            token_ids.append(PLACEHOLDER_TOKEN_ID)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids + spec,
            num_computed_tokens=start,
            block_tables=self.kv_cache.get_block_tables(request.request_id),
            sampling=sampling,
            spec_token_ids=list(spec),
            draft_logits=request.draft_logits,
            draft_grammar_masks=request.verified_grammar_masks(),
            last_token_in_flight=num_in_flight == 1,
        )

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        request.clear_drafts()
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

    # ---- after a step is launched, and when its tokens arrive ------------------------------

    def after_launch(self, sched_out: SchedulerOutput) -> dict[str, Request]:
        """Advances the counts of a launched step whose tokens are not known yet: its tokens
        are computed (drafts only once accepted) and each sampling request has one token in
        flight. Returns the requests that sample in it, by id."""
        sampled: dict[str, Request] = {}
        for scheduled in sched_out.requests:
            request = self.requests[scheduled.request_id]
            request.num_computed_tokens += scheduled.num_new_tokens - scheduled.num_spec_tokens
            if scheduled.sampling is not None:
                request.num_pending_tokens += 1
                sampled[scheduled.request_id] = request
        return sampled

    def undo_launch(self, sched_out: SchedulerOutput, sampled: dict[str, Request]) -> None:
        """Takes back `after_launch` for a step that failed before its tokens arrived (the
        requests still live are scheduled again, or retried alone)."""
        for scheduled in sched_out.requests:
            request = self.requests.get(scheduled.request_id)
            if request is None:
                continue
            request.num_computed_tokens -= scheduled.num_new_tokens - scheduled.num_spec_tokens
            if scheduled.request_id in sampled:
                request.num_pending_tokens -= 1

    def append(
        self,
        sched_out: SchedulerOutput,
        sampled: dict[str, Request],
        runner_out: RunnerOutput,
        elapsed: float,
    ) -> list[Request]:
        """Appends a launched step's tokens once they reached the host: counts the accepted
        drafts, finishes requests on stop tokens or length. `sampled`: `after_launch`'s
        requests; one that finished (or was aborted) since is skipped and its tokens dropped.
        Returns the requests that received tokens (finished ones included)."""
        self._charge(sched_out, elapsed)
        now = time.monotonic()
        scheduled_by_id = {r.request_id: r for r in sched_out.requests}
        for scheduled in sched_out.requests:  # done: never run again (sliding-window release)
            self.kv_cache.step_finished(scheduled.request_id, scheduled.num_computed_tokens)
        updated: list[Request] = []
        for rid, new_tokens in runner_out.sampled_token_ids.items():
            request = sampled[rid]
            if self.requests.get(rid) is not request:
                continue  # finished while its tokens were in flight (a new request may reuse the id)
            request.num_pending_tokens -= 1
            num_spec = scheduled_by_id[rid].num_spec_tokens
            if num_spec:
                # Rejected drafts' KV is not computed: only the accepted drafts count.
                num_accepted = min(len(new_tokens) - 1, num_spec)
                request.num_computed_tokens += num_accepted
                request.clear_drafts()  # consumed; the proposer gives the next ones
                self.num_draft_tokens += num_spec
                self.num_accepted_tokens += num_accepted
                self.num_verify_rows += 1
                self.num_verified_emitted += len(new_tokens)
            logprobs = runner_out.logprobs.get(rid) or [None] * len(new_tokens)
            request.append_tokens(new_tokens, logprobs)
            timeline = _note_tokens(request, now)
            updated.append(request)
            if request.finished:
                # It may have been preempted (waiting) while its token was in flight.
                if request in self.running:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                del self.requests[rid]
                self.kv_cache.free(request)
                request.num_pending_tokens = 0  # the next step's token, if launched, is dropped
                timeline.finished = now
        return updated

    # ---- prefill / decode share -----------------------------------------------------------

    def _pick_class(self, has_prefill: bool, has_decode: bool) -> str | None:
        """The one class this step may run, or None when both may run (no share, or no
        contention)."""
        if self.share is None:
            return None
        if not (has_prefill and has_decode):
            # No contention: the idle class must not bank credit for a later burst.
            top = max(self.vruntime.values())
            self.vruntime = {PREFILL: top, DECODE: top}
            return None
        if self.config.prefill_compute_share == "auto":
            self._adapt_share()
        return PREFILL if self.vruntime[PREFILL] < self.vruntime[DECODE] else DECODE

    def _adapt_share(self) -> None:
        """Moves the share toward the class under more pressure: prefill pressure is queued
        prefill work in steps' worth of tokens, decode pressure the share of sequence slots
        decoding."""
        prefill_tokens = sum(r.num_owed_tokens for r in self._prefill_requests())
        prefill_pressure = prefill_tokens / self.config.scheduled_token_cap
        decode_pressure = sum(r.is_decode for r in self.running) / self.config.max_num_seqs
        total = prefill_pressure + decode_pressure
        target = AUTO_SHARE_MIN + (AUTO_SHARE_MAX - AUTO_SHARE_MIN) * prefill_pressure / total
        assert self.share is not None
        step = max(-AUTO_SHARE_RATE, min(AUTO_SHARE_RATE, target - self.share))
        self.share = min(AUTO_SHARE_MAX, max(AUTO_SHARE_MIN, self.share + step))

    def _prefill_requests(self) -> Iterable[Request]:
        yield from self.waiting
        yield from (r for r in self.running if not r.is_decode)

    def _charge(self, sched_out: SchedulerOutput, elapsed: float) -> None:
        if self.share is None or sched_out.empty:
            return
        if sched_out.kind == PREFILL:
            self.vruntime[PREFILL] += elapsed / self.share
        elif sched_out.kind == DECODE:
            self.vruntime[DECODE] += elapsed / (1.0 - self.share)


def _note_tokens(request: Request, now: float) -> Timeline:
    """Records on the request's timeline that tokens arrived at `now`; returns the timeline."""
    timeline = request.timeline
    if timeline.first_token is None:
        timeline.first_token = now
    timeline.last_token = now
    timeline.num_output_tokens = request.num_output_tokens
    return timeline
