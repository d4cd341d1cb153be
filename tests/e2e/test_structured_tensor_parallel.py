"""Structured output at tensor_parallel_size 3 on the CPU (the default model splits 9 heads, 3 KV
heads and its vocabulary by 3), without speculation and with n-gram speculation: rank 0 runs the
grammars and every rank applies its masks, so sampled outputs satisfy their constraints and
greedy outputs equal one rank's token for token."""

from __future__ import annotations

import pytest
from structured_cases import CASES, check, requests

from libkk import SamplingParams, Session

SEEDS = range(3)
SETTINGS = dict(device="cpu", max_model_len=256, max_num_seqs=16, progress=False)
SPECS = {"plain": {}, "ngram": {"method": "ngram", "num_speculative_tokens": 3}}


def _greedy_batch() -> tuple[list[str], list[SamplingParams]]:
    """Each constraint once, greedy, beside an unconstrained row."""
    prompts, params, _ = requests(list(CASES), [0], temperature=0.0)
    prompts.append("The capital of France is")
    params.append(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def one_rank_greedy():
    with Session(**SETTINGS) as s:
        return [o.token_ids for o in s.generate(*_greedy_batch())]


@pytest.fixture(scope="module", params=list(SPECS))
def tp3(request, one_rank_greedy):
    # After one_rank_greedy: no other Session may start while a tensor-parallel one is open.
    with Session(
        tensor_parallel_size=3, worker_timeout_s=120.0, speculative=SPECS[request.param], **SETTINGS
    ) as s:
        yield request.param, s


def test_greedy_outputs_equal_one_rank(tp3, one_rank_greedy):
    method, s = tp3
    outs = s.generate(*_greedy_batch())
    assert [o.token_ids for o in outs] == one_rank_greedy
    for name, o in zip(CASES, outs, strict=False):
        check(name, o.text)
    if method == "ngram":
        assert s.stats()["spec_num_verify_steps"] > 0


def test_sampled_outputs_satisfy_their_constraints(tp3):
    _, s = tp3
    prompts, params, cases = requests(list(CASES), SEEDS, temperature=1.0)
    outs = s.generate(prompts, params)
    for name, o in zip(cases, outs, strict=True):
        assert o.finish_reason == "stop", (name, o.text)
        check(name, o.text)
