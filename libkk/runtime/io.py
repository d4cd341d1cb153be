"""What the scheduler hands the model runner for one step, and what comes back.

Plain data, so the same step can later be sent to tensor-parallel workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from libkk.sample.sampler import SamplingRow, TokenLogprobs

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
    # The request's whole block table (shared with the KV cache manager, read only here).
    block_ids: list[int]
    # Set when this step completes everything the request owes: sample its next token.
    sampling: SamplingRow | None
    # Drafts verified this step (only with `sampling`): sampling happens at the 1 + n last rows.
    spec_token_ids: list[int] = field(default_factory=list)
    # [n, vocab] fp32 raw draft logits (before temperature), or None for one-hot drafts.
    draft_logits: torch.Tensor | None = None
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
class ModelRunnerOutput:
    # Tokens sampled per request this step: one, or with n drafts the accepted drafts then one
    # target token (1 .. n + 1 tokens).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # With aux hidden layers set: per request, (first position, [n, len(ids) * hidden]) hidden
    # states of the tokens whose KV became final this step (a prefill chunk's rows; the anchor
    # and the accepted drafts of a verification).
    aux_hidden: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass
class LogprobTensors:
    """Logprobs of the sampled tokens for the sampling rows that ask for them, as tensors (on the
    device until copied): built into TokenLogprobs once on the host."""

    rows: list[int]  # the sampling rows that asked, in order
    num_top: list[int]  # how many top entries each of them asked for
    sampled: torch.Tensor  # [W] fp32, the sampled token's logprob
    rank: torch.Tensor  # [W] int64, 1 + the tokens strictly more likely
    top_logprobs: torch.Tensor  # [W, n] fp32, best first (n = max(num_top))
    top_ids: torch.Tensor  # [W, n] int64

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LogprobTensors:
        """A copy whose tensors live on `device` (pinned memory for an asynchronous copy to the
        host of CUDA tensors)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            if not (non_blocking and t.is_cuda):
                return t.to(device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        return LogprobTensors(
            self.rows,
            self.num_top,
            move(self.sampled),
            move(self.rank),
            move(self.top_logprobs),
            move(self.top_ids),
        )

    def build(self, token_ids: list[int], num_rows: int) -> list[TokenLogprobs | None]:
        """One entry per sampling row (None for rows that did not ask); host tensors only."""
        result: list[TokenLogprobs | None] = [None] * num_rows
        sampled, rank = self.sampled.tolist(), self.rank.tolist()
        top_lp, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        for j, (i, n) in enumerate(zip(self.rows, self.num_top, strict=True)):
            result[i] = TokenLogprobs(
                token_id=token_ids[i],
                logprob=sampled[j],
                rank=rank[j],
                top=list(zip(top_ids[j][:n], top_lp[j][:n], strict=True)),
            )
        return result


@dataclass
class LaunchedStep:
    """A step enqueued on the device whose sampled ids are on their way to the host (async
    scheduling). `wait` blocks until they arrive. Not plain data: it stays in this process."""

    # The requests that sample this step, in the order of `token_ids`.
    request_ids: list[str]
    # [num_sampling_requests] int64 on the host (pinned on CUDA), valid once `copied` completed.
    token_ids: torch.Tensor
    # Recorded after the device->host copies; None when the copies are already complete (CPU).
    copied: torch.cuda.Event | None
    # On the host like token_ids; None when no row asked for logprobs.
    logprobs: LogprobTensors | None = None

    def wait(self) -> ModelRunnerOutput:
        if self.copied is not None:
            self.copied.synchronize()
        token_ids = self.token_ids.tolist()
        num_rows = len(token_ids)
        logprobs = (
            [None] * num_rows if self.logprobs is None else self.logprobs.build(token_ids, num_rows)
        )
        out = ModelRunnerOutput()
        for rid, token, lp in zip(self.request_ids, token_ids, logprobs, strict=True):
            out.sampled_token_ids[rid] = [token]
            out.logprobs[rid] = [lp]
        return out
