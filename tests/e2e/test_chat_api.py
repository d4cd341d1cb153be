"""The chat-facing Session API on the default model: n completions per prompt (shared prefix,
derived seeds), stream_chat, and OpenAI's response_format on chat."""

from __future__ import annotations

import json

import jsonschema
import pytest

from libkk import InvalidRequestError, RequestOutput, SamplingParams, SamplingParamsError, Session

# Long enough to fill several KV blocks, so the prefix cache has something to serve.
PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank. " * 4
MESSAGES = [{"role": "user", "content": "Describe a cat as a JSON object."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def session(default_model_dir):
    with Session(str(default_model_dir), device="cpu", max_model_len=512, progress=False) as s:
        yield s


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kw)


def test_n_greedy_completions_are_identical_and_share_the_prompt(session):
    hits_before = session.stats()["prefix_cache_hits"]
    outs = session.generate(PROMPT, _greedy(n=3))
    assert isinstance(outs, list) and len(outs) == 3
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert len({o.request_id for o in outs}) == 3
    one = session.generate(PROMPT, _greedy())
    assert isinstance(one, RequestOutput)
    assert all(o.token_ids == one.token_ids and o.text == one.text for o in outs)
    # The later completions were served the prompt's blocks by the prefix cache.
    assert session.stats()["prefix_cache_hits"] > hits_before
    assert all(o.num_cached_tokens > 0 for o in outs[1:])


def test_n_seeded_completions_differ_and_repeat(session):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    first = session.generate(PROMPT, params)
    again = session.generate(PROMPT, params)
    texts = [o.token_ids for o in first]
    assert len({tuple(t) for t in texts}) == 3
    assert [o.token_ids for o in again] == texts
    # Completion 0 is the request seed's own completion.
    alone = session.generate(PROMPT, SamplingParams(max_tokens=12, seed=1234, ignore_eos=True))
    assert alone.token_ids == texts[0]


def test_n_in_a_batch_and_in_chat(session):
    outs = session.generate([PROMPT, "Hello"], [_greedy(n=2), _greedy()])
    assert isinstance(outs[0], list) and len(outs[0]) == 2
    assert isinstance(outs[1], RequestOutput)
    chats = session.chat(MESSAGES, _greedy(n=2))
    assert isinstance(chats, list) and chats[0].token_ids == chats[1].token_ids


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2", None])
def test_bad_n_is_refused(n):
    with pytest.raises(SamplingParamsError, match=r"SamplingParams\.n="):
        SamplingParams(n=n)


def test_n_is_refused_where_one_output_is_streamed(session):
    with pytest.raises(InvalidRequestError, match=r"n=2"):
        session.stream(PROMPT, _greedy(n=2))
    with pytest.raises(InvalidRequestError, match=r"n=2"):
        session.stream_chat(MESSAGES, _greedy(n=2))
    with pytest.raises(InvalidRequestError, match=r"n=2"):
        session.submit(PROMPT, _greedy(n=2))
    assert not session.has_unfinished_requests()


def test_stream_chat_deltas_join_to_chat(session):
    params = SamplingParams(max_tokens=20, temperature=0.0)
    final = session.chat(MESSAGES, params)
    deltas = list(session.stream_chat(MESSAGES, params))
    assert deltas and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.delta_text for d in deltas) == final.text
    assert [t for d in deltas for t in d.delta_token_ids] == final.token_ids


def test_response_format_json_schema(session):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA}}
    out = session.chat(
        MESSAGES, SamplingParams(max_tokens=60, temperature=0.0), response_format=fmt
    )
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_response_format_json_object(session):
    out = session.chat(
        MESSAGES,
        SamplingParams(max_tokens=200, temperature=0.0),
        response_format={"type": "json_object"},
    )
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_response_format_text_is_plain_chat(session):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    plain = session.chat(MESSAGES, params)
    assert session.chat(MESSAGES, params, response_format={"type": "text"}).text == plain.text
    # Without params, a default SamplingParams gets the constraint.
    assert session.chat(MESSAGES, response_format={"type": "text"}).finished


@pytest.mark.parametrize(
    ("fmt", "field"),
    [
        ("json_object", "response_format"),
        ({}, "response_format.type"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_object", "schema": {}}, "unknown keys"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "json_schema.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
            "json_schema.strict",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "x": 1}}, "unknown"),
    ],
)
def test_malformed_response_format_is_refused(session, fmt, field):
    with pytest.raises(InvalidRequestError, match=field.replace(".", r"\.")):
        session.chat(MESSAGES, _greedy(), response_format=fmt)
    assert not session.has_unfinished_requests()


def test_response_format_with_structured_params_is_refused(session):
    params = _greedy(structured={"regex": "[a-z]+"})
    with pytest.raises(InvalidRequestError, match="structured"):
        session.chat(MESSAGES, params, response_format={"type": "json_object"})
    with pytest.raises(InvalidRequestError, match="structured"):
        session.stream_chat(MESSAGES, params, response_format={"type": "text"})
