"""Chat formats: how a family of chat templates offers tools to the model, how the model writes
its calls, and how those calls are read back.

A `ChatFormat` does three things for one tokenizer: render a conversation (with tools) into the
prompt; give the grammar that forces a call ("required" or a named tool); parse the output text
into content and `ToolCall`s, whole (`parse`) or as a stream (`stream_parser`). `chat_format_for`
picks the first registered format that claims the tokenizer's template; `HermesFormat`, the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format of Qwen2.5, Qwen3 and
Hermes-style templates, claims every template and comes last.

`ToolChat` applies one format to one request: its sampling parameters, then its outputs.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any, NamedTuple

import msgspec

from libkk.api.tools import (
    Tool,
    ToolChoice,
    history_call,
    normalize_messages,
    parse_tool_choice,
    parse_tools,
)
from libkk.engine.outputs import RequestOutput, ToolCall
from libkk.errors import InvalidRequestError, LibkkError
from libkk.models.tokenizer import Tokenizer
from libkk.sample.grammar import json_rule, lark_error
from libkk.sample.params import SamplingParams, StructuredOutput


class ParsedMessage(NamedTuple):
    """An assistant message read from output text."""

    content: str  # the text with the calls taken out ("" when nothing else was said)
    tool_calls: list[ToolCall]
    reasoning: str | None = None  # a reasoning channel's text (formats that have one)


class StreamParser(ABC):
    """Reads one streamed output. Invariant: the concatenation of what `feed` returned and the
    delta `finish` returns equals the final content."""

    @abstractmethod
    def feed(self, text: str) -> str:
        """Takes the output text so far; returns the new content that can be handed out (text
        that may belong to a call is held back)."""

    @abstractmethod
    def finish(self, text: str) -> tuple[ParsedMessage, str]:
        """Takes the final text; returns the parsed message and the content not yet handed out."""


class ChatFormat(ABC):
    """How one family of chat templates offers tools and writes calls.

    Invariants: `render` never changes the caller's messages; every complete output of the
    grammar `constraint` gives for a forced choice parses into exactly one call of an allowed
    tool, with arguments valid under its schema; `parse` never raises on model text: what it
    cannot read as a call stays in the content.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    @abstractmethod
    def matches(cls, tokenizer: Tokenizer) -> bool:
        """Whether this format is the one of the tokenizer's chat template."""

    @abstractmethod
    def render(
        self, messages: Any, tools: Sequence[Tool] | None, template_kwargs: Mapping[str, Any]
    ) -> str:
        """The prompt text for `messages` (OpenAI's shapes, tool calls and tool results
        included) with `tools` offered (None: no tools), ending with the generation prompt."""

    @abstractmethod
    def constraint(
        self, tools: Sequence[Tool], choice: ToolChoice, answer: StructuredOutput | None
    ) -> StructuredOutput | None:
        """The output constraint for `choice` (never "none"): a forced choice gets a grammar
        that admits one call; "auto" gets `answer` (the response_format's JSON constraint)
        widened to admit calls too, or None when unconstrained."""

    @abstractmethod
    def parse(self, text: str, tools: Sequence[Tool]) -> ParsedMessage:
        """Content and calls (to `tools` only) of a finished output's text."""

    @abstractmethod
    def stream_parser(self, tools: Sequence[Tool]) -> StreamParser:
        """A parser for one streamed output."""

    def prepare(self, params: SamplingParams) -> SamplingParams:
        """The sampling parameters a request with tools needs (a format whose calls are
        written in special tokens asks for them in the text here)."""
        return params

    # Whether every chat output is read through `parse`, tools or not (a format whose answer
    # and reasoning are separate channels).
    reads_every_output = False


_FORMATS: list[type[ChatFormat]] = []


def register_chat_format(cls: type[ChatFormat]) -> type[ChatFormat]:
    """Adds a format, tried before those registered earlier (the catch-all stays last)."""
    _FORMATS.insert(0, cls)
    return cls


def chat_format_for(tokenizer: Tokenizer) -> ChatFormat:
    """The format of the tokenizer's chat template."""
    for cls in _FORMATS:
        if cls.matches(tokenizer):
            return cls(tokenizer)
    raise AssertionError("HermesFormat claims every template")


