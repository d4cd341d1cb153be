"""Structured output on the default model: sampled outputs under a JSON Schema, a regex, a choice
and a Lark grammar all satisfy their constraint; greedy constrained output does not depend on the
batch; bad constraints fail at submit and the session goes on; preemption keeps outputs valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from libkk import (
    LibkkError,
    SamplingParams,
    SamplingParamsError,
    Session,
    StructuredOutputError,
)
from libkk.runtime.model_runner import ModelRunner

# Sampled generations per constraint (temperature 1, one seed each, one generate call).
NUM_SAMPLES = 200

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "role", "tags", "address"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["yes", "no", "maybe"]
GREETING = """
start: greeting " " NAME "!"
greeting: "hello" | "hi" | "hey"
NAME: /[A-Z][a-z]{1,8}/
"""
GREETING_RE = r"(hello|hi|hey) [A-Z][a-z]{1,8}!"


@pytest.fixture(scope="module")
def session(default_model_dir):
    with Session(str(default_model_dir), device="cpu", max_model_len=512, progress=False) as s:
        yield s


def _sampled(structured: dict, max_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured=structured)
        for seed in range(NUM_SAMPLES)
    ]


def test_json_schema_outputs_validate(session):
    outs = session.generate(
        ["A user record as JSON:"] * NUM_SAMPLES, _sampled({"json_schema": SCHEMA}, 160)
    )
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not one forced string


def test_regex_outputs_match(session):
    outs = session.generate(["Today's date is"] * NUM_SAMPLES, _sampled({"regex": DATE}, 32))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert re.fullmatch(DATE, o.text), o.text
    assert len({o.text for o in outs}) > 1


def test_choice_outputs_are_choices(session):
    outs = session.generate(["Is the sky green?"] * NUM_SAMPLES, _sampled({"choice": CHOICES}, 8))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert o.text in CHOICES
    assert len({o.text for o in outs}) > 1


def test_lark_grammar_outputs_parse(session):
    outs = session.generate(["Greet someone:"] * NUM_SAMPLES, _sampled({"grammar": GREETING}, 24))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert re.fullmatch(GREETING_RE, o.text), o.text
    assert len({o.text for o in outs}) > 1


def test_any_json_object(session):
    params = SamplingParams(temperature=0.0, max_tokens=128, structured={"json": True})
    out = session.generate("A small JSON object:", params)
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_greedy_constrained_alone_equals_batched(session):
    prompts = ["A user record as JSON:", "Today's date is", "Greet someone:", "Hello"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=160, structured={"json_schema": SCHEMA}),
        SamplingParams(temperature=0.0, max_tokens=32, structured={"regex": DATE}),
        SamplingParams(temperature=0.0, max_tokens=24, structured={"grammar": GREETING}),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),  # unconstrained
    ]
    batched = session.generate(prompts, params)
    alone = [session.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(batched[0].text), SCHEMA)
    assert re.fullmatch(DATE, batched[1].text)
    assert len(batched[3].token_ids) == 12


def test_logprobs_are_of_the_raw_logits(session):
    plain = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=3, structured={"choice": ["zebra"]}
    )
    free, forced = session.generate(["The animal is", "The animal is"], [plain, constrained])
    # The constrained token is picked under the grammar, its logprobs read from the raw logits.
    # (Two rows of one CPU batch may differ in the last bits.)
    assert forced.text and "zebra".startswith(forced.text)
    top_forced, top_free = forced.logprobs[0].top, free.logprobs[0].top
    assert [t for t, _ in top_forced] == [t for t, _ in top_free]
    assert [lp for _, lp in top_forced] == pytest.approx([lp for _, lp in top_free], abs=1e-4)
    assert forced.token_ids[0] != free.token_ids[0]
    assert forced.logprobs[0].rank > 1 and forced.logprobs[0].logprob < top_free[0][1]


@pytest.mark.parametrize(
    "structured, match",
    [
        ({"json_schema": {"type": "foo"}}, "json_schema"),
        ({"regex": "(["}, "regex"),
        ({"grammar": "start: A\nA: /a/ & /b/"}, "grammar admits no output"),
        ({"regex": r"[^\s\S]"}, "regex admits no output"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
    ],
)
def test_bad_constraint_fails_at_submit(session, structured, match):
    params = SamplingParams(max_tokens=8, structured=structured)
    with pytest.raises(StructuredOutputError, match=match):
        session.submit("Hello", params)
    assert session.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True)).token_ids


@pytest.mark.parametrize(
    "structured, match",
    [
        ({"choice": []}, "choice"),
        ({"regexp": "a+"}, "regexp"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({}, "exactly one"),
        ({"json": False}, "json"),
    ],
)
def test_malformed_structured_field(session, structured, match):
    with pytest.raises(SamplingParamsError, match=match):
        session.submit("Hello", SamplingParams(max_tokens=8, structured=structured))
    with pytest.raises(LibkkError, match=match):
        SamplingParams.from_dict({"structured": structured})
    assert session.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True)).token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_keeps_outputs_valid(default_model_dir, async_scheduling):
    # 24 usable blocks of 4 tokens: far less than 8 constrained requests need at once.
    n = 8
    with Session(
        str(default_model_dir),
        device="cpu",
        async_scheduling=async_scheduling,
        block_size=4,
        num_gpu_blocks=25,
        max_model_len=96,
        enable_prefix_caching=False,
        progress=False,
    ) as s:
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured={"regex": DATE})
            for i in range(n)
        ] + [
            SamplingParams(temperature=0.0, max_tokens=48, structured={"grammar": GREETING})
            for _ in range(n)
        ]
        prompts = ["Today's date, written in the ISO format, is"] * n + [
            "Write a short greeting to a friend:"
        ] * n
        outs = s.generate(prompts, params)
        alone = s.generate(prompts[-1], params[-1])
    assert sum(o.num_preemptions for o in outs) > 0
    for o in outs[:n]:
        assert o.finish_reason == "stop" and re.fullmatch(DATE, o.text), o.text
    for o in outs[n:]:
        assert o.finish_reason == "stop" and re.fullmatch(GREETING_RE, o.text), o.text
        assert o.token_ids == alone.token_ids


@pytest.mark.parametrize("fail_once", [False, True], ids=["", "a-failed-sampling"])
def test_async_scheduling_gives_the_same_outputs(session, default_model_dir, fail_once):
    # A constrained row's step launches before its previous token is in; its mask is made when
    # the token arrives, and the step sampled then (`sample_pending`). A sampling that fails
    # runs the step again request by request.
    prompts = ["Today's date is", "Greet someone:", "Hello", "A user record as JSON:"]
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=32, structured={"regex": DATE}),
        SamplingParams(temperature=1.0, seed=4, max_tokens=24, structured={"grammar": GREETING}),
        SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=160, structured={"json_schema": SCHEMA}),
    ]
    sync = session.generate(prompts, params)
    with Session(
        str(default_model_dir),
        device="cpu",
        max_model_len=512,
        async_scheduling=True,
        progress=False,
    ) as s:
        runner = s.engine.runner
        calls = []

        def sample_pending(launched, masks):
            calls.append(sorted(masks))
            if fail_once and len(calls) == 3:
                raise RuntimeError("injected")
            return ModelRunner.sample_pending(runner, launched, masks)

        runner.sample_pending = sample_pending
        async_ = s.generate(prompts, params)
    assert len(calls) > 20  # the constrained rows' steps launched with their tokens in flight
    assert [o.token_ids for o in async_] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in async_] == ["stop", "stop", "length", "stop"]
