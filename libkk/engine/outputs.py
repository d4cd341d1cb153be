"""What a caller gets back for a request (text, tokens, finish reason, log-probabilities, timeline),
and `OutputProcessor`, which builds it from the request's tokens step by step."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from libkk.engine.detokenizer import IncrementalDetokenizer
from libkk.engine.request import Request
from libkk.engine.timeline import Timeline
from libkk.models.tokenizer import Tokenizer


class Logprob(msgspec.Struct, frozen=True, kw_only=True):
    """Log-probability of one generated token, with its rank and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One function call the model made in a chat with tools (OpenAI's `tool_calls` item, with
    `arguments` already decoded)."""

    id: str
    type: str = "function"
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's message shape: {"id", "type", "function": {"name", "arguments": <JSON text>}}."""
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # Everything generated so far (the stop string removed unless asked to include it).
    text: str
    token_ids: list[int]
    # What is new since the previous output of this request (what a stream hands out).
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    # "stop", "length", "abort" or "error" once finished.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None
    timeline: Timeline | None = None
    # Set by Session.chat / stream_chat when tools were offered (tool_choice not "none"): the
    # calls parsed from the output, [] if it made none; `text` then holds the rest of the
    # output. None otherwise (and on stream outputs before the last).
    tool_calls: list[ToolCall] | None = None
    # Chat only, for formats with a reasoning channel (gpt-oss): the model's reasoning, apart
    # from `text` (the answer). None when the format has none.
    reasoning_text: str | None = None


class OutputProcessor:
    """Per request: its incremental detokenizer, the text and token count handed out so far, and
    the Logprobs built so far; `output` hands out what is new and forgets finished requests."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, tuple[str, int]] = {}  # text and token count handed out so far
        self._logprobs: dict[str, list[Logprob]] = {}  # Logprobs built so far

    def add(self, request: Request) -> None:
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params, self.tokenizer.vocab_size
        )
        self._emitted[request.request_id] = ("", 0)

    def detokenize(self, request: Request) -> str | None:
        """Detokenizes the tokens not handed out yet; returns the stop string found among them
        (the request's output is cut after the token that completed it), or None."""
        detok = self._detokenizers[request.request_id]
        _, num_emitted = self._emitted[request.request_id]
        new_tokens = request.output_token_ids[num_emitted:]
        if not request.params.stop:  # no stop string to find: one call for the step's tokens
            detok.update(new_tokens)
            return None
        # One token at a time, as without speculation: a stop string inside an accepted run
        # drops the tokens after it.
        for j, token in enumerate(new_tokens):
            stop = detok.update([token])
            if stop is not None:
                request.truncate_output(num_emitted + j + 1)
                request.timeline.num_output_tokens = request.num_output_tokens
                return stop
        return None

    def output(self, request: Request) -> RequestOutput:
        rid = request.request_id
        detok = self._detokenizers[rid]
        text, num_emitted = self._emitted[rid]
        delta_text = detok.take_delta()
        if request.finished:
            delta_text += detok.flush()
        text += delta_text
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = self._logprobs_so_far(request)
        if request.finished:
            del self._detokenizers[rid], self._emitted[rid]
            self._logprobs.pop(rid, None)
        else:
            self._emitted[rid] = (text, request.num_output_tokens)
        return RequestOutput(
            request_id=rid,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=list(request.output_token_ids),
            delta_text=delta_text,
            delta_token_ids=request.output_token_ids[num_emitted:],
            finished=request.finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            error=request.error,
            timeline=request.timeline,
        )

    def _logprobs_so_far(self, request: Request) -> list[Logprob]:
        """Every output token's Logprob: built once per token (the output's list is a copy),
        not again at every step."""
        # NOTE: tokens a stop string drops were never handed out (the cut comes first), so what
        # was built only grows.
        built = self._logprobs.setdefault(request.request_id, [])
        built.extend(
            Logprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=lp.top)
            for lp in request.output_logprobs[len(built) :]
        )
        return list(built)
