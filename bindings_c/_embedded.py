"""The Python half of libkk's C ABI (bindings_c/include/libkk.h).

build.py embeds this file in libkk.so as cffi's start-up code: it runs once, when kk_runtime_init
starts the interpreter, as the module `_libkk_embedded`. It defines the `extern "Python"`
functions that the exported C functions (abi.c) call after checking their pointers.

Each function returns a kk_status; a failure also leaves a message in the calling thread's
kk_last_error(). Sessions are kept in a table keyed by the integer that the host sees as its
`kk_session *`, so a stale or made-up handle is an error, never a dereference. Requests from
kk_submit (and outputs kk_generate could not hand over) are kept per session until kk_poll has
delivered their end.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from _libkk_c import ffi, lib

try:
    from _libkk_marshal import (
        Callbacks,
        Cdata,
        Fail,
        copy_bytes,
        copy_ids,
        read_json_object,
        read_prompt,
        read_sampling_params,
        read_text,
        write_encoded,
        write_output,
    )

    from libkk import (
        ConfigError,
        EngineConfig,
        InvalidRequestError,
        LibkkError,
        MissingDependencyError,
        ModelLoadError,
        ModelNotFoundError,
        PromptTooLongError,
        RequestOutput,
        SamplingParams,
        SamplingParamsError,
        Session,
        SessionClosedError,
        UnknownRequestError,
        __version__,
    )
except Exception as exc:  # noqa: BLE001 - reported by kk_runtime_init
    _IMPORT_ERROR: str | None = (
        f"cannot import libkk with Python {sys.version.split()[0]} at {sys.executable} "
        f"(sys.prefix {sys.prefix}): {type(exc).__name__}: {exc}"
    )
else:
    _IMPORT_ERROR = None


def _status_of(exc: BaseException) -> int:
    """The status of a libkk exception: the most specific class first."""
    for kind, status in (
        (ModelNotFoundError, lib.KK_ERR_MODEL_NOT_FOUND),
        (ModelLoadError, lib.KK_ERR_MODEL_LOAD),
        (ConfigError, lib.KK_ERR_CONFIG),
        (SamplingParamsError, lib.KK_ERR_SAMPLING_PARAMS),
        (PromptTooLongError, lib.KK_ERR_PROMPT_TOO_LONG),
        (InvalidRequestError, lib.KK_ERR_INVALID_REQUEST),
        (UnknownRequestError, lib.KK_ERR_UNKNOWN_REQUEST),
        (SessionClosedError, lib.KK_ERR_INVALID_HANDLE),
        (MissingDependencyError, lib.KK_ERR_MISSING_DEPENDENCY),
    ):
        if isinstance(exc, kind):
            return status
    return lib.KK_ERR_INTERNAL


def _describe(exc: BaseException) -> str:
    """An unexpected exception as one line: type, message and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = (
        f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    )
    return f"{type(exc).__name__}: {exc}{where}"


def _set_error(status: int, message: str) -> int:
    lib._kk_set_error(message.encode("utf-8", "replace"))
    return status


def _export(function: Callable[..., int | None]) -> Callable[..., int | None]:
    """Makes `function` the body of the extern "Python" function of the same name: its
    exceptions become statuses and messages; anything escaping still returns KK_ERR_INTERNAL."""

    def entry(*args: Any) -> int:
        try:
            status = function(*args)
            return lib.KK_OK if status is None else status
        except Fail as exc:
            return _set_error(exc.status, exc.message)
        except LibkkError as exc:
            return _set_error(_status_of(exc), str(exc))
        except Exception as exc:  # noqa: BLE001 - a C caller cannot receive exceptions
            return _set_error(lib.KK_ERR_INTERNAL, _describe(exc))

    ffi.def_extern(name=function.__name__, error=lib.KK_ERR_INTERNAL)(entry)
    return function


# ---- sessions and their requests ------------------------------------------------------------------


class _Request:
    """A request's output not yet taken by kk_poll."""

    __slots__ = ("name", "text", "token_ids", "last", "finished", "callbacks")

    def __init__(self, name: str, callbacks: Callbacks | None = None) -> None:
        self.name = name  # the request id inside the Session
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.last: RequestOutput | None = None
        self.finished = False
        self.callbacks = callbacks

    def add(self, output: RequestOutput, whole: bool = False) -> None:
        self.text.append(output.text if whole else output.delta_text)
        self.token_ids.extend(output.token_ids if whole else output.delta_token_ids)
        self.last = output
        self.finished = output.finished


