"""SamplingParams: what a caller may ask of one request's decoding, validated on construction."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec

from libkk.errors import SamplingParamsError, UnknownSamplingParamError

_MAX_SEED = 2**63 - 1

# The kinds of constraint a StructuredOutput may name; exactly one is set.
STRUCTURED_KINDS = ("json_schema", "json", "regex", "choice", "grammar")


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A constraint on a request's output text: exactly one of

    - json_schema: a JSON Schema (a dict) the output must validate against;
    - json: True, any JSON object;
    - regex: a regular expression the whole output must match;
    - choice: a non-empty list of strings, the output being one of them;
    - grammar: a Lark grammar (llguidance's dialect) whose `start` rule the output must match.

    JSON is written on one line with ", " and ": " between items (a schema's "x-guidance"
    object may ask for other whitespace).

    The output ends (finish_reason "stop") once the constraint admits no further token; EOS is
    allowed only where it may end. Whether a schema, regex or grammar is valid (and admits some
    output) is checked when the request is submitted.
    """

    json_schema: dict[str, Any] | None = None
    json: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise SamplingParamsError(
                f"SamplingParams.structured sets {given or 'nothing'}: expected exactly one of "
                f"{', '.join(STRUCTURED_KINDS)}"
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json_schema" and not isinstance(value, dict):
            _bad("structured.json_schema", value, "a JSON Schema as a dict")
        if kind == "json" and value is not True:
            _bad("structured.json", value, "true (any JSON object)")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            _bad(f"structured.{kind}", value, "a non-empty string")
        if kind == "choice" and not (
            isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)
        ):
            _bad("structured.choice", value, "a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """The constraint's kind: one of STRUCTURED_KINDS."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)


class _CheckedCall(type(msgspec.Struct)):  # type: ignore[misc]
    """Construction that reports an unknown keyword (or a positional argument) as a LibkkError.

    NOTE: a Struct's __init__ is msgspec's own C code, which raises a bare TypeError for these;
    the metaclass call is the one place to catch it. A TypeError whose traceback goes no deeper
    than this frame came from that argument check, not from __post_init__."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except TypeError as exc:
            if exc.__traceback__ is None or exc.__traceback__.tb_next is not None:
                raise
            known = ", ".join(cls.__struct_fields__)
            raise UnknownSamplingParamError(
                f"SamplingParams: {exc} (expected keyword arguments among: {known})"
            ) from None


class SamplingParams(
    msgspec.Struct,
    metaclass=_CheckedCall,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
):
    """Decoding settings of one request (vLLM conventions).

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters. A request with a
    `seed` gives the same tokens alone, in any batch, chunked or not: the sampling noise is keyed by
    (seed, position, token id).

    max_tokens caps the generated tokens; None means "until the model's context is full". A value
    larger than the room the prompt leaves (max_model_len - prompt tokens) is accepted and capped to
    it, as vLLM and the OpenAI API do: the request then ends with finish_reason "length" once the
    sequence reaches max_model_len. Only a prompt that leaves no room for max(1, min_tokens) tokens
    is refused (PromptTooLongError).

    `n` asks for that many completions of the prompt. With n > 1, `Session.generate` and
    `Session.chat` return, for that prompt, a list of n RequestOutput (in place of one); with
    n == 1 they return one RequestOutput as always. The completions are separate requests submitted
    together, so the prefix cache serves the prompt's KV to all of them. Completion 0 uses `seed`
    as given; completion i > 0 a seed derived from (seed, i) (`completion_seed`), so seeded
    completions differ from each other and repeat from run to run. Greedy completions are
    identical. `Session.stream`, `Session.stream_chat` and `Session.submit` take n == 1 only.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Number of top log-probabilities to return per generated token (None: none).
    logprobs: int | None = None
    seed: int | None = None
    # Constrained decoding (a StructuredOutput, or a dict of its fields): None for free text.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _check_type("n", self.n, int)
        if self.n < 1:
            _bad("n", self.n, "an integer >= 1")
        _check_type("max_tokens", self.max_tokens, int, optional=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            _bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check_type("min_tokens", self.min_tokens, int)
        if self.min_tokens < 0:
            _bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            _check_type(name, getattr(self, name), float)
            if not math.isfinite(getattr(self, name)):
                _bad(name, getattr(self, name), "a finite number")
        if self.temperature < 0:
            _bad("temperature", self.temperature, "a number >= 0 (0 means greedy)")
        _check_type("top_k", self.top_k, int)
        if self.top_k < -1:
            _bad("top_k", self.top_k, "an integer >= 0 (0 or -1 disables top-k)")
        if not 0.0 < self.top_p <= 1.0:
            _bad("top_p", self.top_p, "a number in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            _bad("min_p", self.min_p, "a number in [0, 1]")
        if self.repetition_penalty <= 0:
            _bad("repetition_penalty", self.repetition_penalty, "a number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                _bad(name, getattr(self, name), "a number in [-2, 2]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            _bad("stop", self.stop, "a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            _bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        _check_type("logprobs", self.logprobs, int, optional=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            _bad("logprobs", self.logprobs, "an integer in [0, 20] or None")
        _check_type("seed", self.seed, int, optional=True)
        if self.seed is not None and not -_MAX_SEED <= self.seed <= _MAX_SEED:
            _bad("seed", self.seed, "a 64-bit signed integer")
        if isinstance(self.structured, dict):
            # NOTE: a Struct's __init__ does not convert nested values; a dict is converted here
            # so that SamplingParams(structured={"regex": ...}) works as from_dict does.
            try:
                structured = msgspec.convert(self.structured, StructuredOutput)
            except msgspec.ValidationError as e:
                raise SamplingParamsError(f"SamplingParams.structured is invalid: {e}") from None
            msgspec.structs.force_setattr(self, "structured", structured)
        elif self.structured is not None and not isinstance(self.structured, StructuredOutput):
            _bad("structured", self.structured, "a StructuredOutput, a dict of its fields or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def completion(self, index: int) -> SamplingParams:
        """The parameters of completion `index` (0 <= index < n): n == 1 and its own seed."""
        if not 0 <= index < self.n:
            raise SamplingParamsError(f"completion index {index} is out of range for n={self.n}")
        if self.n == 1:
            return self
        seed = None if self.seed is None else completion_seed(self.seed, index)
        return msgspec.structs.replace(self, n=1, seed=seed)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise SamplingParamsError(f"invalid sampling parameters: {e}") from None


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `seed`: `seed` itself for index 0,
    else a 63-bit value hashed from (seed, index), the same in every run."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"libkk-completion:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _MAX_SEED


def _bad(name: str, value: Any, expected: str) -> None:
    raise SamplingParamsError(f"SamplingParams.{name}={value!r} is invalid: expected {expected}")


def _check_type(name: str, value: Any, kind: type, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        _bad(
            name,
            value,
            f"{'an' if kind is int else 'a'} {kind.__name__}" + (" or None" if optional else ""),
        )
