"""Async scheduling: step k launches before step k-1's tokens reach the host, and the output is
the synchronous engine's, token for token and output for output."""

from __future__ import annotations

import random

import pytest
from e2e_prompts import PROMPTS

from libkk import ConfigError, EngineConfig, SamplingParams, Session
from libkk.runtime.io import PLACEHOLDER_TOKEN_ID

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Token-id prompts of several lengths for the tiny Qwen3 (no model download, for the GPU machine).
ID_PROMPTS = [[(7 * i + 13 * j) % 2000 + 2 for j in range(3 + 5 * i)] for i in range(8)]


def run_stepped(session: Session, prompts, params) -> dict[str, list[tuple]]:
    """Every request's outputs, in order, through submit/step: (delta tokens, delta text,
    finished, finish reason, stop reason, logprob token ids)."""
    rids = [
        session.submit(p, sp, request_id=f"r{i}")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    seen: dict[str, list[tuple]] = {rid: [] for rid in rids}
    for _ in range(2000):
        if not session.has_unfinished_requests():
            break
        for o in session.step():
            lps = None if o.logprobs is None else [lp.token_id for lp in o.logprobs]
            seen[o.request_id].append(
                (o.delta_token_ids, o.delta_text, o.finished, o.finish_reason, o.stop_reason, lps)
            )
    assert not session.has_unfinished_requests()
    return seen


def both_modes(model_dir, prompts, params, **settings) -> tuple[dict, dict, dict]:
    """The stepped outputs of a sync and an async session with the same settings, and the async
    session's stats."""
    results = []
    for async_scheduling in (False, True):
        with Session(str(model_dir), async_scheduling=async_scheduling, **settings) as s:
            results.append(run_stepped(s, prompts, params))
            if async_scheduling:
                kv = s.engine.kv_cache_manager
                assert kv.num_free_blocks == kv.num_blocks - 1  # every block came back
                kv.check_invariants()
                stats = s.stats()
    return results[0], results[1], stats


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy tokens of each prompt (synchronous), to pick stop tokens and stop strings from."""
    with Session(str(tiny_llama_dir)) as s:
        return s.generate(PROMPTS, GREEDY)


def test_mixed_params_match_sync(tiny_llama_dir, reference):
    """Lengths 1..N, stop tokens and strings, seeded sampling with filters, logprobs, penalties
    and min_tokens (which make steps wait), in one batch."""
    stop_token = reference[0].token_ids[4]
    stop_text = reference[2].text[6:9]
    assert stop_text.strip()
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.7, seed=3, repetition_penalty=1.3),
        SamplingParams(max_tokens=6, temperature=0.0, min_tokens=4, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=11, temperature=1.1, seed=5, ignore_eos=True),
    ]
    sync, async_, _ = both_modes(tiny_llama_dir, PROMPTS, params)
    assert async_ == sync
    assert sync["r0"][-1][3:5] == ("stop", stop_token)
    assert sync["r2"][-1][3:5] == ("stop", stop_text)
    assert [len(sum((o[0] for o in sync[f"r{i}"]), [])) for i in (1, 4)] == [1, 2]


def test_chunked_prefill_matches_sync(tiny_llama_dir):
    params = [GREEDY, SamplingParams(max_tokens=7, temperature=0.8, seed=11, ignore_eos=True)] * 4
    sync, async_, stats = both_modes(
        tiny_llama_dir, PROMPTS, params, max_num_batched_tokens=7, enable_prefix_caching=False
    )
    assert async_ == sync
    assert stats["num_steps"] > 30  # the prompts really were cut into chunks


def test_preemption_matches_sync(tiny_llama_dir):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    sync, async_, stats = both_modes(
        tiny_llama_dir,
        PROMPTS,
        [params] * len(PROMPTS),
        block_size=4,
        num_gpu_blocks=25,
        max_model_len=96,
        enable_prefix_caching=False,
    )
    assert stats["num_preemptions"] > 0
    assert async_ == sync


def test_prefix_cache_hits_match_sync(tiny_llama_dir):
    params = [GREEDY] * len(PROMPTS)
    for async_scheduling in (False, True):
        with Session(str(tiny_llama_dir), block_size=4, async_scheduling=async_scheduling) as s:
            first = s.generate(PROMPTS, params)
            again = s.generate(PROMPTS, params)
        if not async_scheduling:
            expected = [o.token_ids for o in first]
        assert [o.token_ids for o in first] == expected
        assert [o.token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0.5 * sum(
            len(o.prompt_token_ids) for o in again
        )


def test_random_load_matches_sync(tiny_llama_dir):
    """Many requests of random lengths and limits through a small pool and a small budget:
    chunks, decodes, admissions and preemptions interleave."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))] for _ in range(24)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 10),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            stop_token_ids=[rng.randrange(3, 49152)],
        )
        for i in range(24)
    ]
    sync, async_, stats = both_modes(
        tiny_llama_dir,
        prompts,
        params,
        block_size=4,
        num_gpu_blocks=30,
        max_model_len=64,
        max_num_seqs=12,
        max_num_batched_tokens=32,
    )
    assert async_ == sync
    assert stats["num_preemptions"] > 0


