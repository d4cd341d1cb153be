"""`build_app(session)`: the OpenAI-compatible HTTP API over one Session, as a FastAPI app.

Requests are submitted to the session and stepped by one EngineLoop thread, so concurrent HTTP
requests share each step. Chat requests are prepared as `Session.chat` prepares them (the chat
format renders the messages and tools; `ToolChat` constrains and parses the calls), and their
outputs parsed as they stream in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from libkk.api.chat_format import ToolChat
from libkk.api.session import Prompt, Session, with_response_format
from libkk.engine.outputs import RequestOutput
from libkk.errors import LibkkError
from libkk.models.default import DEFAULT_MODEL_NAME
from libkk.sample.params import SamplingParams
from libkk.serve import protocol as P
from libkk.serve.engine_loop import EngineLoop

log = logging.getLogger(__name__)

_JSON = "application/json"


def served_model_name(session: Session) -> str:
    """The name /v1/models lists: the model folder's or file's name, or the default model's."""
    model = session.config.model.model
    if model is None:
        return DEFAULT_MODEL_NAME
    return Path(str(model)).name.removesuffix(".gguf") or str(model)


def build_app(
    session: Session, *, model_name: str | None = None, shutdown_grace_s: float = 10.0
) -> FastAPI:
    """The app serving `session` under /v1. The session stays the caller's to close (after the
    app's lifespan ended); while the app runs, nothing else may use `session.submit`/`step`
    (generate, stream and chat are fine: their outputs are their own).

    `model_name` is the name clients ask for (also accepted: the session's model argument as
    given); `shutdown_grace_s` is how long requests in flight may go on after
    `app.state.libkk.begin_shutdown()` (the runner calls it on SIGTERM) before they are aborted."""
    server = _Server(session, model_name or served_model_name(session), shutdown_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.stop()

    app = FastAPI(title="libkk", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.libkk = server

    @app.exception_handler(P.RequestError)
    async def request_error(request: Request, exc: P.RequestError) -> Response:
        return _json(exc.body, exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        body = P.RequestError(str(exc.detail), status=exc.status_code, code=code).body
        return _json(body, exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("request failed")
        return _json(P.server_error(f"internal error: {exc}").body, 500)

    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", server.get_model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    return app


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type=_JSON)


def _streaming(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        chunks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _Run:
    """The requests of one HTTP request (n completions of each prompt): their outputs, in the
    order the engine made them, on an asyncio queue."""

    def __init__(self, rids: Sequence[str], loop: asyncio.AbstractEventLoop) -> None:
        self.rids = list(rids)
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.unfinished = set(rids)
        self.finals: list[RequestOutput | None] = [None] * len(rids)
        self.abandoned = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._loop = loop

    def sink(self, item: RequestOutput | BaseException) -> None:  # any thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: nobody is waiting any more

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every request finished; raises what ended one early."""
        while self.unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                if isinstance(item, LibkkError):
                    raise P.error_from_libkk(item)
                raise P.server_error(f"the engine failed: {item}")
            i = self.index[item.request_id]
            if item.finished:
                self.unfinished.discard(item.request_id)
                self.finals[i] = item
                if item.finish_reason == "error":
                    raise P.server_error(f"generation failed: {item.error}")
            yield i, item


async def _client_gone(request: Request) -> None:
    """Returns once the client closed the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Server:
    def __init__(self, session: Session, model_name: str, shutdown_grace_s: float) -> None:
        self.session = session
        self.model_name = model_name
        self.names = {model_name}
        if session.config.model.model is not None:
            self.names.add(str(session.config.model.model))
        self.shutdown_grace_s = shutdown_grace_s
        self.engine = EngineLoop(session)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        # Rendering, tokenizing and submitting (grammars compile there too): off the event loop.
        self._submit_pool = ThreadPoolExecutor(4, thread_name_prefix="libkk-serve-submit")
        self._token_text = P.TokenText(session.tokenizer)
        self._created = P.now()

    # ---- lifetime --------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.engine.start()

    def stop(self) -> None:
        self.draining = True
        self.engine.stop()
        self._submit_pool.shutdown(wait=False, cancel_futures=True)

    def begin_shutdown(self) -> None:
        """Refuses new requests and aborts those in flight after the grace period; safe to call
        from a signal handler or any thread."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.info(
            "shutting down: %d requests in flight get %.1f s to finish",
            self.engine.num_running,
            self.shutdown_grace_s,
        )
        assert self.loop is not None
        self.loop.call_later(self.shutdown_grace_s, self.engine.cancel_all)

    # ---- routes ----------------------------------------------------------------------------

    async def health(self) -> Response:
        if self.draining:
            return _json({"status": "shutting down"}, 503)
        return _json({"status": "ok"})

    async def list_models(self) -> Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def get_model(self, model: str) -> Response:
        self._check_model(model)
        return _json(self._model_card())

    async def chat_completions(self, request: Request) -> Response:
        req: P.ChatCompletionRequest = P.decode_request(
            await request.body(), P.ChatCompletionRequest
        )
        self._check_model(req.model)
        self._check_open()
        params = P.chat_sampling_params(req)
        messages = P.template_messages(req.messages)
        tool_chat: ToolChat | None = None

        def prepare() -> tuple[list[Prompt], SamplingParams]:
            # NOTE: prepared as Session.chat prepares it, so that the server's answers are the
            # session's; a bad response_format is checked first to name it as the bad field.
            nonlocal tool_chat
            try:
                with_response_format(params, req.response_format)
            except LibkkError as e:
                raise P.RequestError(str(e), param="response_format") from None
            choice = "auto" if req.tool_choice is None else req.tool_choice
            ids, sampling, tool_chat = self.session.prepare_chat(
                messages, params, req.response_format, req.tools, choice, {}
            )
            return [ids], sampling  # type: ignore[return-value]

        rid = P.new_id("chatcmpl")
        run = await self._submit(1, req.n, prepare, rid)
        if req.stream:
            return _streaming(self._chat_chunks(req, run, rid, tool_chat))
        outputs = await self._collect(run, request)
        if tool_chat is not None:
            outputs = [tool_chat.finish(out) for out in outputs]
        return _json(self._chat_response(req, rid, outputs))

    async def completions(self, request: Request) -> Response:
        req: P.CompletionRequest = P.decode_request(await request.body(), P.CompletionRequest)
        self._check_model(req.model)
        self._check_open()
        params = P.completion_sampling_params(req)
        prompts = P.completion_prompts(req.prompt)
        rid = P.new_id("cmpl")
        run = await self._submit(len(prompts), req.n, lambda: (prompts, params), rid)
        if req.stream:
            return _streaming(self._completion_chunks(req, run, rid))
        outputs = await self._collect(run, request)
        return _json(self._completion_response(req, rid, outputs))

    # ---- submission and waiting -----------------------------------------------------------

    async def _submit(
        self,
        num_prompts: int,
        n: int,
        prepare: Callable[[], tuple[Sequence[Prompt], SamplingParams]],
        rid: str,
    ) -> _Run:
        """Submits n completions of each of `num_prompts` prompts (choice j * n + i is
        completion i of prompt j). `prepare` gives the prompts and the params; it runs on a
        worker thread with the submission. Raises RequestError for what the session refuses."""
        assert self.loop is not None
        run = _Run([f"{rid}-{k}" for k in range(num_prompts * n)], self.loop)

        def work() -> None:
            prompts, params = prepare()
            self.engine.submit(
                [p for p in prompts for _ in range(n)],
                [params.completion(i) for _ in prompts for i in range(n)],
                run.rids,
                run.sink,
            )
            if run.abandoned:  # the handler was cancelled while this ran
                self.engine.cancel(run.rids)

        try:
            await self.loop.run_in_executor(self._submit_pool, work)
        except LibkkError as e:
            raise P.error_from_libkk(e) from None
        except asyncio.CancelledError:
            # NOTE: either `work` sees the flag after submitting, or its requests are
            # registered already and cancel() finds them.
            run.abandoned = True
            self.engine.cancel(run.rids)
            raise
        return run

    async def _collect(self, run: _Run, request: Request) -> list[RequestOutput]:
        """The final outputs of a run; aborts the run if the client goes away first."""

        async def consume() -> None:
            async for _ in run.events():
                pass

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done():
                raise P.RequestError("the client closed the connection", status=499)
            consumer.result()
            return [out for out in run.finals if out is not None]
        finally:
            consumer.cancel()
            watcher.cancel()
            self.engine.cancel(list(run.unfinished))

    # ---- chat responses -------------------------------------------------------------------

    def _chat_response(
        self, req: P.ChatCompletionRequest, rid: str, outputs: Sequence[RequestOutput]
    ) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outputs):
            calls = P.tool_calls_json(out)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": None if calls else out.text,
                "refusal": None,
            }
            if calls:
                message["tool_calls"] = calls
            if out.reasoning_text is not None:  # vLLM's name for a reasoning channel's text
                message["reasoning_content"] = out.reasoning_text
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._chat_logprobs(req, out.logprobs),
                    "finish_reason": P.finish_reason(out),
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": P.now(),
            "model": req.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": P.usage(len(outputs[0].prompt_token_ids), outputs),
        }

    def _chat_logprobs(self, req: P.ChatCompletionRequest, logprobs: Any) -> dict | None:
        if not req.logprobs or logprobs is None:
            return None
        return P.chat_logprobs(logprobs, self._token_text, req.top_logprobs or 0)

    def _chat_chunk(
        self, req: P.ChatCompletionRequest, rid: str, created: int, choices: list[dict]
    ) -> bytes:
        chunk: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if req.stream_options is not None and req.stream_options.include_usage:
            chunk["usage"] = None
        return P.sse(chunk)

    async def _chat_chunks(
        self, req: P.ChatCompletionRequest, run: _Run, rid: str, tool_chat: ToolChat | None
    ) -> AsyncIterator[bytes]:
        created = P.now()
        sent_logprobs = [0] * len(run.rids)
        # With tools, each choice's text goes through a parser: text that may be a call is held
        # back, and the calls come with the last output.
        parsers = [
            tool_chat.format.stream_parser(tool_chat.tools) if tool_chat else None for _ in run.rids
        ]
        try:
            for i in range(len(run.rids)):
                delta = {"role": "assistant", "content": ""}
                yield self._chat_chunk(req, rid, created, [_chat_choice(i, delta)])
            async for i, out in run.events():
                new = (out.logprobs or [])[sent_logprobs[i] :]
                sent_logprobs[i] += len(new)
                text, calls, parser = out.delta_text, [], parsers[i]
                if parser is not None and out.finished:
                    parsed, text = parser.finish(out.text)
                    calls = [
                        {"index": k, **call.to_openai()} for k, call in enumerate(parsed.tool_calls)
                    ]
                elif parser is not None:
                    text = parser.feed(out.text)
                if text or new:
                    choice = _chat_choice(i, {"content": text})
                    choice["logprobs"] = self._chat_logprobs(req, new)
                    yield self._chat_chunk(req, rid, created, [choice])
                if parser is not None and out.finished and parsed.reasoning is not None:
                    # The reasoning comes whole, before the end (the answer streams as it grows).
                    reasoning = {"reasoning_content": parsed.reasoning}
                    yield self._chat_chunk(req, rid, created, [_chat_choice(i, reasoning)])
                if calls:
                    yield self._chat_chunk(
                        req, rid, created, [_chat_choice(i, {"tool_calls": calls})]
                    )
                if out.finished:
                    reason = "tool_calls" if calls else out.finish_reason
                    yield self._chat_chunk(req, rid, created, [_chat_choice(i, {}, reason)])
            if req.stream_options is not None and req.stream_options.include_usage:
                yield self._usage_chunk(req, rid, created, "chat.completion.chunk", run.finals)
            yield P.SSE_DONE
        except P.RequestError as e:
            yield P.sse(e.body)
            yield P.SSE_DONE
        finally:
            self.engine.cancel(list(run.unfinished))

    def _usage_chunk(
        self,
        req: Any,
        rid: str,
        created: int,
        kind: str,
        finals: Sequence[RequestOutput | None],
    ) -> bytes:
        outputs = [o for o in finals if o is not None]
        prompt_tokens = self._prompt_tokens(outputs, req.n)
        chunk = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": req.model,
            "choices": [],
            "usage": P.usage(prompt_tokens, outputs),
        }
        return P.sse(chunk)

    @staticmethod
    def _prompt_tokens(outputs: Sequence[RequestOutput], n: int) -> int:
        # Each prompt once, however many completions it had.
        return sum(len(out.prompt_token_ids) for out in outputs[::n])

    # ---- completion responses -------------------------------------------------------------

    def _echo(self, req: P.CompletionRequest, out: RequestOutput) -> str:
        if not req.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.session.tokenizer.decode(out.prompt_token_ids)

    def _completion_logprobs(
        self, req: P.CompletionRequest, logprobs: Any, offset: int
    ) -> dict | None:
        if req.logprobs is None or logprobs is None:
            return None
        return P.completion_logprobs(logprobs, self._token_text, req.logprobs, offset)

    def _completion_response(
        self, req: P.CompletionRequest, rid: str, outputs: Sequence[RequestOutput]
    ) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outputs):
            echo = self._echo(req, out)
            choices.append(
                {
                    "index": i,
                    "text": echo + out.text,
                    "logprobs": self._completion_logprobs(req, out.logprobs, len(echo)),
                    "finish_reason": P.finish_reason(out),
                }
            )
        return {
            "id": rid,
            "object": "text_completion",
            "created": P.now(),
            "model": req.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": P.usage(self._prompt_tokens(outputs, req.n), outputs),
        }

    async def _completion_chunks(
        self, req: P.CompletionRequest, run: _Run, rid: str
    ) -> AsyncIterator[bytes]:
        created = P.now()
        sent_logprobs = [0] * len(run.rids)
        offsets = [0] * len(run.rids)
        echoed = [False] * len(run.rids)

        def chunk(i: int, text: str, logprobs: dict | None, reason: str | None) -> bytes:
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
            payload: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "system_fingerprint": None,
                "choices": [choice],
            }
            if req.stream_options is not None and req.stream_options.include_usage:
                payload["usage"] = None
            return P.sse(payload)

        try:
            async for i, out in run.events():
                text = out.delta_text
                if not echoed[i]:
                    echoed[i] = True
                    text = self._echo(req, out) + text
                    offsets[i] = len(text) - len(out.delta_text)
                new = (out.logprobs or [])[sent_logprobs[i] :]
                sent_logprobs[i] += len(new)
                logprobs = self._completion_logprobs(req, new, offsets[i])
                if logprobs is not None:
                    offsets[i] += sum(len(t) for t in logprobs["tokens"])
                if text or new or out.finished:
                    reason = P.finish_reason(out) if out.finished else None
                    yield chunk(i, text, logprobs, reason)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield self._usage_chunk(req, rid, created, "text_completion", run.finals)
            yield P.SSE_DONE
        except P.RequestError as e:
            yield P.sse(e.body)
            yield P.SSE_DONE
        finally:
            self.engine.cancel(list(run.unfinished))

    # ---- checks ----------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "libkk",
            "max_model_len": self.session.max_model_len,
        }

    def _check_model(self, name: str) -> None:
        if name not in self.names:
            raise P.RequestError(
                f"The model `{name}` does not exist: this server serves `{self.model_name}`",
                status=404,
                param="model",
                code="model_not_found",
            )

    def _check_open(self) -> None:
        if self.draining:
            raise P.RequestError(
                "the server is shutting down", status=503, type="server_error", code="shutting_down"
            )


def _chat_choice(i: int, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