# ---- Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call> ------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# A block runs to its closing tag, or to the end of the text (a call the model did not close).
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_PROBE = "libkk_tool_support_probe"

# NOTE: the fallback for templates that cannot render tools (SmolLM2's among them) asks for the
# calls in the same words and tags as Qwen2.5's template, so one parser and one grammar serve both.
_FALLBACK_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@register_chat_format
class HermesFormat(ChatFormat):
    """Calls written as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
    block per call (Qwen2.5, Qwen3, Hermes).

    Rendering: through the template's `tools` argument where it renders tools (checked once by
    rendering a probe tool); otherwise the fallback: a system message listing the tools (one JSON
    signature a line, inside <tools></tools>) and asking for <tool_call> blocks, put before the
    caller's system message text; assistant tool calls in the history become <tool_call> blocks
    and tool results become user turns of <tool_response> blocks, as Qwen2.5's template writes
    them.

    Parsing: each block whose JSON names a known tool and has object arguments ("arguments" or
    "parameters", an object or JSON text of one) is a call; other blocks stay in the content.
    """

    @classmethod
    def matches(cls, tokenizer: Tokenizer) -> bool:
        return True

    @cached_property
    def template_renders_tools(self) -> bool:
        """Whether the chat template writes the tools it is given into the prompt."""
        probe = {
            "type": "function",
            "function": {
                "name": _PROBE,
                "description": "probe",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=[probe]
            )
        except LibkkError:
            return False
        return _PROBE in text

    def render(
        self, messages: Any, tools: Sequence[Tool] | None, template_kwargs: Mapping[str, Any]
    ) -> str:
        messages = normalize_messages(messages)
        kwargs = dict(template_kwargs)
        if (tools or _has_tool_turns(messages)) and not self.template_renders_tools:
            messages = _fallback_messages(messages, tools)
        elif tools:
            kwargs["tools"] = [t.spec for t in tools]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)

    def constraint(
        self, tools: Sequence[Tool], choice: ToolChoice, answer: StructuredOutput | None
    ) -> StructuredOutput | None:
        if choice.forced:
            allowed = [t for t in tools if choice.mode == "required" or t.name == choice.name]
            return StructuredOutput(grammar=_call_grammar(allowed, "start: block"))
        if answer is None:
            return None
        if answer.kind == "json":
            schema: dict[str, Any] = {"type": "object"}
        elif answer.kind == "json_schema":
            assert answer.json_schema is not None
            schema = answer.json_schema
        else:  # response_format maps only onto these two
            raise InvalidRequestError(
                f"tools with a {answer.kind} constraint: expected a JSON response_format"
            )
        head = f'start: calls | answer\ncalls: block ("\\n" block)*\nanswer: {json_rule(schema)}'
        grammar = _call_grammar(tools, head)
        if (error := lark_error(grammar)) is not None:
            raise InvalidRequestError(f"response_format's schema cannot be enforced: {error}")
        return StructuredOutput(grammar=grammar)

    def parse(self, text: str, tools: Sequence[Tool]) -> ParsedMessage:
        names = {t.name for t in tools}
        pieces: list[str] = []  # content between the calls
        calls: list[ToolCall] = []
        start = 0
        for block in _BLOCK.finditer(text):
            call = _read_call(block.group(1), names)
            if call is None:
                continue
            pieces.append(text[start : block.start()])
            calls.append(call)
            start = block.end()
        if not calls:
            return ParsedMessage(text, [])
        pieces.append(text[start:])
        # The whitespace beside a call belongs to its block.
        trimmed = [
            p.rstrip() if i == 0 else p.strip() if i < len(pieces) - 1 else p.lstrip()
            for i, p in enumerate(pieces)
        ]
        return ParsedMessage("\n".join(p for p in trimmed if p), calls)

    def stream_parser(self, tools: Sequence[Tool]) -> StreamParser:
        return _HermesStream(self, tools)


