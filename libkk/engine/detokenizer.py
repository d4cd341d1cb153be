"""Incremental detokenization: UTF-8-safe streamed text with stop strings.

Each new token is decoded in a short window of the tokens before it and the window's previous text
is diffed away, so the cost per token does not grow with the output (the prefix/read offset scheme
of HF text-generation-inference and vLLM). Byte-level BPE can split one character over several
tokens; a window whose text ends in U+FFFD is held back until the character completes, so streamed
text never contains a half character, and the text at the end equals decoding all output ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from libkk.sample.params import SamplingParams

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Text of one request's output tokens, decoded as they arrive.

    The output text is that of the output ids alone: `prompt_token_ids` is kept for callers that
    need it, but decoding never looks at the prompt, so the final text equals
    `tokenizer.decode(output_ids)`.

    Stop strings (params.stop) are searched in newly decoded text (a stop string may span tokens),
    once more than params.min_tokens tokens were generated, as in vLLM. On a match the text is cut
    before the stop string (after it with include_stop_str_in_output) and `update` returns it.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        vocab_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # The tokenizer's vocabulary: a model whose embedding is padded past it can sample an id
        # at or past it, which has no text (as Hugging Face's decode skips it).
        self._vocab_size = vocab_size
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string matched, once one is
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        # Tokens [prefix_offset, read_offset) were emitted already and decode to _prefix_text;
        # tokens from read_offset on are not in the text yet.
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._text = ""
        self._sent = 0  # characters of _text handed out by take_delta/flush
        self._checked = 0  # characters of _text already searched for stop strings
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text so far (without text held back for an incomplete character)."""
        return self._text

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; return the stop string matched (the request must then finish)
        or None. Tokens after a match are ignored."""
        if self._finished:
            return None
        start = len(self.output_token_ids)
        self.output_token_ids.extend(new_token_ids)
        end = len(self.output_token_ids)
        # Several tokens (a verification step's accepted drafts) decode as one window: two
        # decodes per step instead of two per token. If that window ends inside a character,
        # each token's window is decoded as if they had arrived one by one, so the text a stop
        # string is searched in is what it would have been.
        if end > start and not self._decode_step(end) and end - start > 1:
            for stop_at in range(start + 1, end + 1):
                self._decode_step(stop_at)
        return self._check_stop()

    def take_delta(self) -> str:
        """Text not handed out yet that cannot turn out to be the start of a stop string."""
        end = len(self._text) if self._finished else len(self._text) - self._stop_prefix_len()
        if end <= self._sent:
            return ""
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def flush(self) -> str:
        """At finish (for any reason): decode what was held back and return all text not handed
        out yet. Later updates are ignored."""
        if not self._finished:
            text = self._decode(self.output_token_ids[self._prefix_offset :])
            if len(text) > len(self._prefix_text):
                self._text += text[len(self._prefix_text) :]
            self._check_stop()
            self._finished = True
        delta = self._text[self._sent :]
        self._sent = len(self._text)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        vocab = self._vocab_size
        if vocab is not None and any(i >= vocab for i in ids):
            ids = [i for i in ids if i < vocab]
        return self.tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_step(self, end: int) -> bool:
        """Decode the window ending at output token `end`; emit its new text (returns True) once
        it ends in a complete character."""
        ids = self.output_token_ids
        text = self._decode(ids[self._prefix_offset : end])
        # NOTE: while the text ends in U+FFFD the window grows. A character spans at most 4 byte
        # tokens; only a run of invalid bytes (which no tokenizer produces from real text) holds
        # longer, and every shorter cut was already tried when its last token arrived.
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT):
            self._text += text[len(self._prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, end
            self._prefix_text = self._decode(ids[self._prefix_offset : end])
            return True
        return False

    def _check_stop(self) -> str | None:
        """Search the text decoded since the last check for the earliest stop string."""
        checked, self._checked = self._checked, len(self._text)
        if not self._stops or len(self.output_token_ids) <= self.params.min_tokens:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # Only matches that end in the new text: older ones were found (or ignored under
            # min_tokens) by earlier checks.
            at = self._text.find(stop, max(0, checked - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self._text = self._text[: at + len(stop) if self.params.include_stop_str_in_output else at]
        self._finished = True
        self.stop_reason = stop
        return stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._text)), best, -1):
                if self._text.endswith(stop[:n]):
                    best = n
                    break
        return best