class _Entry:
    __slots__ = ("session", "requests", "names", "lock")

    def __init__(self, session: Session) -> None:
        self.session = session
        self.requests: dict[int, _Request] = {}
        self.names: dict[str, int] = {}
        self.lock = threading.Lock()

    def keep(self, number: int, request: _Request) -> None:
        with self.lock:
            self.requests[number] = request
            self.names[request.name] = number

    def drop(self, number: int) -> None:
        """Forgets a request; the caller holds self.lock."""
        request = self.requests.pop(number, None)
        if request is not None:
            self.names.pop(request.name, None)

    def get(self, number: int) -> _Request:
        request = self.requests.get(number)
        if request is None:
            raise Fail(
                lib.KK_ERR_UNKNOWN_REQUEST,
                f"request id {number} is unknown to this session: never submitted, or "
                "its end was already delivered by kk_poll",
            )
        return request


_sessions: dict[int, _Entry] = {}
_sessions_lock = threading.Lock()
_handles = itertools.count(1)
_request_numbers = itertools.count(1)


def _entry(handle: int) -> _Entry:
    entry = _sessions.get(handle)
    if entry is None:
        raise Fail(
            lib.KK_ERR_INVALID_HANDLE,
            f"session {handle:#x} is not a live session (freed, or never returned by "
            "kk_session_create)",
        )
    return entry


# ---- runtime ---------------------------------------------------------------------------------------


@_export
def _kk_py_init_check() -> int:
    if _IMPORT_ERROR is not None:
        return _set_error(lib.KK_ERR_RUNTIME, f"kk_runtime_init: {_IMPORT_ERROR}")
    return lib.KK_OK


@_export
def _kk_py_runtime_info(fmt: int, buffer: Cdata, capacity: int, length: Cdata) -> None:
    import torch  # imported with libkk already

    info = {
        "libkk_version": __version__,
        "python_version": sys.version.split()[0],
        "executable": sys.executable,
        "prefix": sys.prefix,
        "base_prefix": sys.base_prefix,
        "utf8_mode": sys.flags.utf8_mode,
        "sessions": len(_sessions),
        "torch_num_threads": torch.get_num_threads(),
    }
    write_encoded(info, fmt, buffer, capacity, length)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing to flush
            pass


@_export
def _kk_py_shutdown() -> None:
    with _sessions_lock:
        entries = list(_sessions.values())
        _sessions.clear()
    for entry in entries:
        entry.session.close()
    _flush()


@ffi.def_extern()
def _kk_py_flush() -> None:
    _flush()


# ---- sessions ---------------------------------------------------------------------------------------


@_export
def _kk_py_session_create(params: Cdata, out_handle: Cdata) -> None:
    settings: dict[str, Any] = {}
    if params.settings_json != ffi.NULL:
        settings = read_json_object(params.settings_json, "settings_json", lib.KK_ERR_CONFIG)
    config = EngineConfig().updated(**settings)
    if params.model_path != ffi.NULL:
        path = os.fsdecode(ffi.string(params.model_path))
        if not path:
            raise Fail(
                lib.KK_ERR_INVALID_ARGUMENT,
                "kk_session_create: model_path is empty (NULL means the default model)",
            )
        config = config.updated(model=path)
    session = Session(config=config)
    handle = next(_handles)
    with _sessions_lock:
        _sessions[handle] = _Entry(session)
    out_handle[0] = handle


@_export
def _kk_py_session_free(handle: int) -> None:
    with _sessions_lock:
        entry = _sessions.pop(handle, None)
    if entry is None:
        _entry(handle)  # raises: not a live session
        return
    entry.session.close()


@_export
def _kk_py_session_info(handle: int, fmt: int, buffer: Cdata, capacity: int, length: Cdata) -> None:
    session = _entry(handle).session
    info = {
        "config": session.config.to_dict(),
        "max_model_len": session.max_model_len,
        "vocab_size": session.tokenizer.vocab_size,
    }
    write_encoded(info, fmt, buffer, capacity, length)


@_export
def _kk_py_tokenize(
    handle: int, text: Cdata, add_special: bool, token_ids: Cdata, capacity: int, count: Cdata
) -> None:
    session = _entry(handle).session
    ids = session.tokenizer.encode(read_text(text, "text"), add_special_tokens=bool(add_special))
    count[0] = len(ids)
    if capacity < len(ids):
        raise Fail(
            lib.KK_ERR_BUFFER_TOO_SMALL,
            f"kk_tokenize: the text has {len(ids)} tokens; capacity is {capacity}",
        )
    copy_ids(token_ids, ids)


@_export
def _kk_py_detokenize(
    handle: int,
    token_ids: Cdata,
    count: int,
    skip_special: bool,
    text: Cdata,
    capacity: int,
    length: Cdata,
) -> None:
    session = _entry(handle).session
    if count > session.max_model_len:  # checked before reading, as for prompts
        raise Fail(
            lib.KK_ERR_INVALID_ARGUMENT,
            f"kk_detokenize: n_tokens is {count}: more than max_model_len "
            f"({session.max_model_len})",
        )
    ids = list(ffi.unpack(token_ids, count)) if count else []
    data = session.tokenizer.decode(ids, skip_special_tokens=bool(skip_special)).encode("utf-8")
    length[0] = len(data)
    if capacity < len(data) + 1:
        raise Fail(
            lib.KK_ERR_BUFFER_TOO_SMALL,
            f"kk_detokenize: the text needs {len(data) + 1} bytes (the NUL included); "
            f"capacity is {capacity}",
        )
    copy_bytes(text, data, terminate=True)