class _HermesStream(StreamParser):
    """Hands out text up to the first <tool_call>; the rest waits for the end. Text that may be
    the start of a tag, and trailing whitespace (it belongs to a following call), is held back
    until what follows shows otherwise."""

    def __init__(self, fmt: HermesFormat, tools: Sequence[Tool]) -> None:
        self._format = fmt
        self._tools = tools
        self._emitted = 0  # characters of the text handed out
        self._in_call = False

    def feed(self, text: str) -> str:
        if self._in_call or _OPEN in text:
            self._in_call = True
            return ""
        end = len(text)
        for k in range(min(len(_OPEN) - 1, end), 0, -1):
            if _OPEN.startswith(text[end - k :]):
                end -= k
                break
        safe = text[:end].rstrip()
        delta = safe[self._emitted :] if len(safe) > self._emitted else ""
        self._emitted += len(delta)
        return delta

    def finish(self, text: str) -> tuple[ParsedMessage, str]:
        parsed = self._format.parse(text, self._tools)
        # NOTE: what was handed out is text before any tag, less trailing whitespace: a prefix of
        # the content by how parse cuts it.
        return parsed, parsed.content[self._emitted :]


def _call_grammar(tools: Sequence[Tool], head: str) -> str:
    """A Lark grammar: `head` rules plus `block`, one <tool_call> block calling one of `tools`
    with arguments valid under its schema."""
    lines = [head, f'block: "{_OPEN}\\n" call "\\n{_CLOSE}"']
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                "arguments": _rebased(tool.parameters, "#/properties/arguments"),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        lines.append(f"call_{i}: {json_rule(schema)}")
    return "\n".join(lines)


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with its local references ("#/$defs/...", "#") pointing under `root`, where it
    sits inside the call's schema."""
    if isinstance(schema, dict):
        return {
            k: root + v[1:]
            if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/"))
            else _rebased(v, root)
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    return schema


def _read_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), name=data["name"], arguments=arguments)


def new_call_id() -> str:
    """A fresh id for a tool call, in OpenAI's style."""
    return "call_" + secrets.token_hex(12)


def _has_tool_turns(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls"))
        for m in messages
    )


def _fallback_messages(messages: Any, tools: Sequence[Tool] | None) -> Any:
    """The conversation for a template that renders no tools: the tools in a system message,
    calls and results written as Qwen2.5's template writes them."""
    if not isinstance(messages, list):
        return messages  # the tokenizer reports what it got
    out: list[Any] = []
    results_at: int | None = None  # index in `out` of the user turn collecting tool results
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
            out.append(message)
            continue
        role, content = message.get("role"), message["content"]
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if results_at == len(out) - 1:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
                results_at = len(out) - 1
            continue
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                f"{_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{_CLOSE}"
                for name, arguments in map(history_call, message["tool_calls"])
            ]
            message = {
                "role": "assistant",
                "content": "\n".join(([content] if content else []) + blocks),
            }
        out.append(message)
    if tools:
        listing = "\n".join(json.dumps(t.spec) for t in tools)
        preamble = _FALLBACK_PREAMBLE.format(tools=listing)
        first = out[0] if out else None
        if isinstance(first, Mapping) and first.get("role") == "system":
            system = {**first, "content": f"{first['content']}\n\n{preamble}"}
            out[0] = system
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


# ---- harmony (gpt-oss): channels and `to=functions.NAME` calls -----------------------------

_START, _CHANNEL, _MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_CONSTRAIN, _CALL = "<|constrain|>", "<|call|>"
_ENDS = ("<|end|>", "<|return|>", _CALL)
# One message: an optional role after <|start|>, a header up to <|message|>, a body up to an end
# token or the end of the text.
_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>[^<]*)?(?P<header>(?:(?!<\|message\|>).)*)<\|message\|>"
    r"(?P<body>(?:(?!<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>).)*)"
    r"(?P<end><\|end\|>|<\|return\|>|<\|call\|>)?",
    re.S,
)
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


