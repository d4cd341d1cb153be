"""DraftBackoff: a request whose drafts do not pay stops drafting for pauses that keep its looks
at 1% of its tokens and at least double, looks again after each, and drafts on once its
estimated acceptance is back above the break-even; one unlucky verification among good ones does
not pause it."""

from __future__ import annotations

import numpy as np
import pytest

from libkk.engine.speculation import DraftBackoff, break_even_length
from libkk.spec_decode.adaptive import CostModel

K = 4


def _drafted_steps(backoff: DraftBackoff, emitted: list[int], steps: int) -> list[int]:
    """The steps (0-based) at which the request drafted; its verifications emit `emitted` in
    turn (the last one repeated)."""
    drafted = []
    for step in range(steps):
        if backoff.wants_drafts("r"):
            backoff.observe("r", emitted[min(len(drafted), len(emitted) - 1)], K)
            drafted.append(step)
    return drafted


def test_poor_drafts_pause_for_stretches_that_keep_looks_at_one_percent():
    backoff = DraftBackoff(break_even=2.0, num_drafts=K)
    # 1 token a verification (every first draft rejected). After the first, the estimated rate
    # is 1/3: a look emits 1.49 tokens where plain steps emit 2 in its time, so a pause of
    # 0.51 / 1% - 2 = 48 steps; then at least double, up to 128.
    assert _drafted_steps(backoff, [1], 420) == [0, 49, 146, 275, 404]


def test_drafts_just_below_the_break_even_pause_for_doubling_stretches():
    # 2 tokens a verification at a break-even of 2: a look loses little, so the pauses are the
    # doubling ones from 8 (8, 16, 32, 64, 128, 128, ...).
    backoff = DraftBackoff(break_even=2.0, num_drafts=K)
    assert _drafted_steps(backoff, [2], 400) == [0, 9, 26, 59, 124, 253, 382]


def test_good_drafts_never_pause():
    backoff = DraftBackoff(break_even=2.0, num_drafts=K)
    assert _drafted_steps(backoff, [4], 50) == list(range(50))


def test_an_unlucky_first_verification_does_not_pause_a_request_whose_drafts_pay():
    # Where drafting costs little over a plain step (a GPU's break-even near 1), a first
    # verification that rejects every draft says little about the rate: drafting goes on.
    backoff = DraftBackoff(break_even=1.1, num_drafts=K)
    assert _drafted_steps(backoff, [1, 4, 5, 1, 1, 3], 60) == list(range(60))
    # Where it costs twice a plain step, the same verification pauses it.
    assert _drafted_steps(DraftBackoff(2.0, K), [1, 4], 60) == [0, *range(49, 60)]


def test_a_request_that_recovers_drafts_on_and_its_pause_restarts():
    backoff = DraftBackoff(break_even=2.0, num_drafts=K)
    backoff.observe("r", 1, K)  # rate 1/3: 1.49 tokens a verification, a pause of 48
    assert [backoff.wants_drafts("r") for _ in range(49)] == [False] * 48 + [True]
    backoff.observe("r", 5, K)  # every draft accepted: pays again
    assert all(backoff.wants_drafts("r") for _ in range(20))
    for _ in range(3):
        backoff.observe("r", 1, K)  # below again (1.85 tokens): the pause starts over at 12
    assert [backoff.wants_drafts("r") for _ in range(13)] == [False] * 12 + [True]
    backoff.forget("r")
    assert backoff.wants_drafts("r")


def test_fewer_drafts_than_the_session_drafts_count_as_all_accepted():
    # A request near its max_tokens verifies 2 drafts: both accepted is no rejection.
    backoff = DraftBackoff(break_even=2.0, num_drafts=K)
    for _ in range(10):
        backoff.observe("r", 3, 2)
    assert backoff.wants_drafts("r")


def test_requests_back_off_apart():
    backoff = DraftBackoff(break_even=2.0, num_drafts=K)
    backoff.observe("poor", 1, K)
    backoff.observe("good", 5, K)
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
