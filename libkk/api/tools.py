"""Tools offered to a chat, as OpenAI's API takes them: `tools`, `tool_choice` and the tool calls
inside a conversation's history, checked and put in plain form for the chat formats
(`libkk/api/chat_format.py`).

Every malformed value raises InvalidRequestError naming its field (`tools[1].function.name`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, Literal

import msgspec

from libkk.errors import InvalidRequestError
from libkk.sample.grammar import json_rule, lark_error

# OpenAI's rule for function names; it also keeps them safe inside grammars and prompts.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS = ("type", "function")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_MODES = ("auto", "none", "required")


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """One function the model may call."""

    name: str
    description: str | None
    # The arguments' JSON Schema, always of an object ("type": "object" added where absent).
    parameters: dict[str, Any]
    # The tool as given (OpenAI's shape), which chat templates render.
    spec: dict[str, Any]


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """ "auto": the model may call tools or answer; "none": no tools offered; "required": it
    must call one; "function": it must call `name`."""

    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the output must be a call (a grammar enforces it)."""
        return self.mode in ("required", "function")


def parse_tools(tools: Any) -> list[Tool]:
    """Checks OpenAI's `tools`: a non-empty list of {"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}} with distinct names and schemas llguidance can
    compile."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(
            f"tools must be a list of {{'type': 'function', 'function': {{...}}}} dicts, got "
            f"{type(tools).__name__}: {tools!r:.80}"
        )
    if not tools:
        raise InvalidRequestError("tools is empty: expected at least one tool, or tools=None")
    out: list[Tool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(
                f"{where} must be a dict with 'type' and 'function', got "
                f"{type(tool).__name__}: {tool!r:.80}"
            )
        _check_keys(where, tool, _TOOL_KEYS)
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"{where}.type={tool.get('type')!r:.40} is invalid: expected 'function'"
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(
                f"{where}.function must be a dict with 'name' and 'parameters', got "
                f"{type(function).__name__}: {function!r:.80}"
            )
        where += ".function"
        _check_keys(where, function, _FUNCTION_KEYS)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.name={name!r:.80} is invalid: expected 1 to 64 letters, digits, "
                "'_' or '-'"
            )
        if name in seen:
            raise InvalidRequestError(
                f"{where}.name={name!r} is invalid: another tool has that name; expected "
                "distinct names"
            )
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(
                f"{where}.description={description!r:.80} is invalid: expected a string"
            )
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.strict={strict!r:.80} is invalid: expected a bool")
        parameters = _parameters(where + ".parameters", function.get("parameters"))
        spec = _plain_json(where, tool)
        out.append(Tool(name=name, description=description, parameters=parameters, spec=spec))
    return out


def parse_tool_choice(choice: Any, tools: Sequence[Tool] | None) -> ToolChoice:
    """Checks OpenAI's `tool_choice`: "auto", "none", "required" or {"type": "function",
    "function": {"name": ...}} (also {"name": ...} alone). "required" and a named function need
    tools; the name must be one of them."""
    if isinstance(choice, str):
        if choice not in _MODES:
            raise InvalidRequestError(
                f"tool_choice={choice!r:.40} is invalid: expected 'auto', 'none', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}"
            )
        result = ToolChoice(mode=choice)  # type: ignore[arg-type]
    elif isinstance(choice, Mapping):
        if "function" in choice or "type" in choice:
            _check_keys("tool_choice", choice, ("type", "function"))
            if choice.get("type") != "function":
                raise InvalidRequestError(
                    f"tool_choice.type={choice.get('type')!r:.40} is invalid: expected 'function'"
                )
            function = choice.get("function")
            where = "tool_choice.function"
            if not isinstance(function, Mapping):
                raise InvalidRequestError(
                    f"{where} must be a dict {{'name': ...}}, got {type(function).__name__}: "
                    f"{function!r:.80}"
                )
        else:
            function, where = choice, "tool_choice"
        _check_keys(where, function, ("name",))
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.name={name!r:.80} is invalid: expected a string")
        result = ToolChoice(mode="function", name=name)
    else:
        raise InvalidRequestError(
            f"tool_choice must be 'auto', 'none', 'required' or a dict naming a function, got "
            f"{type(choice).__name__}: {choice!r:.80}"
        )
    if result.forced and not tools:
        raise InvalidRequestError(
            f"tool_choice={choice!r:.80} needs tools: expected tools=[...] beside it"
        )
    if result.name is not None and tools and result.name not in {t.name for t in tools}:
        raise InvalidRequestError(
            f"tool_choice names the function {result.name!r:.80}, which is not among tools: "
            f"expected one of {[t.name for t in tools]}"
        )
    return result


def normalize_messages(messages: Any) -> Any:
    """A conversation whose assistant tool calls are in the form templates render: arguments
    given as JSON text (OpenAI's wire form) decoded to a dict, and `content: None` beside tool
    calls made "". Anything else passes unchanged (the tokenizer checks the messages)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        return messages
    out = []
    for i, message in enumerate(messages):
        if not (isinstance(message, Mapping) and message.get("tool_calls") is not None):
            out.append(message)
            continue
        where = f"messages[{i}]['tool_calls']"
        calls = message["tool_calls"]
        if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
            raise InvalidRequestError(
                f"{where} must be a list of tool calls, got {type(calls).__name__}: {calls!r:.80}"
            )
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        message["tool_calls"] = [_history_call(f"{where}[{j}]", c) for j, c in enumerate(calls)]
        out.append(message)
    return out


def history_call(call: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of a tool call from normalize_messages' output."""
    function = call.get("function", call)
    return function["name"], function["arguments"]


def _history_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise InvalidRequestError(
            f"{where} must be a dict {{'id', 'type': 'function', 'function': {{'name', "
            f"'arguments'}}}}, got {type(call).__name__}: {call!r:.80}"
        )
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequestError(
            f"{where}['function'] must be a dict with 'name' and 'arguments', got "
            f"{type(function).__name__}: {function!r:.80}"
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"{where}['function']['name']={name!r:.80} is invalid: expected a string"
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise InvalidRequestError(
                f"{where}['function']['arguments'] is not valid JSON ({e}): {arguments!r:.80}"
            ) from None
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError(
            f"{where}['function']['arguments']={arguments!r:.80} is invalid: expected a JSON "
            "object (as text or a dict)"
        )
    call = dict(call)
    call["function"] = {**function, "arguments": dict(arguments)}
    return call


def _parameters(where: str, parameters: Any) -> dict[str, Any]:
    """The arguments' schema, an object schema that llguidance compiles."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(
            f"{where}={parameters!r:.80} is invalid: expected a JSON Schema as a dict"
        )
    schema = _plain_json(where, parameters)
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise InvalidRequestError(
            f"{where}.type={kind!r:.40} is invalid: expected 'object' (arguments are an object)"
        )
    error = _schema_error(json.dumps(schema, sort_keys=True))
    if error is not None:
        raise InvalidRequestError(f"{where} is not a JSON Schema libkk can enforce: {error}")
    return schema


@lru_cache(maxsize=256)
def _schema_error(schema_json: str) -> str | None:
    # NOTE: cached by the schema's text: a server sees the same tools on every request.
    return lark_error("start: " + json_rule(json.loads(schema_json)))


def _plain_json(where: str, value: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-JSON copy (only dicts, lists, str, numbers, bools, None) of a caller's value."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{where} must hold plain JSON values: {e}") from None


def _check_keys(where: str, value: Mapping[str, Any], allowed: Sequence[str]) -> None:
    extra = sorted(str(k) for k in value if k not in allowed)
    if extra:
        raise InvalidRequestError(
            f"{where} has unknown keys {extra}: expected among {list(allowed)}"
        )
