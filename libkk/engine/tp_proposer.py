"""Speculation under tensor parallelism: every rank builds the same proposer (a drafter's forward
runs collectives), and rank 0's `TPProposer` queues the engine's calls (remove, add_context,
propose) and sends them as one `ProposerCalls` message at each propose or before the next step;
every rank then makes the same calls in the same order (`apply_proposer_call`). A worker takes
each add_context's hidden states from its own step outputs, so no tensor is sent."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from libkk.spec_decode.base import DraftProposal, Proposer, ProposeRequest

if TYPE_CHECKING:
    from libkk.engine.executor import TPExecutor


@dataclasses.dataclass
class ProposerCalls:
    """Proposer calls rank 0 made since the last message, in order: ("remove", request_id),
    ("add_context", request_id, start_position) or ("propose", [ProposeRequest])."""

    calls: list[tuple]


class TPProposer(Proposer):
    """Rank 0's proposer under tensor parallelism: each call is queued, then sent and made on
    every rank at once (a drafter's forward is a collective). Its results are rank 0's."""

    def __init__(self, proposer: Proposer, executor: TPExecutor) -> None:
        self.proposer = proposer
        self.executor = executor
        self.target_layer_ids = tuple(proposer.target_layer_ids)
        self._calls: list[tuple] = []
        self._hidden: list[torch.Tensor | None] = []  # rank 0's add_context tensors, by call

    def add_context(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        self._queue(("add_context", request_id, start_position), hidden)

    def remove(self, request_id: str) -> None:
        self._queue(("remove", request_id), None)

    def propose(self, requests: list[ProposeRequest]) -> DraftProposal:
        self._queue(("propose", list(requests)), None)
        proposal = self.flush()
        assert proposal is not None
        return proposal

    def flush(self) -> DraftProposal | None:
        """Sends the queued calls to every worker and makes them here; the last propose's result."""
        if not self._calls:
            return None
        calls, hidden = self._calls, self._hidden
        self._calls, self._hidden = [], []
        proposal = None

        def run() -> None:
            nonlocal proposal
            self.executor.send(ProposerCalls(calls))
            for call, h in zip(calls, hidden, strict=True):
                proposal = apply_proposer_call(self.proposer, call, h) or proposal

        self.executor.check_alive()
        self.executor.in_step(run)
        return proposal

    def _queue(self, call: tuple, hidden: torch.Tensor | None) -> None:
        self._calls.append(call)
        self._hidden.append(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.proposer, name)


def apply_proposer_call(proposer: Proposer, call: tuple, hidden: torch.Tensor | None) -> Any:
    """Makes one queued proposer call (a `ProposerCalls` entry) on this rank's proposer."""
    kind = call[0]
    if kind == "remove":
        return proposer.remove(call[1])
    if kind == "add_context":
        return proposer.add_context(call[1], call[2], hidden)
    return proposer.propose(call[1])
