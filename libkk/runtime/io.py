"""What the scheduler hands the model runner for one step, and what comes back.

Plain data, so the same step can later be sent to tensor-parallel workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from libkk.sample.sampler import LogprobTensors, SamplingRow, TokenLogprobs

# Stands in a ScheduledRequest's token_ids for a token the previous step has sampled but the host
# does not know yet (async scheduling); the runner replaces it on the device before the forward.
PLACEHOLDER_TOKEN_ID = -1

# SchedulerOutput.kind of a step that holds prompt tokens alone, or decode/verification rows alone.
PREFILL_STEP, DECODE_STEP = "prefill", "decode"


@dataclass
class ScheduledRequest:
    request_id: str
    # The tokens to run this step: all_token_ids[num_computed_tokens : num_computed_tokens + n],
    # then the drafts to verify (spec_token_ids, the last len(spec_token_ids) of these).
    token_ids: list[int]
    num_computed_tokens: int
    # The request's whole block table in each KV group (shared with the KV cache manager, read
    # only here): one table for most models, docs/memory.md.
    block_tables: list[list[int]]
    # Set when this step completes everything the request owes: sample its next token.
    sampling: SamplingRow | None
    # Drafts verified this step (only with `sampling`): sampling happens at the 1 + n last rows.
    spec_token_ids: list[int] = field(default_factory=list)
    # [n, vocab] fp32 raw draft logits (before temperature), or None for one-hot drafts.
    draft_logits: torch.Tensor | None = None
    # Structured output: [n, W] int32 masks of the rows after the drafts (row k: the grammar's
    # mask after spec_token_ids[:k + 1]; the first row's is sampling.grammar_mask), or None.
    draft_grammar_masks: torch.Tensor | None = field(default=None, compare=False)
    # Async scheduling: the last of token_ids is PLACEHOLDER_TOKEN_ID, the token the previous
    # launched step samples for this request; the runner gathers it from that step's device ids.
    last_token_in_flight: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_spec_tokens(self) -> int:
        return len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted this step (their blocks were freed).
    preempted_request_ids: list[str] = field(default_factory=list)
    # DECODE_STEP, PREFILL_STEP or "mixed": which classes of work the step holds.
    kind: str = "mixed"

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def empty(self) -> bool:
        return not self.requests


@dataclass
class RunnerOutput:
    # Tokens sampled per request this step: one, or with n drafts the accepted drafts then one
    # target token (1 .. n + 1 tokens).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # With aux hidden layers set: per request, (first position, [n, len(ids) * hidden]) hidden
    # states of the tokens whose KV became final this step (a prefill chunk's rows; the anchor
    # and the accepted drafts of a verification).
    aux_hidden: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step enqueued on the device, its sampled tokens on their way to the host; `wait`
    blocks until they arrive and hands them out per request. Not plain data: it stays in this
    process.

    Tokens are laid out [S, W]: one row per sampling request (in `request_ids` order), its
    tokens first (the accepted drafts then one target token), -1 after them; W = 1 when no
    request verifies drafts. Logprobs are of the S * W slots, row-major.
    """

    sched: SchedulerOutput
    request_ids: list[str]
    # [S, W] int64 on the host (pinned on CUDA), valid once `copied` completed; None while the
    # step's sampling is pending.
    tokens: torch.Tensor | None = None
    # Recorded after the device->host copies; None when the copies are already complete (CPU).
    copied: torch.cuda.Event | None = None
    # On the host like tokens; None when no request asked for logprobs.
    logprobs: LogprobTensors | None = None
    # [num_tokens, len(ids) * hidden] on the device, the step's aux hidden states (else None).
    aux: torch.Tensor | None = None
    # Each scheduled request's first row in the batch (query_start_loc), for `aux`.
    query_starts: list[int] = field(default_factory=list)
    # Launched up to the hidden states, its sampling waiting for grammar masks: (the step's
    # InputBatch, the hidden states) until `ModelRunner.sample_pending`.
    pending: tuple | None = None

    def wait(self) -> RunnerOutput:
        if self.pending is not None or self.tokens is None:
            raise RuntimeError("the step's sampling is pending: its grammar masks were not given")
        if self.copied is not None:
            self.copied.synchronize()
        out = RunnerOutput()
        rows = token_rows(self.tokens, self.logprobs)
        for rid, (tokens, logprobs) in zip(self.request_ids, rows, strict=True):
            out.sampled_token_ids[rid] = tokens
            out.logprobs[rid] = logprobs
        if self.aux is not None:
            self._collect_aux_hidden(out)
        return out

    def _collect_aux_hidden(self, out: RunnerOutput) -> None:
        """Hidden states of the rows whose KV is final after this step, per request."""
        assert self.aux is not None
        for r, start in zip(self.sched.requests, self.query_starts, strict=False):
            num_final = r.num_new_tokens - r.num_spec_tokens
            sampled = out.sampled_token_ids.get(r.request_id)
            if r.num_spec_tokens and sampled:
                num_final += len(sampled) - 1  # the accepted drafts
            out.aux_hidden[r.request_id] = (
                r.num_computed_tokens,
                self.aux[start : start + num_final],
            )


def token_rows(
    tokens: torch.Tensor, logprobs: LogprobTensors | None
) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
    """Per row of `tokens` [R, W] (each row's tokens, then -1): its tokens and their logprobs
    (of the R * W slots, row-major; None where none were asked). Reads the tensors on the host."""
    rows = tokens.tolist()
    width = tokens.shape[1]
    slots = len(rows) * width
    lps: list[TokenLogprobs | None] = (
        [None] * slots if logprobs is None else logprobs.build([t for r in rows for t in r], slots)
    )
    result = []
    for i, row in enumerate(rows):
        n = row.index(-1) if -1 in row else len(row)
        result.append((row[:n], lps[i * width : i * width + n]))
    return result
