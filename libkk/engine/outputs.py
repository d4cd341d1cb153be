"""What a caller gets back for a request: text, tokens, finish reason, log-probabilities, timeline."""

from __future__ import annotations

import msgspec

from libkk.engine.timeline import Timeline


class Logprob(msgspec.Struct, frozen=True, kw_only=True):
    """Log-probability of one generated token, with its rank and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []


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
