"""Structured output with speculative decoding on the default model (n-gram, the shipped DFlash
drafter and a random draft model with probabilistic drafts, n-gram with adaptive verification and
the draft backoff): sampled outputs under a JSON Schema, a regex, a choice and
a Lark grammar all satisfy their constraint, drafts the grammar forbids are cut before
verification, and greedy outputs equal the run without speculation token for token."""

from __future__ import annotations

import pytest
from structured_cases import CASES, check, requests

from libkk import SamplingParams, Session
from libkk.sample.grammar import GrammarMatcher

SEEDS = range(3)
# Every step verifies what the proposer drafts (no backoff pause), so the grammar path runs.
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "draft_backoff": False},
    "dflash": {
        "method": "dflash",
        "num_speculative_tokens": 4,
        "draft_backoff": False,
        "draft_sampling": "probabilistic",
    },
    # A random 2-layer drafter with the default model's tokenizer: its drafts are mostly cut.
    "draft_model": {
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "draft_backoff": False,
        "draft_sampling": "probabilistic",
    },
    # Adaptive verification trims the (already cut) drafts; the backoff pauses poor drafting.
    "ngram-adaptive-backoff": {"method": "ngram", "adaptive_verification": True},
}
# Specs that verify every step's drafts: the grammar's cut must show up under them.
ALWAYS_VERIFY = ("ngram", "dflash", "draft_model")
SETTINGS = dict(device="cpu", max_model_len=512, progress=False)


def _greedy_batch() -> tuple[list[str], list[SamplingParams]]:
    """Each constraint once, greedy, beside an unconstrained row."""
    prompts, params, _ = requests(list(CASES), [0], temperature=0.0)
    prompts.append("The capital of France is")
    params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def plain_greedy():
    with Session(**SETTINGS) as s:
        return [o.token_ids for o in s.generate(*_greedy_batch())]


@pytest.fixture(scope="module", params=list(SPECS))
def spec_session(request):
    spec = dict(SPECS[request.param])
    if spec["method"] == "draft_model":
        spec["draft_model"] = str(request.getfixturevalue("tiny_llama_dir"))
    with Session(speculative=spec, **SETTINGS) as s:
        yield request.param, s


@pytest.fixture
def cuts(monkeypatch):
    """Counts draft verifications prepared under a grammar, and those that cut drafts."""
    counts = {"drafts": 0, "cut": 0}
    real = GrammarMatcher.draft_masks

    def draft_masks(self, drafts):
        masks = real(self, drafts)
        counts["drafts"] += 1
        counts["cut"] += masks.shape[0] - 1 < len(drafts)
        return masks

    monkeypatch.setattr(GrammarMatcher, "draft_masks", draft_masks)
    return counts


def test_sampled_outputs_satisfy_their_constraints(spec_session, cuts):
    method, s = spec_session
    before = s.stats()
    prompts, params, cases = requests(list(CASES), SEEDS, temperature=1.0)
    outs = s.generate(prompts, params)
    for name, o in zip(cases, outs, strict=True):
        assert o.finish_reason == "stop", (name, o.text)
        check(name, o.text)
    for name in ("json_schema", "regex"):  # sampled, not one forced string
        assert len({o.text for c, o in zip(cases, outs, strict=True) if c == name}) > 1, name
    stats = s.stats()
    if method not in ALWAYS_VERIFY:
        return
    assert stats["spec_num_verify_steps"] > before["spec_num_verify_steps"]
    assert cuts["drafts"] > 0 and cuts["cut"] > 0, cuts
    if method == "ngram":
        assert stats["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]


def test_greedy_outputs_equal_the_plain_run(spec_session, plain_greedy):
    method, s = spec_session
    before = s.stats()["spec_num_verify_steps"]
    outs = s.generate(*_greedy_batch())
    assert [o.token_ids for o in outs] == plain_greedy
    for name, o in zip(CASES, outs, strict=False):
        check(name, o.text)
    if method in ALWAYS_VERIFY:
        assert s.stats()["spec_num_verify_steps"] > before
