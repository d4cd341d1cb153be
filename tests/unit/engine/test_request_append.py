"""Request.append_tokens (a verification step's tokens at once) against appending one at a time."""

import itertools
import random

import pytest

from libkk.engine.request import Request, RequestStatus
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import TokenLogprobs

EOS = 1
STOP = 7


def _request(max_tokens: int, min_tokens: int, ignore_eos: bool, num_output: int) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=[STOP]
    )
    r = Request(
        "r",
        [5, 6],
        params,
        seed=0,
        eos_token_ids=frozenset({EOS}),
        max_tokens=max_tokens,
        arrival_time=0.0,
    )
    for t in range(num_output):
        r.append_token(100 + t, None)
    r.status = RequestStatus.RUNNING
    return r


def _one_at_a_time(r: Request, tokens: list[int], logprobs: list) -> None:
    for token, lp in zip(tokens, logprobs, strict=True):
        r.append_token(token, lp)
        if r.check_stop_token():
            break


def _state(r: Request) -> tuple:
    return (
        r.output_token_ids,
        r.all_token_ids,
        [lp.token_id for lp in r.output_logprobs],
        r.status,
        r.stop_reason,
    )


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_append_tokens_equals_appending_one_at_a_time(with_logprobs):
    rng = random.Random(0)
    cases = 0
    for max_tokens, min_tokens, ignore_eos, num_output in itertools.product(
        (1, 3, 6, 20), (0, 2, 5), (False, True), (0, 2, 4)
    ):
        if min_tokens > max_tokens or num_output >= max_tokens:
            continue
        for _ in range(6):
            n = rng.randint(1, 8)
            tokens = [rng.choice([EOS, STOP, 40, 41, 42, 43]) for _ in range(n)]
            logprobs = [
                TokenLogprobs(token_id=t, logprob=-1.0, rank=1, top=[]) if with_logprobs else None
                for t in tokens
            ]
            fast = _request(max_tokens, min_tokens, ignore_eos, num_output)
            slow = _request(max_tokens, min_tokens, ignore_eos, num_output)
            fast.append_tokens(tokens, logprobs)
            _one_at_a_time(slow, tokens, logprobs)
            assert _state(fast) == _state(slow), (max_tokens, min_tokens, ignore_eos, tokens)
            cases += 1
    assert cases > 100


def test_append_tokens_stops_at_length_without_stop_tokens():
    r = _request(max_tokens=5, min_tokens=0, ignore_eos=False, num_output=2)
    r.append_tokens([40, 41, 42, 43], [None] * 4)
    assert r.output_token_ids == [100, 101, 40, 41, 42]
    assert r.all_token_ids == [5, 6, 100, 101, 40, 41, 42]
    assert r.status == RequestStatus.FINISHED_LENGTH