@register_chat_format
class HarmonyFormat(ChatFormat):
    """OpenAI's harmony format (gpt-oss): the reply is a sequence of messages, each
    `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY` ended by <|end|>,
    <|return|> (the last) or <|call|> (a tool call), later ones after `<|start|>assistant`.
    The "analysis" channel is reasoning (`reasoning_text`), "final" the answer, and a
    "commentary" message to `functions.NAME` a call with JSON arguments; a commentary message to
    no one is a preamble shown to the user, kept in the content.

    The markers are special tokens: requests ask for them in the text (skip_special_tokens
    off) and stop at <|call|> as at <|return|>. Tools render through the template's `tools`
    argument (gpt-oss's template writes them as a TypeScript-like namespace). A forced call is
    a grammar over the markers: the call message alone, its arguments valid under the schema.
    """

    reads_every_output = True

    @classmethod
    def matches(cls, tokenizer: Tokenizer) -> bool:
        template = tokenizer.chat_template or ""
        return _CHANNEL in template and _MESSAGE in template

    def render(
        self, messages: Any, tools: Sequence[Tool] | None, template_kwargs: Mapping[str, Any]
    ) -> str:
        kwargs = dict(template_kwargs)
        if tools:
            kwargs["tools"] = [t.spec for t in tools]
        return self.tokenizer.apply_chat_template(
            normalize_messages(messages), add_generation_prompt=True, **kwargs
        )

    def prepare(self, params: SamplingParams) -> SamplingParams:
        stops = [
            i
            for i in (self.tokenizer.token_to_id(t) for t in ("<|return|>", _CALL))
            if i is not None and i not in params.stop_token_ids
        ]
        return msgspec.structs.replace(
            params,
            skip_special_tokens=False,
            stop_token_ids=[*params.stop_token_ids, *stops],
        )

    def constraint(
        self, tools: Sequence[Tool], choice: ToolChoice, answer: StructuredOutput | None
    ) -> StructuredOutput | None:
        if choice.forced:
            allowed = [t for t in tools if choice.mode == "required" or t.name == choice.name]
            lines = ["start: " + " | ".join(f"call_{i}" for i in range(len(allowed)))]
            for i, tool in enumerate(allowed):
                lines.append(
                    f'call_{i}: {_CHANNEL} "commentary to=functions.{tool.name} " {_CONSTRAIN} '
                    f'"json" {_MESSAGE} {json_rule(tool.parameters)} {_CALL}'
                )
            return StructuredOutput(grammar="\n".join(lines))
        if answer is not None:
            raise InvalidRequestError(
                "tools with response_format: this model's harmony format writes its answer "
                "after its reasoning, which a response_format cannot constrain together with "
                "calls; give one of them"
            )
        return None

    def parse(self, text: str, tools: Sequence[Tool]) -> ParsedMessage:
        names = {t.name for t in tools}
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        matched = 0  # characters covered by messages
        for m in _HARMONY_MESSAGE.finditer(text):
            if text[matched : m.start()].strip():  # text outside any message: the answer
                content.append(_strip_markers(text[matched : m.start()]))
            matched = m.end()
            header, body = m["header"], m["body"]
            channel = _HARMONY_CHANNEL.search(header)
            recipient = _HARMONY_RECIPIENT.search(header)
            kind = channel[1] if channel else "final"
            if recipient is not None:
                call = _harmony_call(recipient[1], body, names)
                if call is not None:
                    calls.append(call)
                    continue
                content.append(body)  # a call the tools do not know, or unreadable: as written
            elif kind == "analysis":
                reasoning.append(body)
            else:  # final, or a commentary preamble
                content.append(body)
        if text[matched:].strip():
            content.append(_strip_markers(text[matched:]))
        return ParsedMessage(
            "\n".join(c for c in content if c), calls, "\n".join(reasoning) or None
        )

    def stream_parser(self, tools: Sequence[Tool]) -> StreamParser:
        return _HarmonyStream(self, tools)


class _HarmonyStream(StreamParser):
    """Hands out the answer as it grows: the content `parse` reads from the text so far, once
    the message it belongs to has its header (so reasoning and calls never leak into it)."""

    def __init__(self, fmt: HarmonyFormat, tools: Sequence[Tool]) -> None:
        self._format = fmt
        self._tools = tools
        self._emitted = ""

    def feed(self, text: str) -> str:
        # The open message (after the last <|start|>, or the first one) waits while its header
        # is incomplete (it may be reasoning or a call) and while it is an unfinished call.
        last = max(text.rfind(_START), 0)
        header, sep, _ = text[last:].partition(_MESSAGE)
        if not sep or (_HARMONY_RECIPIENT.search(header) and not text.endswith(_ENDS)):
            text = text[:last]
        content = self._format.parse(text, self._tools).content
        if not content.startswith(self._emitted):
            return ""  # parse regrouped what was handed out: the rest waits for finish
        delta = content[len(self._emitted) :]
        self._emitted = content
        return delta

    def finish(self, text: str) -> tuple[ParsedMessage, str]:
        parsed = self._format.parse(text, self._tools)
        if not parsed.content.startswith(self._emitted):
            return parsed, ""
        return parsed, parsed.content[len(self._emitted) :]


