"""DraftBackoff: a request whose drafts do not pay stops drafting for pauses that double, looks
again after each, and drafts on once its acceptance length is back above the break-even."""

from __future__ import annotations

import numpy as np
import pytest

from libkk.engine.speculation import DraftBackoff, break_even_length
from libkk.spec_decode.adaptive import CostModel


def _drafted_steps(backoff: DraftBackoff, emitted_per_verification: int, steps: int) -> list[int]:
    """The steps (0-based) at which the request drafted, each verification emitting the same."""
    drafted = []
    for step in range(steps):
        if backoff.wants_drafts("r"):
            drafted.append(step)
            backoff.observe("r", emitted_per_verification)
    return drafted


def test_poor_drafts_pause_for_doubling_stretches():
    backoff = DraftBackoff(break_even=2.0)
    # 1 token a verification (every draft rejected): pauses of 8, 16, 32, 64, 128, 128, ...
    assert _drafted_steps(backoff, 1, 400) == [0, 9, 26, 59, 124, 253, 382]


def test_good_drafts_never_pause():
    backoff = DraftBackoff(break_even=2.0)
    assert _drafted_steps(backoff, 4, 50) == list(range(50))


def test_a_request_that_recovers_drafts_on_and_its_pause_restarts():
    backoff = DraftBackoff(break_even=2.0)
    backoff.observe("r", 2)  # smoothed 2.0 -> 2.0: not below, still drafting
    assert backoff.wants_drafts("r")
    backoff.observe("r", 1)  # 1.5: a pause of 8
    assert [backoff.wants_drafts("r") for _ in range(9)] == [False] * 8 + [True]
    backoff.observe("r", 5)  # 3.25: pays again
    assert all(backoff.wants_drafts("r") for _ in range(20))
    backoff.observe("r", 1)
    backoff.observe("r", 1)  # below again: the pause starts over at 8, not 16
    assert [backoff.wants_drafts("r") for _ in range(9)] == [False] * 8 + [True]
    backoff.forget("r")
    assert backoff.wants_drafts("r")


def test_requests_back_off_apart():
    backoff = DraftBackoff(break_even=2.0)
    backoff.observe("poor", 1)
    backoff.observe("good", 5)
    assert not backoff.wants_drafts("poor") and backoff.wants_drafts("good")


def test_break_even_is_the_drafting_steps_time_over_a_plain_steps():
    cost = CostModel(draft_ms=[(1, 30.0)], verify_ms=[(1, 40.0), (5, 50.0)])
    assert break_even_length(cost, 4) == pytest.approx((30.0 + 50.0) / 40.0)
    # A captured graph's time stands for the forward where steps replay graphs.
    graphs = CostModel(
        draft_ms=[(1, 1.0)], verify_ms=[(1, 40.0), (5, 50.0)],
        graph_ms={(1, 1): 5.0, (1, 5): 6.0},
    )  # fmt: skip
    assert break_even_length(graphs, 4) == pytest.approx((1.0 + 6.0) / 5.0)
    cheap = CostModel(draft_ms=[(1, 0.0)], verify_ms=[(1, 40.0), (5, 20.0)])
    assert break_even_length(cheap, 4) == 1.0  # a timing fluke never makes drafting pay less
    assert np.isfinite(break_even_length(cost, 1))
