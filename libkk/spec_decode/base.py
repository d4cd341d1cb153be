"""The proposer interface: what every drafter (n-gram, draft model, DFlash) takes and gives.

After the target samples a request's next token, the runner asks the proposer for up to K draft
tokens that follow it. The scheduler owes them to the request like any other token; the next step
runs the target over [last sampled token, d_0 .. d_{n-1}] and the rejection sampler keeps the
accepted prefix plus one target token (`libkk.sample.rejection`).

Invariants every proposer keeps:
- Drafts never change the output: they only decide how many target tokens one step can accept.
- `propose` is deterministic given its inputs (probabilistic drafts use keyed noise on the draft
  stream, `DRAFT_POSITION_SALT`), so a request drafts the same alone or in any batch.
- `draft_logits`, when given, are the raw logits before temperature; the verifier recomputes
  q = softmax(processed(draft_logits) / T) from them. None means one-hot drafts (q(d) = 1).
- Per-request state (a drafter's KV cache) is dropped by `remove`; a preempted request is
  removed and later proposed for again from its full token list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from libkk.sample.sampler import SamplingRow


@dataclass
class ProposeRequest:
    request_id: str
    # Every token the request holds, prompt + output, ending with the token just sampled (the
    # anchor the drafts follow). The anchor's position is len(token_ids) - 1. The request's own
    # live list: read it during `propose`, never mutate it or keep it (copy what must outlive
    # the call).
    token_ids: list[int]
    sampling: SamplingRow
    # The most drafts to propose (<= num_speculative_tokens; fewer near max_tokens/max_model_len).
    max_drafts: int


@dataclass
class DraftProposal:
    token_ids: list[list[int]]  # per request, at most max_drafts each (may be empty)
    # Per request, [n_drafts, vocab] fp32 raw draft logits (before temperature), or None for
    # one-hot drafts and for drafts whose q each rank keeps in its vocab shard (vocab-parallel
    # drafting: `DFlashProposer.shard_drafts`).
    draft_logits: list[torch.Tensor | None]


class Proposer(ABC):
    # Target decoder layers (0-based) whose output hidden states the proposer reads; empty for
    # proposers that need token ids only.
    target_layer_ids: tuple[int, ...] = ()

    @abstractmethod
    def propose(self, requests: list[ProposeRequest]) -> DraftProposal:
        """Drafts for each request, in order."""

    def add_context(  # noqa: B027 - an optional hook: a no-op for token-only proposers
        self, request_id: str, start_position: int, hidden: torch.Tensor
    ) -> None:
        """Model-based proposers: the target's chosen-layer hidden states for tokens whose KV
        became final this step (every row of a prefill chunk; the anchor + accepted drafts of a
        verification), in position order from start_position. Called before `propose`.
        hidden: [num_tokens, len(target_layer_ids) * target hidden]."""

    def remove(self, request_id: str) -> None:  # noqa: B027 - a no-op for stateless proposers
        """Forget a finished, aborted or preempted request's state."""
