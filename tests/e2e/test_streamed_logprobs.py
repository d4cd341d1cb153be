"""Streamed outputs with logprobs: every output carries one Logprob per token so far (built once
per token, handed out as a fresh list), also with drafts and when a stop string cuts a run."""

from __future__ import annotations

from test_speculative import cyclic_llama_dir  # noqa: F401 - fixture: long accepted draft runs

from libkk import SamplingParams, Session


def _check_stream(outputs, final_ids):
    assert outputs[-1].finished and outputs[-1].token_ids == final_ids
    seen = []
    for out in outputs:
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        seen.append(list(out.logprobs))
    # Later steps never change what an earlier output handed out.
    for out, logprobs in zip(outputs, seen, strict=True):
        assert out.logprobs == logprobs and len(out.logprobs) == len(out.token_ids)


def test_streamed_logprobs_follow_the_tokens(cyclic_llama_dir):  # noqa: F811
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    for spec in ({}, {"method": "ngram", "num_speculative_tokens": 4}):
        with Session(str(cyclic_llama_dir), progress=False, **spec) as s:
            full = s.generate("Once upon a time", params)
            outputs = list(s.stream("Once upon a time", params))
            _check_stream(outputs, full.token_ids)
            # A stop string (searched from the 9th token on) at token 10, inside the run of
            # accepted drafts that brings tokens 7 to 11: the tokens after it go, with their
            # logprobs.
            stop = s.tokenizer.decode([full.token_ids[9]])
            cut = SamplingParams(
                max_tokens=24,
                min_tokens=8,
                temperature=0.0,
                ignore_eos=True,
                logprobs=2,
                stop=[stop],
            )
            stopped = list(s.stream("Once upon a time", cut))
            assert stopped[-1].finish_reason == "stop"
            assert stopped[-1].token_ids == full.token_ids[:10]
            if spec:
                assert max(len(o.delta_token_ids) for o in stopped) > 1
            _check_stream(stopped, stopped[-1].token_ids)
