"""DraftBackoff: a request drafts a look (one draft) first; it drafts K while its drafts pay, and
one whose drafts do not pay stops drafting for pauses that keep its looks at 1% of its tokens
and at least double, looks again after each, and drafts K again once its estimated acceptance is
back above the break-even; one unlucky verification where drafting is cheap does not pause it."""

from __future__ import annotations

import numpy as np
import pytest

from libkk.engine.speculation import DraftBackoff, break_even_length
from libkk.spec_decode.adaptive import CostModel

K = 4


def _drafts(backoff: DraftBackoff, accepts: list[int], steps: int) -> list[tuple[int, int]]:
    """(step, drafts) of each step (0-based) at which the request drafted; its verifications
    accept `accepts` in turn (the last one repeated), at most all of the drafts."""
    drafted = []
    for step in range(steps):
        n = backoff.drafts_for("r")
        if n:
            accepted = min(accepts[min(len(drafted), len(accepts) - 1)], n)
            backoff.observe("r", accepted + 1, n)
            drafted.append((step, n))
    return drafted


def test_poor_drafts_pause_for_stretches_that_keep_looks_at_one_percent():
    backoff = DraftBackoff(break_even=2.0, look_break_even=1.5, num_drafts=K)
    # Nothing accepted. After the first look the estimated rate is 1/3: K drafts are worth 1.49
    # tokens (below 2), and a look 1.33 where plain steps emit 1.5 in its time, so a pause of
    # 0.167 / 1% - 1.5 = 15 steps; then at least double, up to 128.
    assert _drafts(backoff, [0], 420) == [(s, 1) for s in (0, 16, 47, 108, 229, 358)]


def test_good_drafts_look_once_then_draft_k_every_step():
    backoff = DraftBackoff(break_even=2.0, look_break_even=1.5, num_drafts=K)
    assert _drafts(backoff, [K], 50) == [(0, 1)] + [(s, K) for s in range(1, 50)]


def test_an_unlucky_first_look_does_not_pause_a_request_where_drafting_is_cheap():
    # Where drafting costs little over a plain step (a GPU's break-even near 1), a first look
    # whose draft is rejected says little about the rate: drafting goes on, K at a time.
    backoff = DraftBackoff(break_even=1.1, look_break_even=1.05, num_drafts=K)
    assert _drafts(backoff, [0, 3, 4, 0, 0, 2], 60) == [(0, 1)] + [(s, K) for s in range(1, 60)]
    # Where it costs twice a plain step, the same look pauses it; a look that is accepted after
    # the pause brings back K drafts.
    cpu = DraftBackoff(break_even=2.0, look_break_even=1.5, num_drafts=K)
    assert _drafts(cpu, [0, 1, 1, K], 60)[:4] == [(0, 1), (16, 1), (47, 1), (48, K)]


def test_a_request_whose_drafts_stop_paying_pauses_from_its_own_estimate():
    backoff = DraftBackoff(break_even=2.0, look_break_even=1.5, num_drafts=K)
    # Six verifications accept every draft, then none do: the decayed estimate falls below the
    # break-even after nine more, and the pauses start over at 8 (its rate still near the
    # break-even), then double.
    drafted = _drafts(backoff, [K] * 6 + [0], 200)
    assert drafted == [(0, 1), *((s, K) for s in range(1, 15)), (23, 1), (40, 1), (73, 1), (138, 1)]
    backoff.forget("r")
    assert backoff.drafts_for("r") == 1 and backoff.drafts_next("r")


def test_drafts_next_says_whether_the_next_step_drafts_without_counting_it():
    backoff = DraftBackoff(break_even=2.0, look_break_even=1.5, num_drafts=K)
    assert backoff.drafts_next("r")  # a new request looks
    backoff.observe("r", 1, 1)
    assert not backoff.drafts_next("r") and not backoff.drafts_next("r")
    steps = 0
    while not backoff.drafts_next("r"):
        assert backoff.drafts_for("r") == 0
        steps += 1
    assert steps == 15 and backoff.drafts_for("r") == 1


def test_fewer_drafts_than_the_session_drafts_count_as_all_accepted():
    # A request near its max_tokens verifies 2 drafts: both accepted is no rejection.
    backoff = DraftBackoff(break_even=2.0, look_break_even=1.5, num_drafts=K)
    for _ in range(10):
        backoff.observe("r", 3, 2)
    assert backoff.drafts_for("r") == K


def test_requests_back_off_apart():
    backoff = DraftBackoff(break_even=2.0, look_break_even=1.5, num_drafts=K)
    backoff.observe("poor", 1, 1)
    backoff.observe("good", 2, 1)
    backoff.observe("good", 5, K)
    assert backoff.drafts_for("poor") == 0 and backoff.drafts_for("good") == K


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
