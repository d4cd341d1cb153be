"""Chat formats without a model: tools rendered through a tool-aware template and through the
fallback, <tool_call> parsing (whole and streamed), the grammar of a forced call, and the checks
on tools and tool_choice."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from libkk import InvalidRequestError, SamplingParams, ToolCall
from libkk.api.chat_format import HermesFormat, ToolChat, chat_format_for
from libkk.api.tools import ToolChoice, parse_tool_choice, parse_tools
from libkk.models.tokenizer import Tokenizer
from libkk.sample.grammar import GrammarCompiler

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and 2+3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
]

# A Qwen2.5-style template: tools listed in the system turn, calls as <tool_call> blocks, tool
# results as <tool_response> blocks inside a user turn.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nCall with <tool_call></tool_call> tags.<|im_end|>\\n" }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def plain_tokenizer(default_model_dir):
    """The default model's tokenizer: a ChatML template that renders no tools."""
    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tool-template")
    shutil.copy(default_model_dir / "tokenizer.json", folder / "tokenizer.json")
    config = {"chat_template": TOOL_TEMPLATE, "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_folder(folder)


def _call_text(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---- rendering -----------------------------------------------------------------------------


def test_a_tool_aware_template_renders_the_tools_itself(tool_tokenizer):
    fmt = chat_format_for(tool_tokenizer)
    assert isinstance(fmt, HermesFormat) and fmt.template_renders_tools
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = fmt.render(messages, parse_tools(TOOLS), {})
    # As transformers renders it: the tool dicts handed to the template's `tools` argument.
    assert text == tool_tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert json.dumps(WEATHER) in text and json.dumps(ADD) in text
    assert text.endswith("<|im_start|>assistant\n")
    # Without tools, the plain rendering.
    assert fmt.render(messages, None, {}) == tool_tokenizer.apply_chat_template(messages)


def test_a_tool_aware_template_renders_calls_and_results(tool_tokenizer):
    before = copy.deepcopy(HISTORY)
    text = chat_format_for(tool_tokenizer).render(HISTORY, parse_tools(TOOLS), {})
    assert HISTORY == before  # the caller's messages are not changed
    # Arguments sent as JSON text (OpenAI's wire form) are rendered as the object they encode.
    assert _call_text("get_weather", {"city": "Paris"}) in text
    assert _call_text("add", {}) in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n5\n" in text


def test_fallback_lists_the_tools_in_a_system_message(plain_tokenizer):
    fmt = chat_format_for(plain_tokenizer)
    assert not fmt.template_renders_tools
    text = fmt.render([{"role": "user", "content": "Weather?"}], parse_tools(TOOLS), {})
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert f"<tools>\n{json.dumps(WEATHER)}\n{json.dumps(ADD)}\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in system
    assert "SmolLM" not in text  # the template's default system prompt gives way to the tools
    assert text.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_keeps_the_system_message_and_writes_the_history(plain_tokenizer):
    before = copy.deepcopy(HISTORY)
    text = chat_format_for(plain_tokenizer).render(HISTORY, parse_tools(TOOLS), {})
    assert HISTORY == before
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assistant = "<|im_start|>assistant\n" + _call_text("get_weather", {"city": "Paris"})
    assert assistant + "\n" + _call_text("add", {}) + "<|im_end|>" in text
    # Consecutive tool results become one user turn.
    results = "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in text
    assert "<|im_start|>tool" not in text


def test_fallback_without_tools_still_writes_a_history_of_calls(plain_tokenizer):
    fmt = chat_format_for(plain_tokenizer)
    text = fmt.render(HISTORY, None, {})
    assert "# Tools" not in text and "<tool_response>\n18 C" in text
    plain = [{"role": "user", "content": "Hi"}]
    assert fmt.render(plain, None, {}) == plain_tokenizer.apply_chat_template(plain)
    # Results with no call before them, and results apart, each make their own user turn.
    results = [{"role": "tool", "content": c} for c in "ab"]
    text = fmt.render([*results, *plain, results[0]], None, {})
    assert text.count("<|im_start|>user\n<tool_response>\na\n</tool_response>") == 2
    assert "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n" in text


# ---- parsing -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fmt(plain_tokenizer):
    return HermesFormat(plain_tokenizer)


TOOL_LIST = parse_tools(TOOLS)


def _calls(parsed):
    return [(c.name, c.arguments) for c in parsed.tool_calls]


def test_one_call(fmt):
    parsed = fmt.parse(_call_text("add", {"a": 1, "b": 2}), TOOL_LIST)
    assert parsed.content == "" and _calls(parsed) == [("add", {"a": 1, "b": 2})]
    call = parsed.tool_calls[0]
    assert isinstance(call, ToolCall) and call.type == "function" and call.id.startswith("call_")


def test_several_calls_and_content(fmt):
    text = (
        "Let me look.\n\n"
        + _call_text("get_weather", {"city": "Oslo", "unit": "celsius"})
        + "\n"
        + _call_text("add", {"a": 2, "b": 3})
        + "\nDone."
    )
    parsed = fmt.parse(text, TOOL_LIST)
    assert _calls(parsed) == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("add", {"a": 2, "b": 3}),
    ]
    assert parsed.content == "Let me look.\nDone."
    assert len({c.id for c in parsed.tool_calls}) == 2


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "add", "arguments": {"a": 1,',  # malformed JSON
        '{"name": "add", "arguments": [1, 2]}',  # arguments not an object
        '{"name": "nope", "arguments": {}}',  # not one of the tools
        '["add", {}]',
        "",
    ],
)
def test_unreadable_blocks_stay_in_the_content(fmt, body):
    text = f"Sure.\n<tool_call>\n{body}\n</tool_call>"
    parsed = fmt.parse(text, TOOL_LIST)
    assert parsed.tool_calls == [] and parsed.content == text