def _harmony_call(recipient: str, body: str, names: set[str]) -> ToolCall | None:
    if recipient not in names:
        return None
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), name=recipient, arguments=arguments)


def _strip_markers(text: str) -> str:
    for marker in (_START, _CHANNEL, _MESSAGE, _CONSTRAIN, *_ENDS):
        text = text.replace(marker, "")
    return text.strip()


# ---- one request ---------------------------------------------------------------------------


class ToolChat:
    """The tools of one chat request: its sampling parameters and the reading of its outputs."""

    def __init__(
        self, fmt: ChatFormat, tools: list[Tool], choice: ToolChoice, params: SamplingParams
    ) -> None:
        self.format = fmt
        self.tools = tools
        self.choice = choice
        self.params = params

    @classmethod
    def build(
        cls,
        fmt: ChatFormat,
        tools: Any,
        tool_choice: Any,
        params: SamplingParams | None,
        answer_params: SamplingParams | None,
    ) -> ToolChat | None:
        """Checks `tools` and `tool_choice`; None when no tools are offered (tools None or
        tool_choice "none"). `params` are the caller's; `answer_params` the same with the
        response_format's constraint, if any."""
        if tools is None:
            choice = parse_tool_choice(tool_choice, None)
            return cls._reader(fmt, choice, answer_params or params)
        parsed = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, parsed)
        if choice.mode == "none":
            return cls._reader(fmt, choice, answer_params or params)
        if params is not None and params.structured is not None:
            raise InvalidRequestError(
                "tools and SamplingParams.structured are both set: tool calls are constrained by "
                "their schemas; give response_format (with tool_choice='auto') or no tools"
            )
        answer = answer_params.structured if answer_params is not None else None
        if answer is not None and choice.forced:
            raise InvalidRequestError(
                f"response_format and tool_choice={_choice_text(choice)} are both set: a forced "
                "call leaves no room for a formatted answer; give one of them"
            )
        structured = fmt.constraint(parsed, choice, answer)
        base = answer_params or params or SamplingParams()
        sampling = fmt.prepare(msgspec.structs.replace(base, structured=structured))
        return cls(fmt, parsed, choice, sampling)

    @classmethod
    def _reader(
        cls, fmt: ChatFormat, choice: ToolChoice, params: SamplingParams | None
    ) -> ToolChat | None:
        """A request without tools: read through the format only where it reads every output."""
        if not fmt.reads_every_output:
            return None
        return cls(fmt, [], choice, fmt.prepare(params or SamplingParams()))

    def finish(self, output: RequestOutput) -> RequestOutput:
        """A finished output with its calls parsed out."""
        parsed = self.format.parse(output.text, self.tools)
        return msgspec.structs.replace(
            output,
            text=parsed.content,
            delta_text=parsed.content,
            tool_calls=parsed.tool_calls if self.tools else None,
            reasoning_text=parsed.reasoning,
        )

    def stream(self, outputs: Iterator[RequestOutput]) -> Iterator[RequestOutput]:
        """The outputs of a stream with their text as content: deltas of call text held back,
        the calls on the last output."""
        parser = self.format.stream_parser(self.tools)
        handed_out = ""
        try:
            for output in outputs:
                if output.finished:
                    parsed, delta = parser.finish(output.text)
                    yield msgspec.structs.replace(
                        output,
                        text=parsed.content,
                        delta_text=delta,
                        tool_calls=parsed.tool_calls if self.tools else None,
                        reasoning_text=parsed.reasoning,
                    )
                else:
                    delta = parser.feed(output.text)
                    handed_out += delta
                    yield msgspec.structs.replace(output, text=handed_out, delta_text=delta)
        finally:
            close = getattr(outputs, "close", None)
            if close is not None:
                close()  # an abandoned stream aborts its request


def _choice_text(choice: ToolChoice) -> str:
    return repr(choice.mode) if choice.name is None else f"{{'name': {choice.name!r}}}"