# ---- requests ---------------------------------------------------------------------------------------


def _stream(
    session: Session, prompt: str | list[int], params: SamplingParams, callbacks: Callbacks
) -> RequestOutput:
    """Generates through Session.stream, handing each piece to on_token and polling
    should_abort between steps; returns the final output."""
    stream = session.stream(prompt, params)
    last: RequestOutput | None = None
    try:
        while not callbacks.stop_requested():
            output = next(stream)
            last = output
            if not callbacks.deliver(output):
                break
            if output.finished:
                return output
        if last is not None and not last.finished:
            # Abort through the session, so the final output is the engine's own.
            try:
                session.abort(last.request_id)
            except UnknownRequestError:
                pass  # it finished meanwhile: its end is queued
            for output in stream:
                if output.finished:
                    return output
    finally:
        stream.close()
    if last is not None and last.finished:
        return last
    return RequestOutput(
        request_id="",
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
        text="",
        token_ids=[],
        delta_text="",
        delta_token_ids=[],
        finished=True,
        finish_reason="abort",
    )


def _check_finish(output: RequestOutput | None) -> None:
    if output is not None and output.finished and output.finish_reason == "error":
        raise Fail(lib.KK_ERR_REQUEST_FAILED, f"the request failed: {output.error}")


@_export
def _kk_py_generate(handle: int, prompt_p: Cdata, params_p: Cdata, out: Cdata) -> None:
    entry = _entry(handle)
    session = entry.session
    prompt = read_prompt(session, prompt_p)
    params = read_sampling_params(params_p)
    callbacks = Callbacks(params_p)
    number = next(_request_numbers)
    if callbacks.on_token is None and callbacks.should_abort is None:
        final = session.generate(prompt, params)
        assert isinstance(final, RequestOutput)
    else:
        final = _stream(session, prompt, params, callbacks)
    try:
        write_output(out, number, final.text, final.token_ids, final, finished=True)
    except Fail as exc:
        if exc.status == lib.KK_ERR_BUFFER_TOO_SMALL:
            kept = _Request(f"kept-{number}")
            kept.add(final, whole=True)
            entry.keep(number, kept)
            exc.message += f"; the output is kept as request {number} for kk_poll"
        raise
    _check_finish(final)


@_export
def _kk_py_submit(handle: int, prompt_p: Cdata, params_p: Cdata, out_id: Cdata) -> None:
    entry = _entry(handle)
    session = entry.session
    prompt = read_prompt(session, prompt_p)
    params = read_sampling_params(params_p)
    number = next(_request_numbers)
    request = _Request(f"kk-{number}", Callbacks(params_p))
    entry.keep(number, request)  # before the session has it: a step may report it at once
    try:
        session.submit(prompt, params, request_id=request.name)
    except BaseException:
        with entry.lock:
            entry.drop(number)
        raise
    out_id[0] = number


@_export
def _kk_py_step(handle: int, num_unfinished: Cdata) -> None:
    entry = _entry(handle)
    with entry.lock:
        polled = [
            r
            for r in entry.requests.values()
            if not r.finished and r.callbacks is not None and r.callbacks.should_abort is not None
        ]
    for request in polled:
        if request.callbacks is not None and request.callbacks.stop_requested():
            try:
                entry.session.abort(request.name)
            except UnknownRequestError:
                pass  # finished meanwhile
    outputs = entry.session.step()
    with entry.lock:
        for output in outputs:
            number = entry.names.get(output.request_id)
            if number is not None:
                entry.requests[number].add(output)
        unfinished = sum(1 for r in entry.requests.values() if not r.finished)
    if num_unfinished != ffi.NULL:
        num_unfinished[0] = unfinished


@_export
def _kk_py_poll(handle: int, number: int, out: Cdata) -> None:
    entry = _entry(handle)
    with entry.lock:
        request = entry.get(number)
        text = "".join(request.text)
        write_output(out, number, text, request.token_ids, request.last, request.finished)
        request.text, request.token_ids = [], []
        if request.finished:
            entry.drop(number)
    if request.finished:
        _check_finish(request.last)


@_export
def _kk_py_abort(handle: int, number: int) -> None:
    entry = _entry(handle)
    with entry.lock:
        request = entry.get(number)
        if request.callbacks is None:  # an output kept by kk_generate: drop it
            entry.drop(number)
            return
        if request.finished:
            return
    try:
        entry.session.abort(request.name)
    except UnknownRequestError:
        pass  # finished meanwhile: kk_step delivers its end
