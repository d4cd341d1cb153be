"""Session: the synchronous public API over one engine.

Thread model: any thread may submit, generate, stream or step. One lock serializes engine steps;
a caller waiting for its requests drives the engine itself, one step at a time, so several threads
waiting together share the batches. Every output goes to its request's queue, and each caller takes
only its own.
"""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import torch

from libkk.api.chat_format import ChatFormat, ToolChat, chat_format_for
from libkk.config import EngineConfig
from libkk.engine.engine import Engine
from libkk.engine.outputs import RequestOutput
from libkk.engine.threads import resolve_num_threads
from libkk.errors import (
    InvalidRequestError,
    SessionClosedError,
    UnknownArgumentError,
    UnknownRequestError,
)
from libkk.runtime.heap import freeze_startup_objects, release_frozen_objects
from libkk.sample.params import SamplingParams, StructuredOutput

Prompt = str | Sequence[int]
_F = TypeVar("_F", bound=Callable[..., Any])


def _checked_arguments(method: _F) -> _F:
    """Reports a call with an unknown keyword (or a positional argument too many) as an
    UnknownArgumentError instead of a bare TypeError.

    NOTE: Python checks the arguments before the method's frame exists, so a TypeError whose
    traceback goes no deeper than this wrapper came from that check; one raised inside the
    method passes through unchanged. Costs nothing on a good call."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except TypeError as exc:
            if exc.__traceback__ is None or exc.__traceback__.tb_next is not None:
                raise
            raise UnknownArgumentError(
                f"{exc}; see help(Session.{method.__name__}) for its arguments"
            ) from None

    return call  # type: ignore[return-value]


def _check_single(params: SamplingParams | None, method: str) -> None:
    if params is not None and isinstance(params, SamplingParams) and params.n != 1:
        raise InvalidRequestError(
            f"SamplingParams.n={params.n}: Session.{method} takes n=1 only; use "
            "Session.generate or Session.chat for several completions"
        )


_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = ("name", "schema", "description", "strict")


def with_response_format(
    params: SamplingParams | None, response_format: Mapping[str, Any] | None
) -> SamplingParams | None:
    """`params` (a copy) with `structured` set from an OpenAI `response_format`; `params`
    unchanged for None. Raises InvalidRequestError for a malformed response_format, or one given
    with params that set `structured` already."""
    if response_format is None:
        return params
    if not isinstance(response_format, Mapping):
        raise InvalidRequestError(
            f"response_format must be a dict such as {{'type': 'json_object'}}, got "
            f"{type(response_format).__name__}: {response_format!r:.80}"
        )
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise InvalidRequestError(
            f"response_format.type={kind!r} is invalid: expected one of "
            f"{', '.join(_RESPONSE_FORMAT_TYPES)}"
        )
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(str(k) for k in response_format if k not in allowed)
    if extra:
        raise InvalidRequestError(
            f"response_format of type {kind!r} has unknown keys {extra}: expected only "
            f"{sorted(allowed)}"
        )
    if params is not None and params.structured is not None:
        raise InvalidRequestError(
            "response_format and SamplingParams.structured are both set: give one of them"
        )
    base = params if params is not None else SamplingParams()
    if kind == "text":
        return base
    if kind == "json_object":
        return msgspec.structs.replace(base, structured=StructuredOutput(json=True))
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidRequestError(
            f"response_format.json_schema must be a dict with 'name' and 'schema', got "
            f"{type(spec).__name__}: {spec!r:.80}"
        )
    extra = sorted(str(k) for k in spec if k not in _JSON_SCHEMA_KEYS)
    if extra:
        raise InvalidRequestError(
            f"response_format.json_schema has unknown keys {extra}: expected among "
            f"{list(_JSON_SCHEMA_KEYS)}"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"response_format.json_schema.name={name!r} is invalid: expected a non-empty string"
        )
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(
            f"response_format.json_schema.schema={schema!r:.80} is invalid: expected a JSON "
            "Schema as a dict"
        )
    for key, expected in (("description", str), ("strict", bool)):
        if key in spec and spec[key] is not None and not isinstance(spec[key], expected):
            raise InvalidRequestError(
                f"response_format.json_schema.{key}={spec[key]!r:.80} is invalid: expected a "
                f"{expected.__name__}"
            )
    structured = StructuredOutput(json_schema=dict(schema))
    return msgspec.structs.replace(base, structured=structured)


class Session:
    """Loads a model and serves generation requests in the caller's process.

    `Session(model=None, **settings)`: `model` is an HF-layout folder or a .gguf file (None: the
    default model); settings are the fields of `EngineConfig` and its sections, flat
    (`max_num_seqs=8`) or nested (`scheduler={...}`), applied on top of `config` if given.

    Starting a session sets torch's CPU threads (process-wide) from `num_threads` (None: the
    physical cores the process may run on).
    """

    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, **settings: Any
    ) -> None:
        base = config or EngineConfig()
        self.config = (
            base.updated(**settings) if model is None else base.updated(model=model, **settings)
        )
        # NOTE: before the engine loads: loading and start-up profiling already run on the CPU.
        torch.set_num_threads(resolve_num_threads(self.config.num_threads))
        self._engine: Engine | None = Engine(self.config)
        # Seconds each start-up phase took, in order ("load weights", "compile and capture CUDA
        # graphs", ...; only the phases that ran).
        self.startup_seconds: dict[str, float] = dict(self._engine.startup_seconds)
        self._froze_gc = self.config.freeze_gc
        if self._froze_gc:
            freeze_startup_objects()
        self._lock = threading.RLock()
        self._queues: dict[str, deque[RequestOutput]] = {}
        # Requests whose outputs the caller collects through step() (submitted with submit()).
        self._stepped: set[str] = set()
        self._ids = itertools.count()
        self._chat_format: ChatFormat | None = None  # the chat template's, on first use

    # ---- properties -----------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise SessionClosedError("the session is closed")
        return self._engine

    @property
    def tokenizer(self):  # noqa: ANN201 - libkk.models.tokenizer.Tokenizer
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- caller-driven loop ---------------------------------------------------------------

    @_checked_arguments
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> str:
        """Queues one request and returns its id; collect its outputs with `step()`. Takes
        n == 1 only."""
        _check_single(params, "submit")
        rid = self._add(prompt, params, request_id)
        with self._lock:
            self._stepped.add(rid)
        return rid

    @_checked_arguments
    def step(self) -> list[RequestOutput]:
        """Runs one engine step (if there is work) and returns the new outputs of requests
        submitted with `submit()`, including finished ones."""
        with self._lock:
            self._step_locked()
            outputs = []
            for rid in list(self._stepped):
                outputs.extend(self._drain(rid))
            return outputs

    @_checked_arguments
    def abort(self, request_id: str) -> None:
        """Stops a request; its final output (finish_reason "abort") goes to whoever waits."""
        with self._lock:
            if request_id not in self._queues:
                raise UnknownRequestError(
                    f"unknown request id {request_id!r} (finished or never submitted)"
                )
            try:
                output = self.engine.abort_request(request_id)
            except UnknownRequestError:
                return  # already finished; its final output is queued
            self._queues[request_id].append(output)

    @_checked_arguments
    def stats(self) -> dict[str, int | float]:
        """Engine counters: steps, preemptions, prefix-cache queries/hits (tokens); with
        kv_offload_bytes, the host tier's stored/restored blocks and bytes moved; with
        speculative decoding, drafts verified and accepted (`spec_num_draft_tokens`,
        `spec_num_accepted_tokens`), request-steps that verified drafts
        (`spec_num_verify_steps`) and the tokens each emitted on average
        (`spec_mean_acceptance_length`)."""
        with self._lock:
            return self.engine.stats()

    @_checked_arguments
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.engine.has_unfinished_requests

    # ---- blocking calls -------------------------------------------------------------------

    @_checked_arguments
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> RequestOutput | list[RequestOutput] | list[list[RequestOutput]]:
        """Generates for one prompt (returns one output) or many (returns a list, in order).

        A prompt is a string or a list of token ids. A prompt whose params have n > 1 gets a
        list of n outputs in place of its one output (see `SamplingParams`)."""
        if not isinstance(prompts, (str, Iterable)):
            raise InvalidRequestError(
                f"prompts must be a string, a list of token ids or a list of prompts, got "
                f"{type(prompts).__name__}: {prompts!r:.80}"
            )
        if isinstance(prompts, str):
            single, batch = True, [prompts]
        else:
            try:
                items = list(prompts)
            except TypeError as e:  # an iterable that is not one (a 0-d tensor, say)
                raise InvalidRequestError(f"prompts must be a string or a list: {e}") from None
            # Token ids (one prompt) unless an item is itself a prompt: a bad id in a list of ids
            # is then reported as such, not as a batch of one-token prompts.
            single = bool(items) and not any(isinstance(p, (str, bytes, Iterable)) for p in items)
            batch = [items] if single else items
        if not batch:
            raise InvalidRequestError("prompts is empty: expected one prompt or a non-empty list")
        if params is None or isinstance(params, SamplingParams):
            per_request = [params] * len(batch)
        elif not isinstance(params, Iterable) or isinstance(params, (str, bytes, Mapping)):
            raise InvalidRequestError(
                f"params must be a SamplingParams, a list of them (one per prompt) or None, got "
                f"{type(params).__name__}: {params!r:.80}"
            )
        else:
            per_request = list(params)
            if len(per_request) != len(batch):
                raise InvalidRequestError(
                    f"got {len(per_request)} SamplingParams for {len(batch)} prompts: "
                    "expected one, or one per prompt"
                )
        # Completion i of a prompt with n > 1 is its own request; the n of a prompt are added
        # one after another, so the scheduler admits them together and the later ones find the
        # prompt's blocks in the prefix cache.
        rids: list[str] = []
        counts: list[int] = []
        try:
            for prompt, p in zip(batch, per_request, strict=True):
                if isinstance(p, SamplingParams) and p.n > 1:
                    counts.append(p.n)
                    rids.extend(self._add(prompt, p.completion(i), None) for i in range(p.n))
                else:
                    counts.append(1)
                    rids.append(self._add(prompt, p, None))
        except BaseException:
            for rid in rids:
                self._abort_quietly(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(rids):
                with self._lock:
                    for rid in rids:
                        if rid not in finals:
                            for output in self._drain(rid):
                                if output.finished:
                                    finals[rid] = output
                    if len(finals) < len(rids):
                        self._step_locked()
        except BaseException:
            for rid in rids:
                if rid not in finals:
                    self._abort_quietly(rid)
            raise
        outputs = iter([finals[rid] for rid in rids])
        results: list[RequestOutput | list[RequestOutput]] = [
            next(outputs) if n == 1 else [next(outputs) for _ in range(n)] for n in counts
        ]
        return results[0] if single else results  # type: ignore[return-value]

    @_checked_arguments
    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields one output per step that produced text or tokens; `delta_text` is the new
        text (never a split UTF-8 character, never part of a stop string). Closing the iterator
        early aborts the request. Takes n == 1 only."""
        _check_single(params, "stream")
        return self._stream(prompt, params)

    def _stream(self, prompt: Prompt, params: SamplingParams | None) -> Iterator[RequestOutput]:
        # NOTE: a generator apart from `stream`, so that a bad n is refused at the call; the
        # request itself is added at the first next(), as before.
        rid = self._add(prompt, params, None)
        finished = False
        try:
            while not finished:
                with self._lock:
                    outputs = self._drain(rid)
                    if not outputs:
                        self._step_locked()
                        continue
                for output in outputs:
                    finished = output.finished
                    yield output
        finally:
            if not finished:
                self._abort_quietly(rid)

    @_checked_arguments
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        response_format: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        **template_kwargs: Any,
    ) -> RequestOutput | list[RequestOutput]:
        """Renders the model's chat template (with the generation prompt) and generates.

        `response_format` is OpenAI's: {"type": "text"}, {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}; it sets
        `SamplingParams.structured` (params must not set it too). With params.n > 1, returns a
        list of n outputs.

        `tools` is OpenAI's list of {"type": "function", "function": {"name", "description",
        "parameters": <JSON Schema>}}; `tool_choice` is "auto" (the model may call tools),
        "none" (no tools are offered), "required" (one call to any tool) or {"type":
        "function", "function": {"name": ...}} (one call to that tool). The tools go through
        the template's `tools` argument, or through a system message where the template does
        not render tools. A required or named call is enforced by a grammar, so its arguments
        always validate against the tool's schema. The output's `tool_calls` holds the calls
        read from the text (`ToolCall`, arguments as a dict; [] if none) and `text` the rest;
        a call cut short by max_tokens is not a call. Messages may hold OpenAI's assistant
        `tool_calls` and "tool" role results. With tools, SamplingParams.structured must be
        unset; response_format works with tool_choice "auto" only (the answer is then either
        calls or JSON in that format)."""
        token_ids, params, tool_chat = self.prepare_chat(
            messages, params, response_format, tools, tool_choice, template_kwargs
        )
        output = self.generate(token_ids, params)
        assert isinstance(output, (RequestOutput, list))
        if tool_chat is not None:
            if isinstance(output, list):
                return [tool_chat.finish(o) for o in output]  # type: ignore[arg-type]
            return tool_chat.finish(output)
        return output  # type: ignore[return-value]

    @_checked_arguments
    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        response_format: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        **template_kwargs: Any,
    ) -> Iterator[RequestOutput]:
        """`stream` over the chat template's rendering of `messages`, as `chat` renders it:
        yields one output per step that produced text, `delta_text` the new text. Takes n == 1
        only.

        With tools (see `chat`), `delta_text` is content only: text is handed out up to the
        first tool call, and text that may start one is held back until what follows shows
        otherwise; the last output carries `tool_calls` and the rest of the content. The deltas
        join to the last output's `text`."""
        _check_single(params, "stream_chat")
        token_ids, params, tool_chat = self.prepare_chat(
            messages, params, response_format, tools, tool_choice, template_kwargs
        )
        stream = self.stream(token_ids, params)
        return stream if tool_chat is None else tool_chat.stream(stream)

    def prepare_chat(
        self,
        messages: Any,
        params: SamplingParams | None,
        response_format: Mapping[str, Any] | None,
        tools: Any,
        tool_choice: Any,
        template_kwargs: dict[str, Any],
    ) -> tuple[list[int], SamplingParams | None, ToolChat | None]:
        """The prompt's token ids, the request's params and its tools (None without): what
        `chat` and `stream_chat` submit, for a caller that submits and steps itself (the
        server). Raises a LibkkError for bad messages, tools or response_format."""
        answer_params = with_response_format(params, response_format)
        if self._chat_format is None:
            self._chat_format = chat_format_for(self.tokenizer)
        tool_chat = ToolChat.build(self._chat_format, tools, tool_choice, params, answer_params)
        if isinstance(messages, Iterable) and not isinstance(messages, (str, bytes, Mapping)):
            messages = list(messages)  # else the template's checks name what it got
        text = self._chat_format.render(
            messages, tool_chat.tools if tool_chat else None, template_kwargs
        )
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return token_ids, tool_chat.params if tool_chat else answer_params, tool_chat

    # ---- lifetime -------------------------------------------------------------------------

    @_checked_arguments
    def close(self) -> None:
        """Aborts what is still running, stops tensor-parallel workers and releases the model
        and KV cache memory."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            try:
                for rid in list(engine.scheduler.requests):
                    engine.abort_request(rid)
            finally:
                engine.shutdown()
            self._queues.clear()
            self._stepped.clear()
            device = engine.device
            del engine
            if self._froze_gc:
                release_frozen_objects()  # collects, the closed model's objects included
            else:
                gc.collect()
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- internals ------------------------------------------------------------------------

    def _add(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> str:
        arrival = time.monotonic()  # before tokenization: queueing includes it
        engine = self.engine
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        rid = request_id or f"req-{next(self._ids)}"
        request = engine.make_request(rid, prompt, params or SamplingParams(), arrival)
        with self._lock:
            if rid in self._queues:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            self.engine.add_request(request)
            self._queues[rid] = deque()
        return rid

    def _step_locked(self) -> None:
        for output in self.engine.step():
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.append(output)

    def _drain(self, rid: str) -> list[RequestOutput]:
        """Takes the queued outputs of a request; forgets the request once it finished."""
        queue = self._queues.get(rid)
        if queue is None:
            if self._engine is None:
                raise SessionClosedError("the session is closed")
            raise UnknownRequestError(f"request {rid!r} is no longer known to the session")
        if not queue:
            return []
        outputs = list(queue)
        queue.clear()
        if outputs[-1].finished:
            del self._queues[rid]
            self._stepped.discard(rid)
        return outputs

    def _abort_quietly(self, rid: str) -> None:
        with self._lock:
            if self._engine is not None and rid in self._engine.scheduler.requests:
                self._engine.abort_request(rid)
            self._queues.pop(rid, None)
            self._stepped.discard(rid)
