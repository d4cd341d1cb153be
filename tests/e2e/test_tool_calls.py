"""Tool calls on the default model (its template renders no tools: the fallback prompt): forced
calls always parse and validate, "auto" and "none", streaming, a conversation with calls and
results, and bad tools or choices refused while the session goes on serving."""

from __future__ import annotations

import json

import jsonschema
import pytest

from libkk import InvalidRequestError, LibkkError, SamplingParams, Session, ToolCall

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1}, "maxItems": 3},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_ARGS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_ARGS,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": ADD_ARGS},
    },
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "add": ADD_ARGS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def session(default_model_dir):
    with Session(str(default_model_dir), device="cpu", max_model_len=1024, progress=False) as s:
        yield s


def _check_call(call: ToolCall, names=SCHEMAS) -> None:
    assert isinstance(call, ToolCall) and call.type == "function" and call.id.startswith("call_")
    assert call.name in names
    jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_required_gives_a_valid_call_for_every_seed(session):
    # 20 sampled completions (each its own seed), batched.
    params = SamplingParams(n=20, seed=11, temperature=1.0, max_tokens=96)
    outs = session.chat(MESSAGES, params, tools=TOOLS, tool_choice="required")
    assert len(outs) == 20 and len({tuple(o.token_ids) for o in outs}) > 1
    for out in outs:
        assert out.finish_reason == "stop", session.tokenizer.decode(out.token_ids)
        assert out.tool_calls is not None and len(out.tool_calls) == 1
        _check_call(out.tool_calls[0])
        assert out.text == "" and out.delta_text == ""


def test_named_choice_calls_that_tool(session):
    params = SamplingParams(n=4, seed=5, temperature=1.0, max_tokens=96)
    choice = {"type": "function", "function": {"name": "add"}}
    outs = session.chat(MESSAGES, params, tools=TOOLS, tool_choice=choice)
    for out in outs:
        assert [c.name for c in out.tool_calls] == ["add"]
        _check_call(out.tool_calls[0])


def test_auto_parses_what_the_model_wrote(session):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    out = session.chat(MESSAGES, params, tools=TOOLS)
    raw = session.tokenizer.decode(out.token_ids)
    assert out.tool_calls is not None
    for call in out.tool_calls:
        _check_call(call)
    if not out.tool_calls:  # the small model tends to answer in words
        assert out.text == raw
    # The same request gives the same tokens through the stream, and the deltas make its text.
    deltas = list(session.stream_chat(MESSAGES, params, tools=TOOLS))
    assert [t for d in deltas for t in d.delta_token_ids] == out.token_ids
    assert "".join(d.delta_text for d in deltas) == deltas[-1].text == out.text
    assert deltas[-1].tool_calls is not None and all(d.tool_calls is None for d in deltas[:-1])


def test_none_offers_no_tools(session):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    out = session.chat(MESSAGES, params, tools=TOOLS, tool_choice="none")
    assert out.tool_calls is None
    assert out.token_ids == session.chat(MESSAGES, params).token_ids
    assert session.chat(MESSAGES, params).tool_calls is None


def test_stream_of_a_required_call(session):
    params = SamplingParams(temperature=0.0, max_tokens=96)
    whole = session.chat(MESSAGES, params, tools=TOOLS, tool_choice="required")
    deltas = list(session.stream_chat(MESSAGES, params, tools=TOOLS, tool_choice="required"))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert all(d.delta_text == "" for d in deltas)  # nothing but the call: no content
    assert [(c.name, c.arguments) for c in deltas[-1].tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    assert [t for d in deltas for t in d.delta_token_ids] == whole.token_ids


def test_closing_a_tool_stream_early_aborts_it(session):
    stream = session.stream_chat(
        MESSAGES, SamplingParams(max_tokens=64), tools=TOOLS, tool_choice="required"
    )
    next(stream)
    stream.close()
    assert not session.has_unfinished_requests()


def test_a_conversation_with_calls_and_results(session):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": '{"temperature": 18}'},
    ]
    params = SamplingParams(seed=3, temperature=1.0, max_tokens=96)
    out = session.chat(messages, params, tools=TOOLS, tool_choice={"name": "add"})
    assert [c.name for c in out.tool_calls] == ["add"]
    _check_call(out.tool_calls[0])
    # Without tools the history still renders (the call and result written as text).
    assert session.chat(messages, SamplingParams(max_tokens=4)).finished


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_auto_with_a_json_response_format_gives_calls_or_json(session):
    params = SamplingParams(n=2, seed=2, temperature=1.0, max_tokens=160)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    outs = session.chat(MESSAGES, params, tools=TOOLS, response_format=fmt)
    for out in outs:
        assert out.finish_reason == "stop", session.tokenizer.decode(out.token_ids)
        if out.tool_calls:
            assert out.text == ""
            for call in out.tool_calls:
                _check_call(call)
        else:
            jsonschema.validate(json.loads(out.text), ANSWER)


def _tool(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


BAD = [
    ({"tools": []}, "tools is empty"),
    ({"tools": TOOLS[0]}, "tools must be a list"),
    ({"tools": [_tool("a b")]}, r"tools\[0\]\.function\.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "distinct"),
    ({"tools": [_tool(parameters={"type": "object", "required": 3})]}, r"\.parameters"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice="),
    ({"tools": TOOLS, "tool_choice": {"name": "mul"}}, "'mul'.*not among"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, r"tool_choice\.function"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format and tool_choice",
    ),
    (
        {"tools": TOOLS, "params": SamplingParams(structured={"regex": "[a-z]+"})},
        "SamplingParams.structured",
    ),
    (
        {
            "tools": TOOLS,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            },
        },
        "response_format",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "content": None, "tool_calls": [{"function": "add"}]}
            ],
            "tools": TOOLS,
        },
        r"messages\[0\]\['tool_calls'\]\[0\]\['function'\]",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "add", "arguments": "{bad"}}],
                }
            ]
        },
        "arguments'] is not valid JSON",
    ),
]


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(("kwargs", "match"), BAD)
def test_bad_tool_requests_fail_alone(session, kwargs, match, streamed):
    kwargs = dict(kwargs)
    messages = kwargs.pop("messages", MESSAGES)
    params = kwargs.pop("params", SamplingParams(max_tokens=4))
    call = session.stream_chat if streamed else session.chat
    with pytest.raises(InvalidRequestError, match=match) as info:
        call(messages, params, **kwargs)
    assert isinstance(info.value, LibkkError)
    assert not session.has_unfinished_requests()
    # The session goes on serving, tools included.
    out = session.chat(MESSAGES, SamplingParams(max_tokens=2, temperature=0.0), tools=TOOLS)
    assert out.finished and out.tool_calls == []
