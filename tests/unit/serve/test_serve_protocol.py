"""The server's wire format without a model: request decoding names the field at fault, requests
map onto SamplingParams, messages onto what chat templates take, and LibkkErrors onto HTTP
errors."""

from __future__ import annotations

import pytest

from libkk.errors import (
    InvalidRequestError,
    PromptTooLongError,
    SamplingParamsError,
    StructuredOutputError,
)
from libkk.serve import protocol as P


def _decode_error(body: bytes, kind=P.ChatCompletionRequest) -> dict:
    with pytest.raises(P.RequestError) as e:
        P.decode_request(body, kind)
    assert e.value.status == 400
    return e.value.body["error"]


def test_decoding_names_the_field_at_fault():
    base = b'"model": "m", "messages": [{"role": "user", "content": "hi"}]'
    assert _decode_error(b"{" + base)["param"] is None  # not JSON
    assert _decode_error(b"{" + base + b', "n": "two"}')["param"] == "n"
    assert _decode_error(b"{" + base + b', "colour": 1}')["param"] == "colour"
    nested = b', "stream_options": {"include_usage": 3}}'
    assert _decode_error(b"{" + base + nested)["param"] == "stream_options.include_usage"
    nested = b', "stream_options": {"usage": true}}'
    assert _decode_error(b"{" + base + nested)["param"] == "stream_options.usage"
    assert _decode_error(b'{"model": "m", "messages": [3]}')["param"] == "messages[0]"
    assert _decode_error(b'{"messages": []}')["type"] == "invalid_request_error"
    req = P.decode_request(b"{" + base + b', "temperature": 0}', P.ChatCompletionRequest)
    assert req.temperature == 0.0 and req.messages[0]["content"] == "hi"


def test_chat_request_to_sampling_params():
    req = P.ChatCompletionRequest(
        model="m",
        messages=[],
        n=3,
        temperature=0.5,
        stop="END",
        seed=9,
        max_tokens=7,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=4,
        top_k=10,
    )
    params = P.chat_sampling_params(req)
    assert (params.n, params.temperature, params.stop, params.seed) == (3, 0.5, ["END"], 9)
    assert params.max_tokens == 5  # max_completion_tokens wins over the older max_tokens
    assert (params.logprobs, params.top_k) == (4, 10)
    assert P.chat_sampling_params(P.ChatCompletionRequest(model="m", messages=[])).logprobs is None
    bad = P.ChatCompletionRequest(model="m", messages=[], logprobs=True, top_logprobs=21)
    with pytest.raises(P.RequestError) as e:
        P.chat_sampling_params(bad)
    assert e.value.body["error"]["param"] == "top_logprobs"
    bad = P.ChatCompletionRequest(model="m", messages=[], max_completion_tokens=0)
    with pytest.raises(P.RequestError) as e:
        P.chat_sampling_params(bad)
    assert e.value.body["error"]["param"] == "max_completion_tokens"
    for field, value in (("stop", ["a", "b", "c", "d", "e"]), ("n", 129), ("logit_bias", {"1": 2})):
        with pytest.raises(P.RequestError) as e:
            P.chat_sampling_params(
                P.ChatCompletionRequest(model="m", messages=[], **{field: value})
            )
        assert e.value.body["error"]["param"] == field


def test_completion_prompts():
    assert P.completion_prompts("hi") == ["hi"]
    assert P.completion_prompts(["a", "b"]) == ["a", "b"]
    assert P.completion_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert P.completion_prompts([[1, 2], [3]]) == [[1, 2], [3]]
    for bad in ([], ["a", 1], [[1], []], [True]):
        with pytest.raises(P.RequestError) as e:
            P.completion_prompts(bad)
        assert e.value.body["error"]["param"] == "prompt"


def test_template_messages():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}], "name": None},
    ]
    out = P.template_messages(messages)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[1] == {"role": "user", "content": "ab"}
    assert out[2] == {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for bad, param in (
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        (image, "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
    ):
        with pytest.raises(P.RequestError) as e:
            P.template_messages(bad)
        assert e.value.body["error"]["param"] == param


def test_libkk_errors_become_openai_errors():
    error = P.error_from_libkk(PromptTooLongError("too long"))
    assert (error.status, error.body["error"]["code"]) == (400, "context_length_exceeded")
    error = P.error_from_libkk(SamplingParamsError("SamplingParams.top_p=0 is invalid"))
    assert error.body["error"]["param"] == "top_p"
    error = P.error_from_libkk(StructuredOutputError("bad schema"))
    assert error.body["error"]["param"] == "response_format"
    error = P.error_from_libkk(InvalidRequestError("tool_choice='x' is invalid"))
    assert error.body["error"]["param"] == "tool_choice"
    error = P.error_from_libkk(InvalidRequestError("the chat template rejected the messages"))
    assert (error.status, error.body["error"]["param"]) == (400, None)
