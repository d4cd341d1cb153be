"""The OpenAI-compatible server on the default model, driven by the official `openai` client (and
by plain httpx for errors and disconnects): answers equal the Session's own, streaming, n, seeds,
response_format, logprobs, stop, batching across HTTP requests, OpenAI-shaped errors, and aborts
when a client goes away."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import uvicorn

from libkk import SamplingParams, Session
from libkk.serve.app import build_app

MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def session(default_model_dir):
    with Session(str(default_model_dir), device="cpu", max_model_len=512, progress=False) as s:
        yield s


@pytest.fixture(scope="module")
def server(session):
    app = build_app(session, shutdown_grace_s=1.0)
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield app, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    return models[0].id


def _greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _wait_until(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_chat_equals_the_session_answer_with_usage(session, client, model):
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = session.chat(MESSAGES, _greedy())
    assert reply.object == "chat.completion" and reply.model == model
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_completions_of_several_prompts_with_n(session, client, model):
    prompts = [PROMPT, "One, two, three,"]
    reply = client.completions.create(
        model=model,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = session.generate(prompts, _greedy(6))
    assert reply.object == "text_completion"
    # Choice j * n + i is completion i of prompt j; greedy completions are identical.
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [e.text for e in expected for _ in range(2)]
    prompt_tokens = sum(len(e.prompt_token_ids) for e in expected)
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == 4 * 6
    # echo puts the prompt before the completion, streamed or not.
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    kwargs["extra_body"] = {"ignore_eos": True}
    echoed = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert echoed == streamed == PROMPT + expected[0].text


def test_chat_stream_equals_the_whole_answer(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completion_stream_with_n_and_a_seed_repeats(client, model):
    kwargs = dict(
        model=model,
        prompt=PROMPT,
        n=2,
        max_tokens=10,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    texts = ["", ""]
    reasons = [None, None]
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    whole = client.completions.create(**kwargs)
    assert texts == [c.text for c in whole.choices]
    assert reasons == ["length", "length"]
    assert texts[0] != texts[1]  # completion 1 has its own seed
    # Completion 0 is the seed's own completion.
    one = client.completions.create(**{**kwargs, "n": 1})
    assert one.choices[0].text == texts[0]


def test_seeded_chat_repeats_and_another_seed_differs(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=1.0)
    first = client.chat.completions.create(**kwargs, seed=123).choices[0].message.content
    again = client.chat.completions.create(**kwargs, seed=123).choices[0].message.content
    other = client.chat.completions.create(**kwargs, seed=124).choices[0].message.content
    assert first == again
    assert first != other


def test_response_format_json_schema_validates(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA}},
        n=2,
        max_tokens=40,
        temperature=1.0,
        seed=3,
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_logprobs(client, model):
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes) == entry.token.encode()
        tops = entry.top_logprobs
        assert len(tops) == 3
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert (tops[0].token, tops[0].logprob) == (entry.token, entry.logprob)
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client, model):
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) == logprob and top[token] == logprob


def test_stop_string_cuts_the_text(client, model):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full.split()[2]
    reply = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert reply.finish_reason == "stop"
    assert reply.text == full[: full.index(stop)]


def test_concurrent_requests_share_steps(session, client, model):
    prompts = [f"{PROMPT} {k}" for k in range(4)]
    expected = [o.text for o in session.generate(prompts, _greedy(12))]
    steps = session.stats()["num_steps"]

    def ask(prompt):
        reply = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(ask, prompts))
    assert texts == expected
    # One by one they would take 4 * 12 steps; batched, far fewer.
    assert session.stats()["num_steps"] - steps < 36


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 20}},
                "required": ["timezone"],
            },
        },
    },
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls) -> list[tuple[str, dict]]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    out = []
    for call in calls:
        assert call.id and call.type == "function"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schemas[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_required_tool_call_equals_the_session_call(session, client, model):
    kwargs = dict(tools=TOOLS, tool_choice="required")
    reply = client.chat.completions.create(
        model=model, messages=WEATHER, max_tokens=60, temperature=0, **kwargs
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = _check_calls(choice.message.tool_calls)
    expected = session.chat(WEATHER, SamplingParams(max_tokens=60, temperature=0), **kwargs)
    assert calls == [(c.name, c.arguments) for c in expected.tool_calls]
    # A named function is the one called.
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model=model, messages=WEATHER, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named
    )
    assert [name for name, _ in _check_calls(reply.choices[0].message.tool_calls)] == ["get_time"]


def test_streamed_tool_call(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=WEATHER,
            max_tokens=60,
            temperature=1.0,
            seed=5,
            tools=TOOLS,
            tool_choice="required",
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [call.index for call in calls] == list(range(len(calls)))
    _check_calls(calls)
    # The call's text never reaches the content.
    assert "".join(d.content or "" for d in deltas).strip() == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# ---- errors --------------------------------------------------------------------------------


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client, model):
    url = server[1]
    chat = url + "/v1/chat/completions"
    good = {"model": model, "messages": MESSAGES, "max_tokens": 2}
    with httpx.Client(timeout=30) as http:
        error = _error(http.post(chat, content=b'{"model": "x", "messages": ['), 400)
        assert error["type"] == "invalid_request_error"
        assert _error(http.post(chat, json={**good, "temperature": "hot"}), 400)["param"] == (
            "temperature"
        )
        assert _error(http.post(chat, json={**good, "frobnicate": 1}), 400)["param"] == (
            "frobnicate"
        )
        error = _error(http.post(chat, json={**good, "temperature": -1}), 400)
        assert error["param"] == "temperature" and "temperature" in error["message"]
        assert _error(http.post(chat, json={**good, "top_p": 0}), 400)["param"] == "top_p"
        assert _error(http.post(chat, json={**good, "top_logprobs": 2}), 400)["param"] == (
            "top_logprobs"
        )
        error = _error(http.post(chat, json={**good, "response_format": {"type": "xml"}}), 400)
        assert error["param"] == "response_format"
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
        error = _error(http.post(chat, json={**good, "response_format": bad_schema}), 400)
        assert error["param"] == "response_format"
        assert _error(http.post(chat, json={"model": model}), 400)["param"] is None
        error = _error(
            http.post(chat, json={**good, "messages": [{"role": "robot", "content": "hi"}]}), 400
        )
        assert error["param"] == "messages[0].role"
        error = _error(http.post(chat, json={**good, "tool_choice": "required"}), 400)
        assert error["param"] == "tool_choice"
        bad_tools = [{"type": "function", "function": {"parameters": {}}}]
        error = _error(http.post(chat, json={**good, "tools": bad_tools}), 400)
        assert error["param"] == "tools"
        error = _error(http.post(chat, json={**good, "model": "gpt-4o"}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        long_prompt = {"model": model, "prompt": "word " * 2000, "max_tokens": 2}
        error = _error(http.post(url + "/v1/completions", json=long_prompt), 400)
        assert error["code"] == "context_length_exceeded"
        assert _error(http.get(url + "/v1/nothing"), 404)["code"] == "not_found"
        assert _error(http.get(url + "/v1/models/gpt-4o"), 404)["code"] == "model_not_found"
        assert http.get(url + f"/v1/models/{model}").json()["id"] == model
    # The official client raises its own error classes for these.
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert reply.usage.completion_tokens >= 1


# ---- clients that go away ------------------------------------------------------------------


@pytest.fixture()
def aborts(session, monkeypatch):
    seen: list[str] = []
    abort = session.abort

    def spy(request_id: str) -> None:
        seen.append(request_id)
        abort(request_id)

    monkeypatch.setattr(session, "abort", spy)
    return seen


LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_a_client_that_leaves_a_stream_aborts_its_request(server, session, model, aborts):
    app, url = server
    body = {"model": model, "prompt": PROMPT, "stream": True, **LONG}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = json.loads(first.removeprefix("data: "))["id"]
    assert _wait_until(lambda: not session.has_unfinished_requests())
    assert aborts == [f"{rid}-0"]
    assert app.state.libkk.engine.num_running == 0


def test_a_client_that_leaves_a_plain_request_aborts_it(server, session, model, aborts):
    app, url = server
    body = {"model": model, "messages": MESSAGES, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=1.0)
    assert _wait_until(lambda: not session.has_unfinished_requests())
    assert len(aborts) == 1 and aborts[0].startswith("chatcmpl-")
    assert app.state.libkk.engine.num_running == 0