def test_abort_mid_generation(tiny_llama_dir, reference):
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with Session(str(tiny_llama_dir)) as s:
        full = s.generate(PROMPTS[1], long).token_ids
    with Session(str(tiny_llama_dir), async_scheduling=True) as s:
        a = s.submit(PROMPTS[0], GREEDY)
        b = s.submit(PROMPTS[1], long)
        got: dict[str, list] = {a: [], b: []}
        for _ in range(5):
            for o in s.step():
                got[o.request_id].append(o)
        s.abort(b)
        while s.has_unfinished_requests():
            for o in s.step():
                got[o.request_id].append(o)
        assert s.engine.kv_cache_manager.num_free_blocks == s.engine.kv_cache_manager.num_blocks - 1
    [*streamed, final] = got[b]  # nothing after the abort's output
    assert final.finish_reason == "abort" and not any(o.finished for o in streamed)
    assert final.token_ids == sum((o.delta_token_ids for o in got[b]), [])
    assert 0 < len(final.token_ids) < 40 and final.token_ids == full[: len(final.token_ids)]
    assert got[a][-1].token_ids == reference[0].token_ids


def test_id_reused_while_the_aborted_requests_token_is_in_flight(tiny_llama_dir, reference):
    """Through the engine: abort a request and add a new one with its id while the old one's
    token is still in flight; that token never reaches the new request."""
    with Session(str(tiny_llama_dir), async_scheduling=True) as s:
        engine = s.engine

        def add(rid, prompt):
            engine.add_request(engine.make_request(rid, prompt, GREEDY, 0.0))

        add("a", PROMPTS[0])
        add("x", PROMPTS[1])
        outs: dict[str, list] = {"a": [], "x": []}
        for _ in range(3):
            for o in engine.step():
                outs[o.request_id].append(o)
        assert engine._in_flight is not None and "x" in engine._in_flight.sampled
        aborted = engine.abort_request("x")
        add("x", PROMPTS[2])
        while engine.has_unfinished_requests:
            for o in engine.step():
                outs[o.request_id].append(o)
    assert aborted.finish_reason == "abort"
    assert aborted.token_ids == reference[1].token_ids[: len(aborted.token_ids)]
    assert outs["a"][-1].token_ids == reference[0].token_ids
    assert outs["x"][-1].token_ids == reference[2].token_ids


def test_failed_request_is_isolated(tiny_llama_dir, reference):
    """A launch that fails because of one request: that request ends with an error, the others
    still give the synchronous tokens."""
    with Session(str(tiny_llama_dir), async_scheduling=True) as s:
        runner = s.engine.runner
        launch = runner.launch

        def failing_launch(sched_out):
            if any(r.request_id == "bad" and r.num_computed_tokens > 8 for r in sched_out.requests):
                raise RuntimeError("poisoned request")
            return launch(sched_out)

        runner.launch = failing_launch
        good = [s.submit(p, GREEDY) for p in PROMPTS[:3]]
        s.submit(PROMPTS[4], GREEDY, request_id="bad")
        outs: dict[str, list] = {}
        while s.has_unfinished_requests():
            for o in s.step():
                outs.setdefault(o.request_id, []).append(o)
    assert outs["bad"][-1].finish_reason == "error" and "poisoned" in outs["bad"][-1].error
    assert [outs[rid][-1].token_ids for rid in good] == [o.token_ids for o in reference[:3]]


