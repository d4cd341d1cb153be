"""Structured output through llguidance: a grammar per request, a matcher that follows its tokens,
and the bitmask of allowed tokens applied to logits before sampling.

`GrammarCompiler` holds the llguidance tokenizer (built once, on first use, from the model's
`tokenizer.json`) and turns a `StructuredOutput` into a `GrammarMatcher`, raising
`StructuredOutputError` for a constraint that cannot be used. A matcher fills one row of an int32
bitmask `[ceil(vocab / 32)]` (bit t of word t // 32 set = token t allowed) for its next token and
consumes the tokens that were sampled; the sampler applies the masks (libkk.kernels.bitmask).
`compute_next_masks` makes a step's masks over a few threads where the step has many rows.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from libkk.errors import MissingDependencyError, StructuredOutputError
from libkk.sample.params import StructuredOutput

# JSON is written on one line, as json.dumps writes it: no free whitespace for the model to wander
# in. A schema's "x-guidance" object may override these.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# How llguidance's errors begin for a grammar with no continuation at all.
_NO_OUTPUT = ("NoExtension", "NoExtensionBias")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise MissingDependencyError(
            f"structured output needs llguidance ({e}): pip install 'llguidance>=1.0'"
        ) from None
    return llguidance


def bitmask_words(vocab_size: int) -> int:
    """Int32 words of a bitmask row over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Builds a matcher per request; the llguidance tokenizer is made once (thread-safe)."""

    def __init__(
        self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        """tokenizer_json: the model's tokenizer.json text, or its path (read on first use);
        vocab_size: the tokenizer's ids (added tokens included); eos_token_ids: the ids that end
        a sequence."""
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """The llguidance LLTokenizer (built on first use: about 0.2 s for a 50k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                text = self._tokenizer_json
                if isinstance(text, Path):
                    text = text.read_text(encoding="utf-8")
                try:
                    self._tokenizer = llg.LLTokenizer(
                        text, n_vocab=self._vocab_size, eos_token=self._eos or None
                    )
                except (ValueError, TypeError) as e:
                    raise StructuredOutputError(
                        f"SamplingParams.structured: llguidance cannot read this model's "
                        f"tokenizer.json ({e}): expected a byte-level or SentencePiece tokenizer"
                    ) from None
            return self._tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """The llguidance grammar text of a constraint (not yet checked)."""
        llg = _llguidance()
        kind = spec.kind
        try:
            if kind == "json_schema":
                return llg.LLMatcher.grammar_from_json_schema(
                    json.dumps(spec.json_schema), defaults=_JSON_OPTIONS
                )
            if kind == "json":
                return llg.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults=_JSON_OPTIONS
                )
            if kind == "regex":
                return llg.LLMatcher.grammar_from_regex(spec.regex)
            if kind == "choice":
                assert spec.choice is not None
                lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice)
                return llg.LLMatcher.grammar_from_lark(lark)
            return llg.LLMatcher.grammar_from_lark(spec.grammar)
        except (ValueError, TypeError) as e:
            raise StructuredOutputError(
                f"SamplingParams.structured.{kind} is invalid: {e}"
            ) from None

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request. Raises StructuredOutputError when the constraint is
        malformed or admits no output (its first mask allows no token)."""
        llg = _llguidance()
        kind = spec.kind
        tokenizer = self.tokenizer
        matcher = llg.LLMatcher(tokenizer, self.grammar(spec), log_level=0)
        result = GrammarMatcher(matcher, tokenizer.vocab_size)
        if not matcher.is_error():
            result.next_mask()  # kept for the first sampling row (errors show up here too)
        if matcher.is_error():
            if _error_text(matcher.get_error()).startswith(_NO_OUTPUT):
                raise StructuredOutputError(
                    f"SamplingParams.structured.{kind} admits no output: expected a constraint "
                    "that some text satisfies"
                )
            raise StructuredOutputError(
                f"SamplingParams.structured.{kind} is invalid: {_error_text(matcher.get_error())}"
            )
        if not bool(result.next_mask().any()):
            raise StructuredOutputError(
                f"SamplingParams.structured.{kind} admits no output: no token may start it"
            )
        return result


# A step's masks are spread over Python threads (llguidance drops the GIL while it computes a mask)
# where the process has CPUs to spare: on a 16-CPU H100 host 32 masks inside a free JSON string
# took 11 ms row by row and 2.8 ms on 8 threads, while llguidance's own pool measured no faster
# than row by row (benchmarks/RESULTS.md, 2026-12-07). A thread takes at least MIN_ROWS_PER_THREAD
# rows: structural masks are cheap, and handing out one costs about what it does.
MAX_MASK_THREADS = 8
MIN_ROWS_PER_THREAD = 4
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def mask_threads() -> int:
    """Threads a step's masks may use: half the CPUs this process may run on, at most
    MAX_MASK_THREADS; 1 (row by row) below 4 CPUs."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    else:
        cpus = os.cpu_count() or 1
    return min(MAX_MASK_THREADS, cpus // 2) if cpus >= 4 else 1


def _pool() -> ThreadPoolExecutor:
    """The process's mask threads (one pool, like torch's: it holds no request's state, and
    sessions share it)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(MAX_MASK_THREADS, thread_name_prefix="libkk-grammar")
        return _POOL


def compute_next_masks(grammars: Iterable[GrammarMatcher], threads: int | None = None) -> None:
    """Computes the next mask of every matcher that has none yet, the rows split over up to
    `threads` threads (default `mask_threads()`), this one among them; `next_mask` then returns
    them. Too few rows for two threads: left to `next_mask`, row by row."""
    todo = [g for g in grammars if g._mask is None]
    threads = min(threads or mask_threads(), len(todo) // MIN_ROWS_PER_THREAD, MAX_MASK_THREADS)
    if threads < 2:
        return
    size = -(-len(todo) // threads)
    parts = [todo[i : i + size] for i in range(0, len(todo), size)]
    futures = [_pool().submit(_fill_masks, part) for part in parts[1:]]
    _fill_masks(parts[0])
    for future in futures:
        future.result()


def _fill_masks(grammars: Sequence[GrammarMatcher]) -> None:
    for g in grammars:
        g.next_mask()


def json_rule(schema: Mapping[str, Any]) -> str:
    """A Lark rule body (`%json {...}`) matching JSON valid under `schema`, written on one line as
    the `json_schema` constraint writes it (a schema's own "x-guidance" object wins)."""
    return "%json " + json.dumps({"x-guidance": _JSON_OPTIONS, **schema})


def lark_error(lark: str) -> str | None:
    """llguidance's complaint about a Lark grammar (inline JSON Schemas included), or None when it
    compiles; needs no tokenizer, so a request can be checked before the tokenizer is built."""
    matcher = _llguidance().LLMatcher
    is_error, messages = matcher.validate_grammar_with_warnings(matcher.grammar_from_lark(lark))
    if not is_error:
        return None
    # The first line says what is wrong; the rest echoes the grammar.
    first = (messages[0] if messages else "").strip().splitlines() or ["unknown error"]
    return re.sub(r"^at \d+\(\d+\): ", "", first[0])[:400]


class GrammarMatcher:
    """One request's grammar state: advanced by its output tokens, in order."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's: the mask covers these ids
        self.num_consumed = 0  # output tokens consumed so far
        self._mask: Tensor | None = None  # the mask at num_consumed, once computed

    def next_mask(self) -> Tensor:
        """The allowed next tokens as an int32 bitmask [ceil(vocab / 32)] on the host (all zero
        once the matcher is in error)."""
        if self._mask is None:
            mask = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
            if not self._matcher.is_error():
                self._matcher.unsafe_compute_mask_ptr(
                    mask.data_ptr(), mask.numel() * mask.element_size()
                )
            self._mask = mask
        return self._mask

    def consume(self, token_id: int) -> bool:
        """Advances by one sampled token; False if the grammar does not allow it (the matcher
        is then in error)."""
        self._mask = None
        self.num_consumed += 1
        return bool(self._matcher.consume_token(token_id))

    def draft_masks(self, drafts: Sequence[int]) -> Tensor:
        """The masks of a verification along `drafts`.  # [n + 1, ceil(vocab / 32)] int32

        n is the longest prefix of `drafts` the grammar allows (a draft past it is cut: it is
        never verified, nor is one after a draft that completes the grammar); row k is the mask
        after drafts[:k] (row 0 = `next_mask()`). The matcher
        is advanced along the kept drafts and rolled back: it is left where it was. A draft is
        checked against the mask before it is consumed, since a refused token would leave the
        matcher in error for good (rollback does not clear it)."""
        first = self.next_mask()
        masks = [first]
        n = 0
        for token in drafts:
            if not allows(masks[-1], token):
                break
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token}, which its mask allowed")
            n += 1
            mask = torch.zeros_like(first)
            self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            masks.append(mask)
            if self._matcher.is_stopped():
                # Complete (the output ends here): later drafts would be EOS, which llguidance
                # takes while stopped without counting it for rollback.
                break
        if n:
            self._matcher.rollback(n)
        self._mask = first
        return torch.stack(masks)

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` consumed tokens."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            self.num_consumed -= num_tokens
            self._mask = None

    def is_finished(self) -> bool:
        """Whether the grammar accepts no further token (it is complete): the output ends."""
        return bool(self._matcher.is_stopped()) and not self._matcher.is_error()

    def error(self) -> str | None:
        """The matcher's error, or None."""
        if not self._matcher.is_error():
            return None
        return _error_text(self._matcher.get_error())


def allows(mask: Tensor, token_id: int) -> bool:
    """Whether a bitmask row [W] allows a token (ids past 32 * W are disallowed)."""
    if not 0 <= token_id < 32 * mask.shape[0]:
        return False
    return bool((int(mask[token_id >> 5]) >> (token_id & 31)) & 1)


def _error_text(message: str) -> str:
    """llguidance's error message without the matcher state it appends, on one line."""
    lines = [line.strip() for line in message.split("<state>")[0].splitlines() if line.strip()]
    return " ".join(lines)[:400] or "unknown error"
