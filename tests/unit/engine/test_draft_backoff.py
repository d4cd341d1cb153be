"""DraftBackoff: a request drafts a look (one draft) first; it drafts K while its drafts pay, and
one whose drafts do not pay stops drafting for pauses that keep its looks at 1% of its tokens
and at least double, looks again after each, and drafts K again once its estimated acceptance is
back above the break-even; one unlucky verification where drafting is cheap does not pause it.
The break-evens are those of the step's batch size: drafts that pay alone may not in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from libkk.engine.speculation import DraftBackoff, break_even_length
from libkk.spec_decode.adaptive import CostModel

K = 4


def backoff_at(break_even: float, look_break_even: float) -> DraftBackoff:
    """A backoff whose break-evens are the same at every batch size."""
    return DraftBackoff(lambda n, d: break_even if d == K else look_break_even, num_drafts=K)


def _drafts(
    backoff: DraftBackoff, accepts: list[int], steps: int, batch: int = 1
) -> list[tuple[int, int]]:
    """(step, drafts) of each step (0-based) at which the request drafted, in steps of `batch`
    requests; its verifications accept `accepts` in turn (the last one repeated), at most all of
    the drafts."""
    drafted = []
    for step in range(steps):
        n = backoff.drafts_for("r", batch)
        if n:
            accepted = min(accepts[min(len(drafted), len(accepts) - 1)], n)
            backoff.observe("r", accepted + 1, n, batch)
            drafted.append((step, n))
    return drafted


def test_poor_drafts_pause_for_stretches_that_keep_looks_at_one_percent():
    backoff = backoff_at(2.0, 1.5)
    # Nothing accepted. After the first look the estimated rate is 1/3: K drafts are worth 1.49
    # tokens (below 2), and a look 1.33 where plain steps emit 1.5 in its time, so a pause of
    # 0.167 / 1% - 1.5 = 15 steps; then at least double, up to 128.
    assert _drafts(backoff, [0], 420) == [(s, 1) for s in (0, 16, 47, 108, 229, 358)]


def test_good_drafts_look_once_then_draft_k_every_step():
    backoff = backoff_at(2.0, 1.5)
    assert _drafts(backoff, [K], 50) == [(0, 1)] + [(s, K) for s in range(1, 50)]


def test_an_unlucky_first_look_does_not_pause_a_request_where_drafting_is_cheap():
    # Where drafting costs little over a plain step (a GPU's break-even near 1), a first look
    # whose draft is rejected says little about the rate: drafting goes on, K at a time.
    backoff = backoff_at(1.1, 1.05)
    assert _drafts(backoff, [0, 3, 4, 0, 0, 2], 60) == [(0, 1)] + [(s, K) for s in range(1, 60)]
    # Where it costs twice a plain step, the same look pauses it; a look that is accepted after
    # the pause brings back K drafts.
    cpu = backoff_at(2.0, 1.5)
    assert _drafts(cpu, [0, 1, 1, K], 60)[:4] == [(0, 1), (16, 1), (47, 1), (48, K)]


def test_a_request_whose_drafts_stop_paying_pauses_from_its_own_estimate():
    backoff = backoff_at(2.0, 1.5)
    # Six verifications accept every draft, then none do: the decayed estimate falls below the
    # break-even after nine more, and the pauses start over at 8 (its rate still near the
    # break-even), then double.
    drafted = _drafts(backoff, [K] * 6 + [0], 200)
    assert drafted == [(0, 1), *((s, K) for s in range(1, 15)), (23, 1), (40, 1), (73, 1), (138, 1)]
    backoff.forget("r")
    assert backoff.drafts_for("r", 1) == 1 and backoff.drafts_next("r")


def test_drafts_next_says_whether_the_next_step_drafts_without_counting_it():
    backoff = backoff_at(2.0, 1.5)
    assert backoff.drafts_next("r")  # a new request looks
    backoff.observe("r", 1, 1, 1)
    assert not backoff.drafts_next("r") and not backoff.drafts_next("r")
    steps = 0
    while not backoff.drafts_next("r"):
        assert backoff.drafts_for("r", 1) == 0
        steps += 1
    assert steps == 15 and backoff.drafts_for("r", 1) == 1


def test_fewer_drafts_than_the_session_drafts_count_as_all_accepted():
    # A request near its max_tokens verifies 2 drafts: both accepted is no rejection.
    backoff = backoff_at(2.0, 1.5)
    for _ in range(10):
        backoff.observe("r", 3, 2, 1)
    assert backoff.drafts_for("r", 1) == K


def test_requests_back_off_apart():
    backoff = backoff_at(2.0, 1.5)
    backoff.observe("poor", 1, 1, 1)
    backoff.observe("good", 2, 1, 1)
    backoff.observe("good", 5, K, 1)
    assert backoff.drafts_for("poor", 1) == 0 and backoff.drafts_for("good", 1) == K


def test_drafts_that_pay_alone_pause_in_a_large_batch():
    # Acceptance near 1.3 (one draft in four): K drafts are worth about 1.33 tokens, which pays
    # where a drafting step costs 1.1 plain ones (one request on a GPU) and not where it costs
    # 2 (32 requests, whose 32 * (1 + K) tokens make the forward compute-bound).
    backoff = DraftBackoff(lambda n, d: (1.1 if n == 1 else 2.0) if d == K else 1.05, K)
    accepts = [0, 1, 0, 0] * 10
    alone = _drafts(backoff, accepts, 40)
    assert alone == [(0, 1)] + [(s, K) for s in range(1, 40)]
    backoff.forget("r")
    in_batch = _drafts(backoff, accepts, 40, batch=32)
    # A look, a pause of FIRST_PAUSE, a look, a pause of twice that, and so on.
    assert in_batch == [(0, 1), (9, 1), (26, 1)]


def test_break_even_is_the_drafting_steps_time_over_a_plain_steps():
    cost = CostModel(draft_ms=[(1, 30.0)], verify_ms=[(1, 40.0), (5, 50.0)])
    assert break_even_length(cost, 1, 4) == pytest.approx((30.0 + 50.0) / 40.0)
    # A captured graph's time stands for the forward where steps replay graphs, that of the
    # smallest profiled size at least the batch's.
    graphs = CostModel(
        draft_ms=[(1, 1.0), (32, 2.0)], verify_ms=[(1, 40.0), (5, 50.0)],
        graph_ms={(1, 1): 5.0, (1, 5): 6.0, (32, 1): 7.0, (32, 5): 14.0},
    )  # fmt: skip
    assert break_even_length(graphs, 1, 4) == pytest.approx((1.0 + 6.0) / 5.0)
    in_batch = (1.0 + 19 / 31 + 14.0) / 7.0  # the draft curve read at 20 requests
    assert break_even_length(graphs, 20, 4) == pytest.approx(in_batch)
    assert break_even_length(graphs, 32, 4) == pytest.approx((2.0 + 14.0) / 7.0)
    cheap = CostModel(draft_ms=[(1, 0.0)], verify_ms=[(1, 40.0), (5, 20.0)])
    assert break_even_length(cheap, 1, 4) == 1.0  # a timing fluke never makes drafting pay less
    assert np.isfinite(break_even_length(cost, 1, 1))


def test_the_backoffs_profile_times_the_graphs_of_the_sizes_asked():
    """profile_costs with graph_sizes times the captured graphs of those sizes alone (every query
    length), its draft curve reaches the largest, and its forward curve stays at one request's
    verification."""
    import torch
    from torch import nn

    from libkk.engine.speculation import profile_costs
    from libkk.spec_decode.ngram import NgramProposer

    timed = []

    class Model(nn.Module):
        def compute_logits(self, hidden):
            return hidden

    class Runner:
        model, num_kv_groups = Model(), 1

        def forward(self, ids, positions):
            return None

        def graph_shapes(self):
            return [(n, q) for n in (1, 2, 4, 8, 16, 24, 32) for q in (1, 2, 1 + K)]

        def verify_on_graph(self, size, q):
            timed.append((size, q))

    cost = profile_costs(
        Runner(), NgramProposer(1, 4), num_speculative_tokens=K, max_num_seqs=1, block_size=16,
        hidden_size=8, vocab_size=100, device=torch.device("cpu"), dtype=torch.float32,
        warmup=0, repeats=1, graph_sizes=[1, 2, 4, 8, 16, 32, 64],
    )  # fmt: skip
    assert cost.graph_sizes == [1, 2, 4, 8, 16, 32]
    assert cost.graph_query_lens == [1, 2, 1 + K]
    assert sorted(timed) == [(n, q) for n in (1, 2, 4, 8, 16, 32) for q in (1, 2, 1 + K)]
    assert [n for n, _ in cost.draft_points] == [1, 2, 4, 8, 16, 32]
    assert [n for n, _ in cost.verify_points] == [1, 2, 4, 1 + K]
