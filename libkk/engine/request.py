"""One request's state: the tokens it owes and how many of them the KV cache already holds.

The single scheduling model: a request owes `num_tokens` (prompt + generated) and has
`num_computed_tokens` of them in the KV cache. Prefill, chunked prefill, prefix hits, decode and
recompute after preemption are all just different gaps between the two.

Speculative drafts are owed too, but kept apart: `spec_token_ids` are proposed tokens that follow
`all_token_ids` and are scheduled with the next decode. They never enter `all_token_ids` (the KV
cache hashes and caches only known tokens); verification appends the accepted ones as output.

With async scheduling a step may be scheduled before the previous step's token reaches the host:
`num_pending_tokens` counts such in-flight tokens. They count in `num_tokens` (the scheduler needs
only counts) but never enter `all_token_ids` or `output_token_ids` until they are known.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from libkk.engine.timeline import Timeline
from libkk.sample.grammar import GrammarMatcher
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import SamplingRow, TokenLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        seed: int,
        eos_token_ids: frozenset[int],
        max_tokens: int,
        arrival_time: float,
        prompt: str | None = None,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        # Already capped so that prompt + output never exceeds max_model_len.
        self.max_tokens = max_tokens
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprobs] = []
        self._all_token_ids = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Sampled by a launched step, not yet known on the host (async scheduling; 0 or 1).
        self.num_pending_tokens = 0
        # Drafts to verify at the next decode, and their raw draft logits [n, vocab] (None:
        # one-hot drafts).
        self.spec_token_ids: list[int] = []
        self.draft_logits: torch.Tensor | None = None
        # Structured output: [n, W] int32, row k the grammar's mask after spec_token_ids[:k + 1]
        # (verification row k + 1; row 0's is the sampling row's). None: no grammar or no drafts.
        self.draft_grammar_masks: torch.Tensor | None = None
        self.num_cached_tokens = 0  # prefix-cache hit of the first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.timeline = Timeline(arrival=arrival_time)
        self._sampling_row: SamplingRow | None = None  # the last built, reused at the same count
        # Structured output: the grammar's state, advanced by each output token as it is
        # appended (preemption keeps the output, so the state needs no reset).
        self.grammar = grammar

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Known tokens plus in-flight ones."""
        return len(self._all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_owed_tokens(self) -> int:
        """Tokens that must still go through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_owed_tokens == 1 and self.num_output_tokens + self.num_pending_tokens > 0

    @property
    def reaches_length_in_flight(self) -> bool:
        """Its in-flight tokens take it to max_tokens: it finishes when they arrive and must not
        be scheduled again."""
        return (
            self.num_pending_tokens > 0
            and self.num_output_tokens + self.num_pending_tokens >= self.max_tokens
        )

    def reads_token_values(self) -> bool:
        """Whether sampling its next token reads earlier token values or needs the exact output
        count at sampling time (penalties, min_tokens bans): async scheduling then waits for its
        in-flight token before scheduling it. A grammar's mask also follows from every token
        before it, but only sampling needs it: the engine gives it to the launched step once the
        token is in (see `sampling_row`)."""
        p = self.params
        return (
            p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or self.num_output_tokens + self.num_pending_tokens < p.min_tokens
        )

    @property
    def finished(self) -> bool:
        return self.status.finished

    def banned_token_ids(self) -> frozenset[int]:
        """Tokens that may not be sampled yet: the stop tokens while under min_tokens."""
        if self.num_output_tokens + self.num_pending_tokens < self.params.min_tokens:
            return self.eos_token_ids | self.stop_token_ids
        return frozenset()

    def sampling_row(self) -> SamplingRow:
        """The row that samples this request's next token (position = tokens so far)."""
        position = self.num_tokens
        row = self._sampling_row
        # Everything else in a row is fixed or follows from the token count: the token lists are
        # the request's own (live), and the bans depend on the output count (position - prompt).
        if row is None or row.position != position or row.grammar_pending:
            # A grammar's mask needs every token before the next: with a token in flight the row
            # says so, and is built again once the token is in.
            pending = self.grammar is not None and self.num_pending_tokens > 0
            row = self._sampling_row = SamplingRow(
                params=self.params,
                seed=self.seed,
                position=position,
                prompt_token_ids=self.prompt_token_ids,
                output_token_ids=self.output_token_ids,
                banned_token_ids=tuple(self.banned_token_ids()),
                grammar_mask=(
                    self.grammar.next_mask() if self.grammar is not None and not pending else None
                ),
                grammar_pending=pending,
            )
        return row

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.consume(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def append_tokens(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None]
    ) -> None:
        """Appends tokens in order until one finishes the request (`check_stop_token` after each
        token); the tokens after it are dropped."""
        if (
            len(token_ids) == 1
            or self.grammar is not None
            or not (
                self.eos_token_ids.isdisjoint(token_ids)
                and self.stop_token_ids.isdisjoint(token_ids)
            )
        ):
            for token, lp in zip(token_ids, logprobs, strict=True):
                self.append_token(token, lp)
                if self.check_stop_token():
                    return
            return
        # No stop token among them: only the length can finish it, at a known token.
        room = max(1, self.max_tokens - self.num_output_tokens)  # one, as the loop would append
        token_ids = token_ids[:room] if room < len(token_ids) else token_ids
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.output_logprobs.extend(lp for lp in logprobs[: len(token_ids)] if lp is not None)
        self.check_stop_token()  # the length alone can finish it here

    def clear_drafts(self) -> None:
        self.spec_token_ids = []
        self.draft_logits = None
        self.draft_grammar_masks = None

    def constrain_drafts(self) -> None:
        """Cuts the drafts at the first one the grammar forbids (it is never verified) and keeps
        the masks of the verification rows after the kept ones. The grammar itself stays at the
        output tokens: drafts are never left consumed, so a rejected suffix needs no rollback
        (the accepted drafts are consumed as they are appended)."""
        if self.grammar is None or not self.spec_token_ids:
            return
        masks = self.grammar.draft_masks(self.spec_token_ids)  # [n + 1, W]
        n = masks.shape[0] - 1
        if n == 0:
            self.clear_drafts()
            return
        if n < len(self.spec_token_ids):
            self.spec_token_ids = self.spec_token_ids[:n]
            if self.draft_logits is not None:
                self.draft_logits = self.draft_logits[:n]
        self.draft_grammar_masks = masks[1:]

    def verified_grammar_masks(self) -> torch.Tensor | None:
        """The masks of the verification rows after the drafts as they are now (a trim since
        `constrain_drafts` keeps a prefix of them).  # [len(spec_token_ids), W] or None"""
        masks = self.draft_grammar_masks
        if masks is None or not self.spec_token_ids:
            return None
        return masks[: len(self.spec_token_ids)]

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drops output tokens past the first num_output_tokens (tokens after a stop string that
        arrived in the same step)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self._all_token_ids[len(self._all_token_ids) - drop :]
        del self.output_logprobs[num_output_tokens:]
        if self.grammar is not None:
            self.grammar.rollback(drop)

    def check_stop_token(self) -> bool:
        """Finishes the request if its last token is a stop token or it reached its length."""
        token = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if token in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in self.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token
                return True
        if self.grammar is not None:
            error = self.grammar.error()
            if error is not None:  # a token the mask did not allow (none was, say)
                self.status = RequestStatus.FINISHED_ERROR
                self.error = f"structured output: {error}"
                return True
            if self.grammar.is_finished():  # complete: it accepts no further token
                self.status = RequestStatus.FINISHED_STOPPED
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