def test_launch_comes_before_the_previous_steps_tokens(tiny_llama_dir):
    """The order of launch(k) and append(k-1) (the tokens resolved), and that step k's input is
    the in-flight token."""
    with Session(str(tiny_llama_dir), async_scheduling=True) as s:
        engine = s.engine
        events: list[tuple[str, int]] = []
        launched: list[object] = []
        launch, append = engine.runner.launch, engine.scheduler.append

        def record_launch(sched_out):
            launched.append(sched_out)
            events.append(("launch", len(launched)))
            return launch(sched_out)

        def record_append(sched_out, sampled, runner_out, elapsed):
            events.append(("resolve", next(i for i, o in enumerate(launched, 1) if o is sched_out)))
            return append(sched_out, sampled, runner_out, elapsed)

        engine.runner.launch = record_launch
        engine.scheduler.append = record_append
        rid = s.submit("Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        per_call = [len(s.step()) for _ in range(6)]
    # Prefill and 3 decodes: launch k before resolve k-1; the last is finished by a call with
    # nothing left to launch.
    assert events == [
        ("launch", 1),
        ("launch", 2),
        ("resolve", 1),
        ("launch", 3),
        ("resolve", 2),
        ("launch", 4),
        ("resolve", 3),
        ("resolve", 4),
    ]
    assert per_call == [0, 1, 1, 1, 1, 0]
    # Every decode's input was still in flight when it was scheduled.
    for sched_out in launched[1:]:
        [r] = sched_out.requests
        assert r.request_id == rid and r.last_token_in_flight
        assert r.token_ids == [PLACEHOLDER_TOKEN_ID]


def test_penalties_wait_for_the_token_in_flight(tiny_llama_dir):
    """A request whose sampling reads earlier tokens is never scheduled with a placeholder."""
    with Session(str(tiny_llama_dir), async_scheduling=True) as s:
        scheduled = []
        schedule = s.engine.scheduler.schedule

        def record():
            out = schedule()
            scheduled.extend(out.requests)
            return out

        s.engine.scheduler.schedule = record
        params = SamplingParams(max_tokens=6, temperature=0.0, frequency_penalty=0.5)
        s.generate(PROMPTS[:2], params)
    assert len(scheduled) > 6 and not any(r.last_token_in_flight for r in scheduled)


def test_config_errors():
    assert EngineConfig.from_settings(async_scheduling=True).scheduler.async_scheduling is True
    assert EngineConfig().scheduler.async_scheduling == "auto"
    spec = {"method": "ngram"}
    assert EngineConfig.from_settings(async_scheduling=True, speculative=spec)
    with pytest.raises(ConfigError, match="speculative decoding under tensor parallelism"):
        EngineConfig.from_settings(async_scheduling=True, speculative=spec, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="shared_host_tables"):
        EngineConfig.from_settings(async_scheduling=True, shared_host_tables=True)
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig.from_settings(async_scheduling="yes")


def test_auto_is_on_for_cuda_when_nothing_needs_the_tokens_first():
    def decided(device_type: str, **settings) -> bool | str:
        config = EngineConfig.from_settings(**settings).for_device(device_type)
        return config.scheduler.async_scheduling

    assert decided("cuda") is True
    assert decided("cpu") is False
    # Speculation runs ahead of the requests its backoff pauses: with the backoff, one process.
    assert decided("cuda", speculative={"method": "ngram"}) is True
    assert decided("cuda", speculative={"method": "ngram", "draft_backoff": False}) is False
    assert decided("cuda", speculative={"method": "ngram"}, tensor_parallel_size=2) is False
    assert decided("cuda", shared_host_tables=True) is False
    assert decided("cpu", async_scheduling=True) is True  # an explicit choice stays
    assert decided("cuda", async_scheduling=False) is False


def test_a_cpu_session_decides_auto_as_synchronous(tiny_llama_dir):
    with Session(str(tiny_llama_dir)) as s:
        assert s.config.scheduler.async_scheduling == "auto"
        assert s.engine.config.scheduler.async_scheduling is False


@pytest.mark.gpu
def test_cuda_graphs_match_sync(tiny_qwen3_dir):
    """On CUDA, with decode steps replayed from graphs: the in-flight tokens gathered on the
    device and the ids copied back asynchronously give the synchronous tokens."""
    params = [
        GREEDY,
        SamplingParams(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1),
    ] * 2 + [GREEDY] * 2
    settings = dict(device="cuda", dtype="float32", torch_compile=False, progress=False)
    sync, async_, stats = both_modes(tiny_qwen3_dir, ID_PROMPTS, params, **settings)
    assert async_ == sync
    assert stats["num_steps"] > 10


@pytest.mark.gpu
def test_cuda_decode_launch_never_waits_for_the_device(tiny_qwen3_dir):
    """Launching a decode step (graph replay; greedy, plain temperature and logprobs rows; the
    copies back) makes no call that waits for the device: torch's sync debug mode turns any such
    call into an error."""
    import torch

    settings = dict(device="cuda", dtype="float32", torch_compile=False, progress=False)
    with Session(str(tiny_qwen3_dir), async_scheduling=True, **settings) as s:
        launch = s.engine.runner.launch
        checked, errors = [], []

        def strict_launch(sched_out):
            if not all(r.num_new_tokens == 1 for r in sched_out.requests):
                return launch(sched_out)  # prefill runs eagerly: not checked
            torch.cuda.set_sync_debug_mode("error")
            try:
                result = launch(sched_out)
            except RuntimeError as e:
                errors.append(e)  # the engine would retry the requests one by one: keep it
                raise
            finally:
                torch.cuda.set_sync_debug_mode("default")
            checked.append(sched_out)
            return result

        s.engine.runner.launch = strict_launch
        params = [
            GREEDY,
            SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
            GREEDY,
        ]
        outs = s.generate(ID_PROMPTS[:4], params)
    assert not errors, errors[0]
    assert len(checked) >= GREEDY.max_tokens - 2
    assert all(o.finish_reason == "length" for o in outs)


def test_device_sampling_matches_the_filter_path():
    """The sampler's device tensors hold, row for row, what sending every random row through the
    filter path (`sample_random`) picks: rows without top-k, top-p or min-p take the keyed
    Gumbel-max directly, and that changes no token; logprobs are the raw logits' log-softmax."""
    import torch

    from libkk.sample.sampler import Sampler, SamplingRow, apply_penalties, sample_random

    torch.manual_seed(0)
    logits = torch.randn(8, 300) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=2, logprobs=0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, presence_penalty=1.0, seed=3, logprobs=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=4),
        SamplingParams(temperature=1.5, top_k=-1, seed=5),
    ]
    rows = [
        SamplingRow(
            params=p,
            seed=i,
            position=10 + i,
            prompt_token_ids=[1, 2, 3],
            output_token_ids=[int(logits[i].argmax())],
            banned_token_ids=(int(logits[5].argmax()),) if i == 5 else (),
        )
        for i, p in enumerate(params)
    ]

    def filter_path(x: torch.Tensor, rows: list) -> list[int]:
        x = apply_penalties(x.float().clone(), rows, inplace=True)
        tokens = x.argmax(dim=-1)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random:
            tokens[random] = sample_random(
                x[random],
                [rows[i].params for i in random],
                torch.tensor([rows[i].seed for i in random]),
                torch.tensor([rows[i].position for i in random]),
            )
        return tokens.tolist()

    sampled = Sampler().sample(logits.clone(), rows)
    expected = filter_path(logits, rows)
    assert sampled.token_ids.tolist() == expected
    logprobs = sampled.logprobs.build(expected, len(rows))
    assert [lp is not None for lp in logprobs] == [True, False, True, False, True] + [False] * 3
    raw = logits.log_softmax(dim=-1)
    for i, lp in enumerate(logprobs):
        if lp is not None:
            assert lp.token_id == expected[i]
            assert lp.logprob == pytest.approx(raw[i, expected[i]].item(), abs=1e-5)
            assert len(lp.top) == params[i].logprobs
    # Batches of one kind: greedy only, unfiltered random only, random only.
    for subset in ([0, 3, 5], [4, 6, 7], [1, 2, 4, 6, 7]):
        got = Sampler().sample(logits[subset].clone(), [rows[i] for i in subset]).token_ids
        assert got.tolist() == [expected[i] for i in subset]


