"""Admission: a prompt and its sampling parameters checked and turned into a `Request`.

Touches no engine state, so a Session runs it off its lock.
"""

from __future__ import annotations

import operator
import secrets
from collections.abc import Iterable, Mapping, Sequence

from libkk.engine.request import Request
from libkk.errors import InvalidRequestError, PromptTooLongError, StructuredOutputError
from libkk.models.tokenizer import Tokenizer, check_utf8
from libkk.sample.grammar import GrammarCompiler
from libkk.sample.params import SamplingParams


def make_request(
    request_id: str,
    prompt: str | Sequence[int],
    params: SamplingParams,
    arrival_time: float,
    *,
    tokenizer: Tokenizer,
    vocab_size: int,
    max_model_len: int,
    grammars: GrammarCompiler | None = None,
) -> Request:
    """Tokenizes and validates a request. A structured-output constraint is compiled here, with
    `grammars` (StructuredOutputError when it cannot be used), never inside a step."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        # One Request is one completion: Session.generate splits n into n requests.
        raise InvalidRequestError(
            f"SamplingParams.n={params.n}: a request is one completion; give each completion its "
            "own request (params.completion(i)), as Session.generate does"
        )
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty: expected a non-empty string")
        check_utf8("prompt", prompt)
        prompt_text: str | None = prompt
        token_ids = tokenizer.encode(prompt)
    else:
        prompt_text = None
        token_ids = check_token_ids(prompt, vocab_size)
    if not token_ids:
        raise InvalidRequestError("prompt has no tokens: expected at least one")
    limit = max_model_len
    needed = len(token_ids) + max(1, params.min_tokens)
    if needed > limit:
        raise PromptTooLongError(
            f"prompt has {len(token_ids)} tokens and min_tokens={params.min_tokens}: "
            f"expected prompt tokens + max(1, min_tokens) <= max_model_len ({limit})"
        )
    # NOTE: max_tokens beyond the room the prompt leaves is capped, not refused (vLLM and the
    # OpenAI API do the same); the request ends with finish_reason "length" at max_model_len.
    room = limit - len(token_ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    grammar = None
    if params.structured is not None:
        if grammars is None:
            raise StructuredOutputError(
                "SamplingParams.structured is set but this engine has no grammar compiler"
            )
        grammar = grammars.matcher(params.structured)
    return Request(
        request_id,
        token_ids,
        params,
        seed=seed,
        eos_token_ids=tokenizer.eos_token_ids,
        max_tokens=max_tokens,
        arrival_time=arrival_time,
        prompt=prompt_text,
        grammar=grammar,
    )


def check_token_ids(prompt: Sequence[int], vocab_size: int) -> list[int]:
    """A prompt given as token ids, as ints in range."""
    expected = "a string or a sequence of token ids (ints)"
    if isinstance(prompt, (bytes, bytearray, Mapping)) or not isinstance(prompt, Iterable):
        raise InvalidRequestError(
            f"prompt must be {expected}, got {type(prompt).__name__}: {prompt!r:.80}"
        )
    try:
        items = list(prompt)
    except TypeError as e:  # an iterable that is not one (a 0-d tensor, say)
        raise InvalidRequestError(f"prompt must be {expected}: {e}") from None
    ids = []
    for i, t in enumerate(items):
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))  # ints (numpy's too), never a float or a string
        except TypeError:
            raise InvalidRequestError(
                f"prompt token ids[{i}] must be an int, got {type(t).__name__}: {t!r:.40}"
            ) from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids {bad[:5]} are out of range: expected 0 <= id < {vocab_size}"
        )
    return ids
