"""The harmony chat format (gpt-oss): reasoning and answer channels read apart, `to=functions`
calls parsed whole and streamed, the forced-call grammar over the special-token markers, and a
forced call through a real engine (a tiny model with a harmony-style template)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from libkk import SamplingParams, Session
from libkk.api.chat_format import HarmonyFormat, ToolChat, chat_format_for
from libkk.api.tools import parse_tool_choice, parse_tools
from libkk.engine.outputs import RequestOutput
from libkk.errors import InvalidRequestError
from libkk.models.tokenizer import Tokenizer
from libkk.sample.grammar import GrammarCompiler

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
           "<|constrain|>"]  # fmt: skip
# A harmony-style template: messages as <|start|>ROLE<|message|>TEXT<|end|> (the assistant's on its
# final channel), tools listed in a
# developer message, the generation prompt <|start|>assistant.
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n"
    "{%- for tool in tools %}\n{{ tool.function.name }}: {{ tool.function.parameters | tojson }}"
    "{%- endfor %}<|end|>{%- endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}"
    "{%- if m.role == 'assistant' %}<|channel|>final{%- endif %}"
    "<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
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
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = parse_tools([ADD, WEATHER])
REPLY = (
    "<|channel|>analysis<|message|>The user wants a sum.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 5.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Use the tool.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, '
    '"b": 3}<|call|>'
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_model_dir) -> Path:
    """The default model's vocabulary with harmony's markers as special tokens."""
    out = tmp_path_factory.mktemp("harmony-tokenizer")
    tok = HFTokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True) for m in MARKERS])
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|return|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fmt(folder) -> HarmonyFormat:
    found = chat_format_for(Tokenizer.from_folder(folder))
    assert isinstance(found, HarmonyFormat)
    return found


def test_reasoning_and_answer_apart(fmt):
    parsed = fmt.parse(REPLY, [])
    assert parsed.content == "It is 5."
    assert parsed.reasoning == "The user wants a sum."
    assert parsed.tool_calls == []


def test_a_call(fmt):
    parsed = fmt.parse(CALL, TOOLS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert parsed.content == "" and parsed.reasoning == "Use the tool."


def test_what_is_not_a_call_stays_content(fmt):
    unknown = CALL.replace("functions.add", "functions.nope")
    assert fmt.parse(unknown, TOOLS).tool_calls == []
    assert fmt.parse(unknown, TOOLS).content == '{"a": 2, "b": 3}'
    bad_json = CALL.replace('{"a": 2, "b": 3}', "{oops")
    assert fmt.parse(bad_json, TOOLS).content == "{oops"
    preamble = "<|channel|>commentary<|message|>Checking.<|end|>" + REPLY.replace(
        "<|channel|>analysis", "<|start|>assistant<|channel|>analysis"
    )
    assert fmt.parse(preamble, []).content == "Checking.\nIt is 5."
    assert fmt.parse("no markers at all", []) == ("no markers at all", [], None)
    cut = "<|channel|>analysis<|message|>Thinking about"  # cut by max_tokens
    assert fmt.parse(cut, []) == ("", [], "Thinking about")


def test_stream_hands_out_only_the_answer(fmt, folder):
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    for text in (REPLY, CALL, "<|channel|>final<|message|>Straight to it.<|return|>"):
        ids = tok.encode(text, add_special_tokens=False).ids
        parser = fmt.stream_parser(TOOLS)
        deltas = []
        for n in range(1, len(ids) + 1):
            deltas.append(parser.feed(tok.decode(ids[:n], skip_special_tokens=False)))
        parsed, rest = parser.finish(text)
        assert "".join(deltas) + rest == parsed.content
        assert "sum" not in "".join(deltas) and "tool" not in "".join(deltas)


def test_requests_keep_the_markers_and_stop_at_a_call(fmt, folder):
    tok = Tokenizer.from_folder(folder)
    chat = ToolChat.build(fmt, None, "auto", None, None)
    assert chat is not None  # every harmony output is read, tools or not
    assert chat.params.skip_special_tokens is False
    assert {tok.token_to_id("<|call|>"), tok.token_to_id("<|return|>")} <= set(
        chat.params.stop_token_ids
    )
    output = RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=[1], text=REPLY, token_ids=[2],
        delta_text=REPLY, delta_token_ids=[2], finished=True, finish_reason="stop",
    )  # fmt: skip
    done = chat.finish(output)
    assert (done.text, done.reasoning_text, done.tool_calls) == (
        "It is 5.", "The user wants a sum.", None
    )  # fmt: skip
    with pytest.raises(InvalidRequestError, match="response_format"):
        ToolChat.build(fmt, [ADD], "auto", None, SamplingParams(structured={"json": True}))


def test_forced_call_grammar(fmt, folder):
    tok = Tokenizer.from_folder(folder)
    grammars = GrammarCompiler(folder / "tokenizer.json", tok.vocab_size, tok.eos_token_ids)
    structured = fmt.constraint(TOOLS, parse_tool_choice("required", TOOLS), None)

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(structured)
        ids = tok.encode(text, add_special_tokens=False)
        return all(matcher.consume(i) for i in ids) and matcher.is_finished()

    call = CALL[CALL.index("<|start|>assistant") + len("<|start|>assistant") :]
    assert accepts(call)
    assert accepts(call.replace("functions.add", "functions.get_weather").replace(
        '{"a": 2, "b": 3}', '{"city": "Oslo"}'))  # fmt: skip
    assert not accepts(call.replace('"b": 3', '"b": "three"'))
    assert not accepts(CALL)  # no reasoning before a forced call


def test_forced_call_through_the_engine(folder, tmp_path):
    """A tiny random model with the harmony tokenizer: tool_choice="required" makes it write the
    call message (markers are special tokens in its text), which becomes a ToolCall."""
    import jsonschema
    import transformers

    from tests.checkpoints import tiny_llama_config

    tok = Tokenizer.from_folder(folder)
    config = tiny_llama_config(vocab_size=tok.vocab_size + 1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    params = SamplingParams(max_tokens=60, temperature=1.0)
    with Session(str(tmp_path), max_model_len=512, progress=False) as s:
        for seed in range(4):
            out = s.chat(
                [{"role": "user", "content": "2 + 3?"}],
                SamplingParams(max_tokens=60, temperature=1.0, seed=seed),
                tools=[ADD],
                tool_choice="required",
            )
            assert out.finish_reason == "stop", out.text
            [call] = out.tool_calls
            assert call.name == "add"
            jsonschema.validate(call.arguments, ADD["function"]["parameters"])
        assert params.skip_special_tokens  # the caller's params are not changed
