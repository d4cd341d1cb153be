"""Several sessions in one process, each stepped from its own thread at the same time, give each
request the tokens it gets from the same session alone: no per-step state is shared between them
(the forward context is per thread, compiled ops find their layers through it)."""

from __future__ import annotations

import threading

import pytest
from e2e_prompts import PROMPTS

from libkk import SamplingParams, Session

PARAMS = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
]


def _run(session: Session) -> list[list[int]]:
    """Every prompt with every params, submitted together and driven by the caller."""
    out = session.generate([p for p in PROMPTS[:4] for _ in PARAMS], PARAMS * 4)
    return [o.token_ids for o in out]


def _in_threads(sessions: list[Session], rounds: int = 3) -> list[list[list[list[int]]]]:
    """Each session generates `rounds` times on its own thread, all threads started together."""
    results: list[list[list[list[int]]]] = [[] for _ in sessions]
    errors: list[BaseException] = []
    start = threading.Barrier(len(sessions))

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(rounds):
                results[i].append(_run(sessions[i]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return results


@pytest.mark.parametrize("num_sessions", [4])
def test_sessions_of_one_model_in_threads_equal_each_alone(tiny_llama_dir, num_sessions):
    sessions = [Session(str(tiny_llama_dir), progress=False) for _ in range(num_sessions)]
    try:
        alone = _run(sessions[0])
        for per_session in _in_threads(sessions):
            for result in per_session:
                assert result == alone
    finally:
        for s in sessions:
            s.close()


def test_sessions_of_different_models_in_threads_equal_each_alone(tiny_llama_dir, tiny_qwen3_dir):
    dirs = [tiny_llama_dir, tiny_qwen3_dir, tiny_llama_dir, tiny_qwen3_dir]
    sessions = [Session(str(d), progress=False) for d in dirs]
    try:
        alone = [_run(s) for s in sessions[:2]]
        for i, per_session in enumerate(_in_threads(sessions)):
            for result in per_session:
                assert result == alone[i % 2]
    finally:
        for s in sessions:
            s.close()
