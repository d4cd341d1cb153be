"""Scheduler behaviour without a model: a fake runner samples a fixed token for every request."""

from __future__ import annotations

import itertools

import pytest

from libkk.cache.kv_cache_manager import KVCacheManager
from libkk.config import SchedulerConfig
from libkk.engine.request import Request, RequestStatus
from libkk.engine.scheduler import DECODE, PREFILL, Scheduler
from libkk.runtime.io import RunnerOutput, SchedulerOutput
from libkk.sample.params import SamplingParams

BLOCK = 4
_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int = 8, first_token: int = 0) -> Request:
    return Request(
        f"r{next(_ids)}",
        list(range(first_token, first_token + prompt_len)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        seed=0,
        eos_token_ids=frozenset(),
        max_tokens=max_tokens,
        arrival_time=0.0,
    )


def fake_run(out: SchedulerOutput) -> RunnerOutput:
    result = RunnerOutput()
    for r in out.requests:
        if r.sampling is not None:
            result.sampled_token_ids[r.request_id] = [7]
    return result


def update(s: Scheduler, out: SchedulerOutput, result: RunnerOutput, elapsed: float) -> None:
    """A synchronous step's bookkeeping: launched, then its tokens appended."""
    s.append(out, s.after_launch(out), result, elapsed)


def make_scheduler(num_blocks: int = 256, **cfg: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, BLOCK, True))


def run_to_completion(s: Scheduler, elapsed=lambda out: 1.0, max_steps: int = 10_000):
    steps: list[SchedulerOutput] = []
    while s.num_unfinished:
        out = s.schedule()
        assert not out.empty, "scheduler stalled with unfinished requests"
        steps.append(out)
        update(s, out, fake_run(out), elapsed(out))
        assert len(steps) < max_steps
    return steps


def test_budget_respected_every_step():
    s = make_scheduler(max_num_seqs=5, max_num_batched_tokens=32)
    reqs = [make_request(n) for n in (50, 3, 17, 40, 9, 1, 33, 12)]
    for r in reqs:
        s.add_request(r)
    for out in run_to_completion(s):
        assert out.num_scheduled_tokens <= 32
        assert len(out.requests) <= 5
        assert len({r.request_id for r in out.requests}) == len(out.requests)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 8 for r in reqs)


def test_chunked_prefill_splits_long_prompt_and_samples_only_at_the_end():
    s = make_scheduler(max_num_batched_tokens=16)
    r = make_request(40, max_tokens=2)
    s.add_request(r)
    steps = run_to_completion(s)
    chunks = [out.requests[0].num_new_tokens for out in steps]
    assert chunks == [16, 16, 8, 1]
    assert [out.requests[0].sampling is not None for out in steps] == [False, False, True, True]
    # The sampled position is the number of tokens before the new one.
    assert steps[2].requests[0].sampling.position == 40


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = make_request(10, max_tokens=3), make_request(10, max_tokens=3, first_token=50)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [r.request_id for r in out.requests] == [a.request_id]  # b (10) does not fit in 6


def test_decode_runs_before_new_prefill():
    s = make_scheduler(max_num_batched_tokens=8)
    a = make_request(4, max_tokens=5)
    s.add_request(a)
    update(s, out := s.schedule(), fake_run(out), 1.0)
    b = make_request(30)
    s.add_request(b)
    out = s.schedule()
    assert [(r.request_id, r.num_new_tokens) for r in out.requests] == [
        (a.request_id, 1),
        (b.request_id, 7),
    ]