def test_an_unreadable_block_beside_a_call_stays(fmt):
    bad = "<tool_call>\n{oops}\n</tool_call>"
    parsed = fmt.parse(bad + "\n" + _call_text("add", {"a": 1, "b": 1}), TOOL_LIST)
    assert _calls(parsed) == [("add", {"a": 1, "b": 1})] and parsed.content == bad


def test_lenient_shapes(fmt):
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert _calls(fmt.parse(text, TOOL_LIST)) == [("add", {"a": 1, "b": 2})]
    text = '<tool_call>\n{"name": "add", "parameters": {"a": 5, "b": 6}}\n</tool_call>'
    assert _calls(fmt.parse(text, TOOL_LIST)) == [("add", {"a": 5, "b": 6})]
    # A call the model did not close (it stopped after the JSON) is still a call.
    text = 'Ok <tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 0}}\n'
    parsed = fmt.parse(text, TOOL_LIST)
    assert _calls(parsed) == [("add", {"a": 0, "b": 0})] and parsed.content == "Ok"
    # A call cut inside its JSON is not.
    assert fmt.parse(text[:-8], TOOL_LIST).tool_calls == []


def test_plain_text_is_unchanged(fmt):
    text = "  Paris is sunny. <tool> is not a tag\n"
    assert fmt.parse(text, TOOL_LIST) == (text, [], None)


STREAMED = [
    "",
    "Plain answer with spaces   \n",
    "Checking.\n\n" + _call_text("add", {"a": 1, "b": 2}),
    _call_text("add", {"a": 1, "b": 2}) + "\n" + _call_text("get_weather", {"city": "X"}),
    "A <tool_cal is not a call <b>",
    "Before <tool_call>\n{broken\n</tool_call> after",
    "x\n" + _call_text("add", {"a": 1, "b": 2}) + "\n trailing words",
    "Ok <tool_call>\n" + '{"name": "add", "arguments": {"a": 0, "b": 0}}',
]


@pytest.mark.parametrize("text", STREAMED)
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streamed_deltas_join_to_the_content(fmt, text, chunk):
    parser = fmt.stream_parser(TOOL_LIST)
    deltas = [parser.feed(text[:end]) for end in range(chunk, len(text), chunk)]
    parsed, last = parser.finish(text)
    assert parsed == fmt.parse(text, TOOL_LIST)._replace(tool_calls=parsed.tool_calls)
    assert "".join(deltas) + last == parsed.content
    assert not any("<tool_call>" in d for d in deltas)  # call text is never streamed as content


