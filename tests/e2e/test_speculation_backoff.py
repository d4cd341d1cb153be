"""Speculation never slows a request down for long: the shipped DFlash drafter rarely guesses a
plain prompt's continuation on the default model, so with the backoff its requests draft a small
share of their steps, and greedy output stays the plain output."""

from __future__ import annotations

from libkk import SamplingParams, Session
from libkk.engine.speculation import DraftBackoff

PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
PROMPTS = ["def fib(n):", "Once upon a time"]


def _run(backoff: bool) -> tuple[list[list[int]], dict]:
    spec = {"method": "dflash", "draft_backoff": backoff}
    with Session(max_model_len=256, speculative=spec, progress=False) as s:
        if backoff:
            timed = s.engine.speculation.backoff
            assert timed is not None
            s.engine.speculation.backoff = DraftBackoff(  # steady, whatever the timing
                lambda n, d: 1.5 if d == DraftBackoff.LOOK_DRAFTS else 2.0, timed.num_drafts
            )
        outs = s.generate(PROMPTS, PARAMS)
        return [o.token_ids for o in outs], s.stats()


def test_backoff_drafts_less_where_drafts_fail_and_keeps_greedy_output(default_model_dir):
    # default_model_dir: the default model converted once; its shipped drafter applies
    with Session(max_model_len=256, progress=False) as s:
        plain = [o.token_ids for o in s.generate(PROMPTS, PARAMS)]
    always, always_stats = _run(backoff=False)
    backed_off, stats = _run(backoff=True)
    assert always == plain and backed_off == plain
    assert always_stats["spec_mean_acceptance_length"] < 2.0  # the drafts mostly fail here
    # Drafting every step vs a few looks, paused long enough to keep looks at 1% of the tokens.
    assert stats["spec_num_verify_steps"] < always_stats["spec_num_verify_steps"] / 3
    assert stats["spec_num_verify_steps"] > 0  # it did look


def test_backoff_is_off_when_asked(default_model_dir):
    spec = {"method": "ngram", "draft_backoff": False}
    with Session(max_model_len=256, speculative=spec, progress=False) as s:
        assert s.engine.speculation.backoff is None
        assert "profile speculation costs" not in s.startup_seconds
