"""The Session surface: generate, stream, submit/step, abort, threads, timelines, settings."""

from __future__ import annotations

import json
import threading

import pytest

from libkk import EngineConfig, SamplingParams, Session, UnknownRequestError
from libkk.errors import SessionClosedError

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def session(tiny_llama_dir):
    with Session(str(tiny_llama_dir)) as s:
        yield s


def test_generate_one_and_many(session):
    one = session.generate("Hello there", GREEDY)
    many = session.generate(["Hello there", "Goodbye"], GREEDY)
    assert one.token_ids == many[0].token_ids
    assert len(many) == 2 and all(len(o.token_ids) == 16 for o in many)
    assert one.text == session.tokenizer.decode(one.token_ids)
    # Token ids are a prompt too.
    ids = session.tokenizer.encode("Hello there")
    assert session.generate(ids, GREEDY).token_ids == one.token_ids


def test_stream_deltas_add_up_to_the_final_text(session):
    final = session.generate("Streaming test", GREEDY)
    deltas = list(session.stream("Streaming test", GREEDY))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.delta_text for d in deltas) == final.text
    assert [t for d in deltas for t in d.delta_token_ids] == final.token_ids
    assert all("\ufffd" not in d.delta_text for d in deltas)


def test_stop_string_never_leaks(session):
    full = session.generate(
        "Once upon a time", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "the random model's text must have something to stop on"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    out = session.generate("Once upon a time", params)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    streamed = "".join(d.delta_text for d in session.stream("Once upon a time", params))
    assert streamed == out.text


def test_submit_step_abort(session):
    a = session.submit("first", GREEDY)
    b = session.submit("second", SamplingParams(max_tokens=200, ignore_eos=True))
    outputs = session.step()
    assert {o.request_id for o in outputs} == {a, b}  # a first token is handed out at once
    session.abort(b)
    finished = {}
    while len(finished) < 2:
        for o in session.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished[a].finish_reason == "length"
    assert finished[b].finish_reason == "abort" and len(finished[b].token_ids) < 200
    with pytest.raises(UnknownRequestError, match="unknown request id"):
        session.abort(b)
    with pytest.raises(UnknownRequestError):
        session.abort("never-submitted")


def test_a_step_detokenizes_the_previous_steps_tokens_under_its_forward(session, monkeypatch):
    engine = session.engine
    launch, detokenize = engine.runner.launch, engine.outputs.detokenize
    in_step = False
    during: list[bool] = []  # per detokenization: whether a step was between launch and wait

    def timed_launch(*args, **kwargs):
        nonlocal in_step
        launched = launch(*args, **kwargs)
        in_step = True
        wait = launched.wait

        def timed_wait():
            nonlocal in_step
            try:
                return wait()
            finally:
                in_step = False

        launched.wait = timed_wait
        return launched

    def watched_detokenize(request):
        during.append(in_step)
        return detokenize(request)

    monkeypatch.setattr(engine.runner, "launch", timed_launch)
    monkeypatch.setattr(engine.outputs, "detokenize", watched_detokenize)
    outs = session.generate(["Hello there", "Goodbye"], GREEDY)
    assert [len(o.token_ids) for o in outs] == [16, 16]
    # Tokens 2..15 of each request while the next step ran; the first and the last at once.
    assert during.count(True) == 28 and during.count(False) == 4


def test_abort_hands_out_the_tokens_of_a_step_not_yet_finished(session):
    rid = session.submit("Abort me", SamplingParams(max_tokens=50, ignore_eos=True))
    outputs = session.step() + session.step() + session.step()
    session.abort(rid)
    outputs += session.step()
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    final = outputs[-1]
    assert [t for o in outputs for t in o.delta_token_ids] == final.token_ids
    assert len(final.token_ids) == 3
    assert "".join(o.delta_text for o in outputs) == final.text
    assert final.text == session.tokenizer.decode(final.token_ids)


def test_threads_share_the_engine(session):
    prompts = [f"Thread number {i} says" for i in range(8)]
    expected = [session.generate(p, GREEDY).token_ids for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = session.generate(prompts[i], GREEDY).token_ids
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert [results[i] for i in range(8)] == expected


def test_timeline_is_ordered(session):
    out = session.generate("Timeline", GREEDY)
    t = out.timeline
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.last_token <= t.finished
    assert t.queue_time >= 0 and t.prefill_time >= 0 and t.decode_time >= 0
    assert t.mean_inter_token_time == pytest.approx(t.decode_time / 15)


def test_logprobs(session):
    import torch

    out = session.generate(
        "Logprobs", SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    )
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and lp.rank == 1  # greedy picks the most likely
        assert len(lp.top) == 3 and lp.top[0][0] == token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert torch.tensor([v for _, v in lp.top]).exp().sum() <= 1.0 + 1e-5


def test_startup_phases_are_timed_in_order(session):
    phases = session.startup_seconds
    assert list(phases)[:3] == [
        "model files and tokenizer",
        "load weights",
        "allocate the KV cache",
    ]
    assert list(phases)[-1] == "build the runner"  # no tensor parallelism, proposer or graphs
    assert all(seconds >= 0.0 for seconds in phases.values())


def test_stall_is_logged(tiny_llama_dir, caplog):
    with Session(str(tiny_llama_dir), stall_threshold_s=1e-6, max_num_seqs=1) as s:
        s.submit("a", GREEDY)
        s.submit("b", GREEDY)  # waits behind a: no progress
        with caplog.at_level("WARNING", logger="libkk"):
            s.step()
            s.step()
    assert any(
        "made no progress" in r.message and "first_scheduled" in r.message for r in caplog.records
    )


def test_settings_from_json_and_toml(tmp_path, tiny_llama_dir):
    (tmp_path / "c.json").write_text(json.dumps({"scheduler": {"max_num_seqs": 3}}))
    (tmp_path / "c.toml").write_text("[cache]\nblock_size = 8\n")
    assert EngineConfig.from_file(tmp_path / "c.json").scheduler.max_num_seqs == 3
    cfg = EngineConfig.from_file(tmp_path / "c.toml")
    assert cfg.cache.block_size == 8
    with Session(str(tiny_llama_dir), config=cfg, max_num_seqs=2) as s:
        assert s.config.cache.block_size == 8 and s.config.scheduler.max_num_seqs == 2
        assert s.config.model.model == str(tiny_llama_dir)


def test_close_releases_and_rejects_further_calls(tiny_llama_dir):
    s = Session(str(tiny_llama_dir))
    rid = s.submit("x", GREEDY)
    s.close()
    s.close()  # idempotent
    with pytest.raises(SessionClosedError):
        s.generate("x", GREEDY)
    with pytest.raises(SessionClosedError):
        s.step()
    assert rid


def test_num_threads_sets_torch_threads_before_the_model_loads(tiny_llama_dir, monkeypatch):
    import torch

    from libkk.engine import engine as engine_module
    from libkk.engine.threads import physical_cores

    previous = torch.get_num_threads()
    seen: list[int] = []
    real_engine = engine_module.Engine

    def engine(config):  # the thread count the engine starts (and loads the model) with
        seen.append(torch.get_num_threads())
        return real_engine(config)

    monkeypatch.setattr("libkk.api.session.Engine", engine)
    try:
        torch.set_num_threads(max(2, previous))
        with Session(str(tiny_llama_dir), num_threads=1) as s:
            assert s.config.num_threads == 1
            assert torch.get_num_threads() == 1
            assert s.generate("Hello there", GREEDY).finish_reason == "length"
        with Session(str(tiny_llama_dir)):  # None: the physical cores this process may use
            assert torch.get_num_threads() == physical_cores()
        assert seen == [1, physical_cores()]
    finally:
        torch.set_num_threads(previous)