def test_content_before_a_call_is_streamed_before_the_call_ends(fmt):
    text = "Let me check the weather.\n" + _call_text("get_weather", {"city": "Rome"})
    parser = fmt.stream_parser(TOOL_LIST)
    streamed = "".join(parser.feed(text[:end]) for end in range(1, len(text)))
    assert streamed == "Let me check the weather."
    parsed, last = parser.finish(text)
    assert last == "" and [c.name for c in parsed.tool_calls] == ["get_weather"]


# ---- the grammar of a forced call ----------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(default_model_dir, plain_tokenizer):
    return GrammarCompiler(
        default_model_dir / "tokenizer.json",
        plain_tokenizer.vocab_size,
        plain_tokenizer.eos_token_ids,
    )


def _accepts(grammars, tokenizer, structured, text) -> bool:
    """Whether the constraint admits `text` whole: every token allowed, then the end (nothing
    further allowed, or EOS allowed)."""
    matcher = grammars.matcher(structured)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not all(matcher.consume(t) for t in ids):
        return False
    mask = matcher.next_mask()
    eos = min(tokenizer.eos_token_ids)
    return matcher.is_finished() or bool((int(mask[eos // 32]) >> (eos % 32)) & 1)


def test_required_grammar_admits_a_valid_call_of_any_tool(fmt, grammars, plain_tokenizer):
    required = fmt.constraint(TOOL_LIST, ToolChoice(mode="required"), None)
    assert required is not None and required.kind == "grammar"
    good = [
        _call_text("get_weather", {"city": "Lima", "unit": "celsius"}),
        _call_text("add", {"a": -4, "b": 10}),
    ]
    bad = [
        _call_text("get_weather", {"city": "Lima"}),  # a required property missing
        _call_text("add", {"a": 1.5, "b": 2}),  # not an integer
        _call_text("add", {"a": 1, "b": 2, "c": 3}),  # additionalProperties false
        _call_text("nope", {}),
        "Sure! " + _call_text("add", {"a": 1, "b": 2}),  # nothing before the call
        '<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>',
    ]
    for text in good:
        assert _accepts(grammars, plain_tokenizer, required, text), text
        # The format's own parser reads back what the grammar admits.
        assert len(fmt.parse(text, TOOL_LIST).tool_calls) == 1
    for text in bad:
        assert not _accepts(grammars, plain_tokenizer, required, text), text


def test_named_grammar_admits_only_that_tool(fmt, grammars, plain_tokenizer):
    named = fmt.constraint(TOOL_LIST, ToolChoice(mode="function", name="add"), None)
    assert _accepts(grammars, plain_tokenizer, named, _call_text("add", {"a": 1, "b": 2}))
    weather = _call_text("get_weather", {"city": "Lima", "unit": "celsius"})
    assert not _accepts(grammars, plain_tokenizer, named, weather)


def test_schemas_with_local_references_keep_them(fmt, grammars, plain_tokenizer):
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    parameters = {
        "type": "object",
        "$defs": {"Point": point},
        "properties": {
            "at": {"$ref": "#/$defs/Point"},
            "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}},
        },
        "required": ["at"],
        "additionalProperties": False,
    }
    tools = parse_tools(
        [{"type": "function", "function": {"name": "go", "parameters": parameters}}]
    )
    required = fmt.constraint(tools, ToolChoice(mode="required"), None)
    good = _call_text("go", {"at": {"x": 1}, "path": [{"x": 2}]})
    assert _accepts(grammars, plain_tokenizer, required, good)
    assert not _accepts(grammars, plain_tokenizer, required, _call_text("go", {"at": {"x": "1"}}))


def test_auto_with_a_json_answer_admits_calls_or_the_answer(fmt, grammars, plain_tokenizer):
    answer = SamplingParams(structured={"json": True}).structured
    assert fmt.constraint(TOOL_LIST, ToolChoice(mode="auto"), None) is None
    union = fmt.constraint(TOOL_LIST, ToolChoice(mode="auto"), answer)
    two = _call_text("add", {"a": 1, "b": 2}) + "\n" + _call_text("add", {"a": 3, "b": 4})
    assert _accepts(grammars, plain_tokenizer, union, two)
    assert _accepts(grammars, plain_tokenizer, union, '{"answer": 42}')
    assert not _accepts(grammars, plain_tokenizer, union, "plain words")


# ---- checks ----------------------------------------------------------------------------------


def _tool(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ({"type": "function"}, "tools must be a list"),
        ("get_weather", "tools must be a list"),
        ([], "tools is empty"),
        ([5], r"tools\[0\] must be a dict"),
        ([{"type": "retrieval", "function": {"name": "f"}}], r"tools\[0\]\.type"),
        ([{"type": "function"}], r"tools\[0\]\.function must be a dict"),
        ([{"type": "function", "function": {"name": "f"}, "x": 1}], "unknown keys"),
        ([_tool("f", extra=1)], r"tools\[0\]\.function has unknown keys"),
        ([_tool("")], r"tools\[0\]\.function\.name"),
        ([_tool("has space")], r"tools\[0\]\.function\.name"),
        ([_tool(None)], r"tools\[0\]\.function\.name"),
        ([_tool("f"), _tool("f")], r"tools\[1\]\.function\.name='f'.*distinct"),
        ([_tool(description=3)], r"\.description"),
        ([_tool(strict="yes")], r"\.strict"),
        ([_tool(parameters=[])], r"\.parameters"),
        ([_tool(parameters={"type": "string"})], r"\.parameters\.type"),
        ([_tool(parameters={"type": "object", "properties": {"a": {"type": "strin"}}})], "strin"),
        ([_tool(parameters={"$ref": "#/missing"})], r"\.parameters is not a JSON Schema"),
        ([_tool(parameters={"x": float("nan")})], "plain JSON"),
    ],
)
def test_bad_tools_are_refused(tools, field):
    with pytest.raises(InvalidRequestError, match=field):
        parse_tools(tools)


@pytest.mark.parametrize(
    ("choice", "tools", "field"),
    [
        ("any", TOOL_LIST, "tool_choice='any'"),
        (3, TOOL_LIST, "tool_choice must be"),
        ({"type": "function", "function": {"name": "nope"}}, TOOL_LIST, "'nope'.*not among"),
        ({"name": "nope"}, TOOL_LIST, "not among"),
        ({"type": "tool", "function": {"name": "add"}}, TOOL_LIST, r"tool_choice\.type"),
        ({"type": "function"}, TOOL_LIST, r"tool_choice\.function must be"),
        ({"type": "function", "function": {"name": 1}}, TOOL_LIST, r"tool_choice\.function\.name"),
        ({"type": "function", "function": {"name": "add", "x": 1}}, TOOL_LIST, "unknown keys"),
        ("required", None, "needs tools"),
        ({"name": "add"}, None, "needs tools"),
    ],
)
def test_bad_tool_choice_is_refused(choice, tools, field):
    with pytest.raises(InvalidRequestError, match=field):
        parse_tool_choice(choice, tools)


def test_tool_choice_shapes():
    named = {"type": "function", "function": {"name": "add"}}
    assert parse_tool_choice(named, TOOL_LIST) == ToolChoice(mode="function", name="add")
    assert parse_tool_choice({"name": "add"}, TOOL_LIST) == ToolChoice(mode="function", name="add")
    assert parse_tool_choice("none", None).mode == "none"
    assert parse_tool_choice("auto", None).mode == "auto"


def test_tools_with_other_constraints(fmt):
    json_answer = SamplingParams(structured={"json": True})
    with pytest.raises(InvalidRequestError, match="SamplingParams.structured"):
        ToolChat.build(fmt, TOOLS, "auto", json_answer, json_answer)
    with pytest.raises(InvalidRequestError, match="response_format and tool_choice='required'"):
        ToolChat.build(fmt, TOOLS, "required", None, json_answer)
    with pytest.raises(InvalidRequestError, match="response_format and tool_choice="):
        ToolChat.build(fmt, TOOLS, {"name": "add"}, None, json_answer)
    # "none" offers no tools: nothing to combine.
    assert ToolChat.build(fmt, TOOLS, "none", json_answer, json_answer) is None
    chat = ToolChat.build(fmt, TOOLS, "required", SamplingParams(max_tokens=5), None)
    assert chat is not None and chat.params.max_tokens == 5
    assert chat.params.structured is not None and chat.params.structured.kind == "grammar"


def test_tool_call_in_openai_shape():
    call = ToolCall(id="call_1", name="add", arguments={"a": 1})
    assert call.to_openai() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }
