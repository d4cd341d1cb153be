"""What crosses libkk's C ABI: reading what the host passed (prompts, sampling parameters,
callbacks, JSON) and writing results into the host's buffers, all or nothing.

build.py embeds this file in libkk.so beside _embedded.py, as the module `_libkk_marshal`.
"""

from __future__ import annotations

from typing import Any

from _libkk_c import ffi, lib

try:
    import msgspec

    from libkk import RequestOutput, SamplingParams, Session
except Exception:  # noqa: BLE001 - _embedded.py reports it through kk_runtime_init
    pass

Cdata = Any  # a cffi pointer

_SEED_NONE = -(2**63)  # KK_SEED_NONE
_MAX_TOKENS_NONE = -1  # KK_MAX_TOKENS_NONE
FINISH_REASONS = {
    "stop": lib.KK_FINISH_STOP,
    "length": lib.KK_FINISH_LENGTH,
    "abort": lib.KK_FINISH_ABORT,
    "error": lib.KK_FINISH_ERROR,
}


class Fail(Exception):
    """A failure with its status: the call returns `status` and `message` goes to
    kk_last_error()."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ---- reading what the host passed ----------------------------------------------------------------


def read_text(pointer: Cdata, what: str) -> str:
    data = ffi.string(pointer)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Fail(lib.KK_ERR_INVALID_ARGUMENT, f"{what} is not valid UTF-8: {exc}") from None


def read_json(pointer: Cdata, what: str, status: int) -> Any:
    try:
        return msgspec.json.decode(ffi.string(pointer))
    except msgspec.DecodeError as exc:
        raise Fail(status, f"{what} is not valid JSON: {exc}") from None


def read_json_object(pointer: Cdata, what: str, status: int) -> dict[str, Any]:
    value = read_json(pointer, what, status)
    if not isinstance(value, dict):
        raise Fail(
            status,
            f"{what} must be a JSON object, got {type(value).__name__}: "
            f"{msgspec.json.encode(value).decode()[:80]}",
        )
    return value


def read_prompt(session: Session, prompt: Cdata) -> str | list[int]:
    """The prompt as libkk takes it: text, or token ids (a chat is rendered to token ids)."""
    if prompt.text != ffi.NULL:
        return read_text(prompt.text, "prompt->text")
    if prompt.token_ids != ffi.NULL:
        count, limit = prompt.n_tokens, session.max_model_len
        if count > limit:  # checked before reading: never read past what could be an array
            raise Fail(
                lib.KK_ERR_PROMPT_TOO_LONG,
                f"prompt->n_tokens is {count}: more than max_model_len ({limit})",
            )
        if count == 0:
            raise Fail(lib.KK_ERR_INVALID_REQUEST, "prompt has no tokens: n_tokens is 0")
        return list(ffi.unpack(prompt.token_ids, count))
    messages = read_json(prompt.messages_json, "prompt->messages_json", lib.KK_ERR_INVALID_REQUEST)
    tokenizer = session.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class Callbacks:
    """A request's on_token and should_abort callbacks, copied out of its kk_request_params."""

    __slots__ = ("on_token", "on_token_data", "should_abort", "should_abort_data")

    def __init__(self, params: Cdata) -> None:
        self.on_token = None
        self.should_abort = None
        self.on_token_data = self.should_abort_data = ffi.NULL
        if params != ffi.NULL:
            if params.on_token != ffi.NULL:
                self.on_token, self.on_token_data = params.on_token, params.on_token_data
            if params.should_abort != ffi.NULL:
                self.should_abort = params.should_abort
                self.should_abort_data = params.should_abort_data

    def stop_requested(self) -> bool:
        return self.should_abort is not None and bool(self.should_abort(self.should_abort_data))

    def deliver(self, output: RequestOutput) -> bool:
        """Hands the new output to on_token; False when the callback asks to stop."""
        if self.on_token is None or not (output.delta_text or output.delta_token_ids):
            return True
        data = output.delta_text.encode("utf-8", "replace")
        ids = output.delta_token_ids
        array = ffi.new("int32_t[]", ids)
        return bool(self.on_token(data, len(data), array, len(ids), self.on_token_data))


def read_sampling_params(params: Cdata) -> SamplingParams:
    if params == ffi.NULL:
        return SamplingParams()
    fields: dict[str, Any] = {
        "max_tokens": None if params.max_tokens == _MAX_TOKENS_NONE else params.max_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "seed": None if params.seed == _SEED_NONE else params.seed,
        "ignore_eos": bool(params.ignore_eos),
    }
    if params.sampling_json != ffi.NULL:
        fields.update(
            read_json_object(
                params.sampling_json, "params->sampling_json", lib.KK_ERR_SAMPLING_PARAMS
            )
        )
    if params.structured_json != ffi.NULL:
        if "structured" in fields:
            raise Fail(
                lib.KK_ERR_SAMPLING_PARAMS,
                'params->structured_json and a "structured" key in params->sampling_json are '
                "both set: give one of them",
            )
        fields["structured"] = read_json_object(
            params.structured_json, "params->structured_json", lib.KK_ERR_SAMPLING_PARAMS
        )
    return SamplingParams.from_dict(fields)


def copy_ids(buffer: Cdata, ids: list[int]) -> None:
    if ids:
        ffi.memmove(buffer, ffi.new("int32_t[]", ids), 4 * len(ids))


# ---- writing results into caller buffers ----------------------------------------------------------


def encode(value: Any, fmt: int) -> bytes:
    if fmt == lib.KK_FORMAT_MSGPACK:
        return msgspec.msgpack.encode(value)
    return msgspec.json.encode(value)


def needed(data: bytes, fmt: int) -> int:
    return len(data) + (0 if fmt == lib.KK_FORMAT_MSGPACK else 1)


def copy_bytes(buffer: Cdata, data: bytes, terminate: bool) -> None:
    ffi.memmove(buffer, data, len(data))
    if terminate:
        buffer[len(data)] = b"\0"


def write_encoded(value: Any, fmt: int, buffer: Cdata, capacity: int, length: Cdata) -> None:
    data = encode(value, fmt)
    length[0] = len(data)
    if capacity < needed(data, fmt):
        raise Fail(
            lib.KK_ERR_BUFFER_TOO_SMALL,
            f"the result needs {needed(data, fmt)} bytes; capacity is {capacity}",
        )
    copy_bytes(buffer, data, fmt != lib.KK_FORMAT_MSGPACK)


def write_output(
    out: Cdata,
    request_id: int,
    text: str,
    token_ids: list[int],
    output: RequestOutput | None,
    finished: bool,
) -> None:
    """Fills `out` with text, token ids and the encoded output, or with nothing at all (and the
    needed sizes) when a buffer is too small."""
    data = text.encode("utf-8", "replace")
    encoded = b""
    if out.encoded != ffi.NULL:
        if output is not None:
            output = msgspec.structs.replace(output, delta_text=text, delta_token_ids=token_ids)
        encoded = encode(output, out.encoded_format)
    out.request_id = request_id
    out.text_len, out.n_tokens, out.encoded_len = len(data), len(token_ids), len(encoded)
    short = []
    if out.text != ffi.NULL and out.text_capacity < len(data) + 1:
        short.append(
            f"text needs {len(data) + 1} bytes (the NUL included), "
            f"text_capacity is {out.text_capacity}"
        )
    if out.token_ids != ffi.NULL and out.token_capacity < len(token_ids):
        short.append(f"token_ids needs {len(token_ids)}, token_capacity is {out.token_capacity}")
    if out.encoded != ffi.NULL and out.encoded_capacity < needed(encoded, out.encoded_format):
        short.append(
            f"encoded needs {needed(encoded, out.encoded_format)} bytes, "
            f"encoded_capacity is {out.encoded_capacity}"
        )
    if short:
        raise Fail(lib.KK_ERR_BUFFER_TOO_SMALL, "output buffer too small: " + "; ".join(short))
    if out.text != ffi.NULL:
        copy_bytes(out.text, data, terminate=True)
    if out.token_ids != ffi.NULL:
        copy_ids(out.token_ids, token_ids)
    if out.encoded != ffi.NULL:
        copy_bytes(out.encoded, encoded, terminate=out.encoded_format != lib.KK_FORMAT_MSGPACK)
    out.finished = finished
    if finished and output is not None:
        out.finish_reason = FINISH_REASONS.get(output.finish_reason, lib.KK_FINISH_NONE)