# ---- the scheduler alone: a fake model whose token depends on (request, position) only ---------


def _fake_token(rid: str, position: int) -> int:
    return (sum(map(ord, rid)) * 131 + position * 17) % 50  # 0 is the stop token


def _make_requests(seed: int):
    from libkk.engine.request import Request

    rng = random.Random(seed)
    return [
        Request(
            f"q{i}",
            [rng.randrange(1, 50) for _ in range(rng.randint(1, 30))],
            SamplingParams(max_tokens=12),
            seed=0,
            eos_token_ids=frozenset({0}),
            max_tokens=rng.randint(1, 12),
            arrival_time=0.0,
        )
        for i in range(16)
    ]


def _simulate(requests, async_scheduling: bool, counts) -> dict:
    """Runs the scheduler to completion over a fake runner that checks every input token against
    the true sequence (in-flight placeholders replaced by the previous step's sampled ids, as the
    runner gathers them); returns each request's output tokens and finish reason."""
    from libkk.cache.kv_cache_manager import KVCacheManager
    from libkk.config import SchedulerConfig
    from libkk.engine.scheduler import Scheduler
    from libkk.runtime.io import RunnerOutput

    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24)
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True)
    s = Scheduler(cfg, kv)
    truth = {r.request_id: list(r.prompt_token_ids) for r in requests}
    by_id = {r.request_id: r for r in requests}
    for r in requests:
        s.add_request(r)
    preempt = s._preempt

    def counting_preempt(request, out):
        counts["preempted_in_flight"] += request.num_pending_tokens
        preempt(request, out)

    s._preempt = counting_preempt

    def launch(out):
        sampled = RunnerOutput()
        for r in out.requests:
            inputs = list(r.token_ids)
            if r.last_token_in_flight:
                counts["placeholders"] += 1
                inputs[-1] = in_flight[r.request_id]
            start = r.num_computed_tokens
            assert PLACEHOLDER_TOKEN_ID not in inputs
            assert inputs == truth[r.request_id][start : start + len(inputs)]
            if r.sampling is not None:
                token = _fake_token(r.request_id, r.sampling.position)
                assert r.sampling.position == len(truth[r.request_id])
                truth[r.request_id].append(token)
                sampled.sampled_token_ids[r.request_id] = [token]
        return sampled

    in_flight: dict[str, int] = {}
    pending = None
    for _ in range(1000):
        if not s.num_unfinished:
            break
        out = s.schedule()
        kv.check_invariants()
        if out.empty:
            assert async_scheduling and pending is not None, "stalled"
        else:
            result = launch(out)
            sampled = s.after_launch(out)
            assert sampled == {rid: by_id[rid] for rid in result.sampled_token_ids}
            if not async_scheduling:
                s.append(out, sampled, result, 1.0)
                continue
            in_flight = {rid: t for rid, [t] in result.sampled_token_ids.items()}
            launched = (out, result, sampled)
        if pending is not None:
            s.append(pending[0], pending[2], pending[1], 1.0)
        pending = None if out.empty else launched
    assert not s.num_unfinished and kv.num_free_blocks == 19
    # Requests that stopped while their next step was already launched: that token was dropped.
    counts["discarded"] += sum(len(truth[r.request_id]) > len(r.all_token_ids) for r in requests)
    return {r.request_id: (r.output_token_ids, r.status.finish_reason) for r in requests}


def test_scheduler_async_equals_sync_with_a_fake_model():
    counts = {"placeholders": 0, "preempted_in_flight": 0, "discarded": 0}
    reasons = set()
    for seed in range(12):
        discarded = counts["discarded"]
        sync = _simulate(_make_requests(seed), False, counts)
        assert counts["discarded"] == discarded  # synchronous steps never compute a dropped token
        assert _simulate(_make_requests(seed), True, counts) == sync
        reasons |= {reason for _, reason in sync.values()}
    assert reasons == {"stop", "length"}
    assert counts["discarded"] > 0
    assert counts["placeholders"] > 100
    assert counts["preempted_in_flight"] > 0  # its token arrives while it waits