def test_preemption_newest_first_then_resumed_unchanged():
    # 10 usable blocks of 4 tokens; three requests that each grow to 16 tokens (4 blocks).
    s = make_scheduler(num_blocks=11, max_num_batched_tokens=64)
    reqs = [make_request(8, max_tokens=8, first_token=100 * i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    steps = run_to_completion(s)
    preempted = [rid for out in steps for rid in out.preempted_request_ids]
    assert preempted, "the pool is too small for all three: someone must be preempted"
    assert preempted[0] == reqs[-1].request_id  # the newest goes first
    assert reqs[0].num_preemptions == 0
    for r in reqs:
        assert r.output_token_ids == [7] * 8
    assert s.kv_cache.num_free_blocks == 10


def test_uncap_prefill_only_steps():
    def first_chunk(**cfg: object) -> int:
        s = make_scheduler(max_num_batched_tokens=64, max_num_scheduled_tokens=16, **cfg)
        s.add_request(make_request(100))
        return s.schedule().num_scheduled_tokens

    assert first_chunk() == 16
    assert first_chunk(uncap_prefill_only_steps=True) == 64

    # With a runnable decode, the mixed-step cap applies even when uncapped.
    s = make_scheduler(
        max_num_batched_tokens=64, max_num_scheduled_tokens=16, uncap_prefill_only_steps=True
    )
    a = make_request(4)
    s.add_request(a)
    update(s, out := s.schedule(), fake_run(out), 1.0)
    s.add_request(make_request(100))
    assert s.schedule().num_scheduled_tokens == 16


def _time_shares(share: float) -> tuple[float, float, int, int]:
    """Runs a decode-heavy and a prefill-heavy workload that contend; returns the measured time
    of prefill and decode steps (a prefill step costs 3, a decode step 1) while both had work."""
    s = make_scheduler(max_num_batched_tokens=16, prefill_compute_share=share, max_num_seqs=64)
    for i in range(4):
        s.add_request(make_request(2, max_tokens=200, first_token=10 * i))
    for i in range(30):  # distinct prompts: no prefix hits
        s.add_request(make_request(64, max_tokens=1, first_token=1000 + 100 * i))
    cost = {PREFILL: 3.0, DECODE: 1.0}
    time = {PREFILL: 0.0, DECODE: 0.0}
    count = {PREFILL: 0, DECODE: 0}
    for _ in range(200):
        out = s.schedule()
        assert out.kind in (PREFILL, DECODE)
        kinds = {
            DECODE
            if r.sampling and r.num_new_tokens == 1 and r.num_computed_tokens >= 2
            else PREFILL
            for r in out.requests
        }
        assert len(kinds) == 1, "under contention a step runs one class only"
        time[out.kind] += cost[out.kind]
        count[out.kind] += 1
        update(s, out, fake_run(out), cost[out.kind])
    return time[PREFILL], time[DECODE], count[PREFILL], count[DECODE]


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_prefill_compute_share_splits_step_time(share):
    prefill, decode, _, _ = _time_shares(share)
    assert prefill / (prefill + decode) == pytest.approx(share, abs=0.05)


def test_prefill_share_without_contention_runs_freely():
    s = make_scheduler(max_num_batched_tokens=16, prefill_compute_share=0.1)
    s.add_request(make_request(64, max_tokens=1))
    # Only prefill work: every step is a full prefill chunk, never held back by the share.
    for _ in range(4):
        out = s.schedule()
        assert out.num_scheduled_tokens == 16
        update(s, out, fake_run(out), 1.0)


def test_auto_share_moves_toward_pressure_within_bounds():
    s = make_scheduler(max_num_batched_tokens=16, prefill_compute_share="auto", max_num_seqs=64)
    for i in range(2):
        s.add_request(make_request(2, max_tokens=500, first_token=10 * i))
    for _ in range(2):
        update(s, out := s.schedule(), fake_run(out), 1.0)
    for i in range(50):
        s.add_request(make_request(64, max_tokens=1, first_token=1000 + 100 * i))
    for _ in range(60):
        update(s, out := s.schedule(), fake_run(out), 1.0)
    assert 0.5 < s.share <= 0.8  # lots of queued prefill: the share rose, but not past its bound


def test_prefix_hit_skips_cached_tokens():
    s = make_scheduler(max_num_batched_tokens=64)
    a = make_request(18, max_tokens=1)
    s.add_request(a)
    run_to_completion(s)
    b = make_request(18, max_tokens=1)  # the same prompt
    s.add_request(b)
    out = s.schedule()
    assert out.requests[0].num_computed_tokens == 16  # 4 full blocks hit, 2 tokens to compute
    assert out.requests[0].num_new_tokens == 2
    assert b.num_cached_tokens == 16


def test_finish_request_frees_blocks():
    s = make_scheduler(num_blocks=32)
    a = make_request(10)
    s.add_request(a)
    s.schedule()
    assert s.kv_cache.num_free_blocks < 31
    s.finish_request(a.request_id, RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache.num_free_blocks == 31
    assert s.num_unfinished == 0 and not s.running


def test_abort_waiting_and_preempted_requests():
    s = make_scheduler(num_blocks=11, max_num_batched_tokens=64, max_num_seqs=3)
    running = [make_request(8, max_tokens=8, first_token=100 * i) for i in range(3)]
    waiting = make_request(8, first_token=900)
    for r in [*running, waiting]:
        s.add_request(r)
    update(s, out := s.schedule(), fake_run(out), 1.0)
    assert waiting.status == RequestStatus.WAITING  # max_num_seqs holds it back
    s.finish_request(waiting.request_id, RequestStatus.FINISHED_ABORTED)
    assert waiting not in s.waiting and waiting.finished
    # Grow until the pool forces a preemption, then abort the preempted request.
    for _ in range(20):
        if any(r.status == RequestStatus.PREEMPTED for r in running):
            break
        update(s, out := s.schedule(), fake_run(out), 1.0)
    victim = next(r for r in running if r.status == RequestStatus.PREEMPTED)
    s.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED)
    assert victim not in s.waiting and s.num_unfinished == 2
    run_to_completion(s)
    assert s.kv_cache.num_free_blocks == 10
