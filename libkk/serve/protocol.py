"""The OpenAI wire format: request bodies as msgspec Structs, their mapping onto SamplingParams and
chat messages, and the JSON shapes of responses, stream chunks and errors.

Only the fields listed here are accepted (an unknown one is a 400, as OpenAI answers it); a few
vLLM-style extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos) reach the sampler too.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from libkk.engine.outputs import Logprob, RequestOutput
from libkk.errors import (
    InvalidRequestError,
    LibkkError,
    PromptTooLongError,
    SamplingParamsError,
    SessionClosedError,
    StructuredOutputError,
)
from libkk.sample.params import SamplingParams

# OpenAI's own limits where libkk would allow more.
MAX_N = 128
MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extras beyond OpenAI's API (vLLM's names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False


class ChatCompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    # A string, a list of strings, a list of token ids or a list of such lists (checked by
    # `completion_prompts`; msgspec takes one list type in a union).
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class RequestError(Exception):
    """A request the server answers with an OpenAI-shaped error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's key
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")
_LEADING_FIELD = re.compile(r"(\w+)")
_REQUEST_FIELDS = {"messages", "tools", "tool_choice", "response_format", "prompt"}


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The request body as `kind`; a RequestError naming the field for bad JSON or a bad field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        path = _PATH.search(text)
        unknown = _UNKNOWN_FIELD.search(text)
        param = path.group(1) if path and path.group(1) else None
        if unknown:
            param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        raise RequestError(f"Invalid request body: {text}", param=param) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"The request body is not valid JSON: {e}") from None


def error_from_libkk(exc: LibkkError, *, param_names: dict[str, str] | None = None) -> RequestError:
    """The HTTP error for a LibkkError raised by the session for one request."""
    message = str(exc)
    if isinstance(exc, PromptTooLongError):
        return RequestError(message, param="messages", code="context_length_exceeded")
    if isinstance(exc, StructuredOutputError):
        return RequestError(message, param="response_format")
    if isinstance(exc, SamplingParamsError):
        field = _SAMPLING_FIELD.search(message)
        name = field.group(1) if field else None
        if name is not None and param_names:
            name = param_names.get(name, name)
        return RequestError(message, param=name)
    if isinstance(exc, InvalidRequestError):
        # The session's messages start with the argument at fault ("tool_choice=...",
        # "tools[0].function...", "messages[1]['role'] ...").
        field = _LEADING_FIELD.match(message)
        name = field.group(1) if field and field.group(1) in _REQUEST_FIELDS else None
        return RequestError(message, param=name)
    if isinstance(exc, SessionClosedError):
        return RequestError(message, status=503, type="server_error", code="shutting_down")
    return RequestError(message, status=500, type="server_error")


def server_error(message: str) -> RequestError:
    return RequestError(message, status=500, type="server_error")


# ---- requests -> SamplingParams ------------------------------------------------------------


def sampling_params(
    req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The request's SamplingParams (n included; the server submits `completion(i)` of it)."""
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n={req.n} is invalid: expected 1 to {MAX_N}", param="n")
    if req.logit_bias:
        raise RequestError("logit_bias is not supported", param="logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise RequestError(f"stop has {len(stop)} strings: at most {MAX_STOP}", param="stop")
    fields: dict[str, Any] = {
        "n": req.n,
        "max_tokens": max_tokens,
        "stop": stop,
        "seed": req.seed,
        "logprobs": logprobs,
        "ignore_eos": req.ignore_eos,
    }
    for name in (
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
    ):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    return SamplingParams(**fields)


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        return sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    except SamplingParamsError as e:
        names = {"logprobs": "top_logprobs"}
        if req.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        raise error_from_libkk(e, param_names=names) from None


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    if req.suffix:
        raise RequestError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of other than n is not supported", param="best_of")
    if req.echo and req.logprobs is not None:
        raise RequestError("echo with logprobs is not supported", param="echo")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise RequestError(
            f"logprobs={req.logprobs} is invalid: expected 0 to {MAX_COMPLETION_LOGPROBS}",
            param="logprobs",
        )
    try:
        return sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    except SamplingParamsError as e:
        raise error_from_libkk(e) from None


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a completion request: a string, token ids, or a non-empty list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt is empty", param="prompt")
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
        "token ids",
        param="prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages with their content as one string (text parts joined, None as "")
    and "developer" as "system", as chat templates take them (tool calls and tool results pass
    on to the chat format)."""
    if not messages:
        raise RequestError("messages is empty: expected at least one message", param="messages")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in _ROLES:
            raise RequestError(
                f"messages[{i}].role={role!r:.40} is invalid: expected one of {', '.join(_ROLES)}",
                param=f"messages[{i}].role",
            )
        converted = {k: v for k, v in message.items() if v is not None}
        converted["role"] = _ROLES[role]
        converted["content"] = _text_content(message.get("content"), i)
        out.append(converted)
    return out


def _text_content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"messages[{i}].content has a part of type {kind!r:.40}: only text parts are "
                    "supported",
                    param=f"messages[{i}].content",
                )
            if not isinstance(part.get("text"), str):
                raise RequestError(
                    f"messages[{i}].content has a text part without a string 'text'",
                    param=f"messages[{i}].content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(
        f"messages[{i}].content must be a string or a list of text parts",
        param=f"messages[{i}].content",
    )


# ---- responses -----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def finish_reason(output: RequestOutput) -> str | None:
    if output.tool_calls:
        return "tool_calls"
    return output.finish_reason


def usage(prompt_tokens: int, outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """Usage counts: the prompt once (as OpenAI counts it for n > 1), every choice's tokens."""
    completion = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def tool_calls_json(output: RequestOutput) -> list[dict[str, Any]]:
    """The output's tool calls in OpenAI's message shape (arguments as a JSON string)."""
    return [call.to_openai() for call in output.tool_calls or ()]


class TokenText:
    """Token strings for log-probabilities, decoded one token at a time and remembered."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            # An id past the tokenizer's vocabulary (a model's padded embedding rows) has no text.
            padded = token_id >= self._tokenizer.vocab_size
            text = "" if padded else self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def chat_logprobs(logprobs: Sequence[Logprob], token_text: TokenText, top: int) -> dict:
    """`choices[i].logprobs` of a chat completion: {"content": [...]} for these tokens."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(t, v) for t, v in lp.top[:top]],
            }
            for lp in logprobs
        ],
        "refusal": None,
    }


def completion_logprobs(
    logprobs: Sequence[Logprob], token_text: TokenText, top: int, offset: int
) -> dict:
    """`choices[i].logprobs` of a completion; text offsets count from `offset`."""
    tokens = [token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(t): v for t, v in lp.top[:top]} for lp in logprobs],
        "text_offset": offsets,
    }


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
