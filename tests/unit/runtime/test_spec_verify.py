"""Verification of drafts in the runner: per-position processing, synthetic acceptance rates."""

from __future__ import annotations

import pytest
import torch

from libkk.runtime.io import ScheduledRequest
from libkk.runtime.verify import verify
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import Sampler, SamplingRow
from libkk.spec_decode.logits import position_rows

VOCAB = 32


def _request(rid, drafts, params, seed=0, position=10, output=(), draft_logits=None):
    row = SamplingRow(
        params=params,
        seed=seed,
        position=position,
        prompt_token_ids=[1, 2, 3],
        output_token_ids=list(output),
        banned_token_ids=(),
    )
    return ScheduledRequest(
        request_id=rid,
        token_ids=[5, *drafts],
        num_computed_tokens=position - 1,
        block_tables=[[1]],
        sampling=row,
        spec_token_ids=list(drafts),
        draft_logits=draft_logits,
    )


def test_position_rows_see_accepted_drafts():
    params = SamplingParams(min_tokens=3, repetition_penalty=1.5)
    row = SamplingRow(
        params=params,
        seed=7,
        position=4,
        prompt_token_ids=[1],
        output_token_ids=[9],
        banned_token_ids=(2,),
    )
    rows = position_rows(row, [11, 12, 13], 4)
    assert [r.position for r in rows] == [4, 5, 6, 7]
    assert [list(r.output_token_ids) for r in rows] == [[9], [9, 11], [9, 11, 12], [9, 11, 12, 13]]
    # One output token so far: bans hold while fewer than min_tokens = 3 exist.
    assert [tuple(r.banned_token_ids) for r in rows] == [(2,), (2,), (), ()]


def test_greedy_verification_matches_sequential_sampling():
    """Accepted drafts + the correction equal what the plain sampler picks row by row, with
    penalties that count the accepted drafts."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5)
    logits = torch.randn(4, VOCAB)  # [1 + n, V]
    sampler = Sampler()
    # The plain sampler's picks at each position, feeding its own tokens back as output.
    want, output = [], [7]
    for k in range(4):
        row = SamplingRow(params, 0, 10 + k, [1, 2, 3], list(output))
        token = sampler(logits[k : k + 1], [row]).token_ids[0]
        want.append(token)
        output.append(token)
    # Drafts: the first two right, the third wrong.
    drafts = [want[0], want[1], (want[2] + 1) % VOCAB]
    [(tokens, _)] = verify([logits], [_request("r", drafts, params, output=[7])]).to_host()
    assert tokens == want[:3]
    # All right: the bonus token at the fourth row.
    [(tokens, _)] = verify([logits], [_request("r", want[:3], params, output=[7])]).to_host()
    assert tokens == want


def test_bonus_token_is_the_plain_samplers_draw():
    torch.manual_seed(1)
    params = SamplingParams(temperature=0.8, top_k=10, seed=3)
    logits = torch.randn(3, VOCAB)
    draft_logits = logits[:2].clone()  # q == p: every draft is accepted
    sampler = Sampler()
    out = [5]
    drafts = []
    for k in range(2):
        row = SamplingRow(params, 3, 10 + k, [1], list(out))
        t = sampler(logits[k : k + 1], [row]).token_ids[0]
        drafts.append(t)
        out.append(t)
    bonus_row = SamplingRow(params, 3, 12, [1], list(out))
    bonus = sampler(logits[2:3], [bonus_row]).token_ids[0]
    req = _request("r", drafts, params, seed=3, output=[5], draft_logits=draft_logits)
    [(tokens, _)] = verify([logits], [req]).to_host()
    assert tokens == [*drafts, bonus]


@pytest.mark.parametrize("rates", [[0.5], [0.9, 0.6, 0.3]])
def test_synthetic_accepts_at_configured_rates(rates):
    k = 3
    per_pos = [rates[min(j, len(rates) - 1)] for j in range(k)]
    logits = torch.zeros(k + 1, VOCAB)
    params = SamplingParams(temperature=0.0)
    reqs = [_request(f"r{i}", [1, 2, 3], params, seed=i, position=20 + i) for i in range(4000)]
    results = verify([logits] * len(reqs), reqs, synthetic_rates=rates).to_host()
    accepted = torch.tensor([len(t) - 1 for t, _ in results])
    for j in range(k):
        reached = int((accepted >= j).sum())
        took = int((accepted >= j + 1).sum())
        rate = took / reached
        sigma = (per_pos[j] * (1 - per_pos[j]) / reached) ** 0.5
        assert abs(rate - per_pos[j]) < 4 * sigma + 1e-9, (j, rate, per_pos[j])
    # Deterministic: the same keyed uniforms give the same result.
    again = verify([logits] * 50, reqs[:50], synthetic_rates=rates).to_host()
    assert again == results[:50]
    # The token after the accepted run is the target's argmax (zeros: token 0).
    assert all(t[-1] == 0 for t, _ in results)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_synthetic_final_token_is_the_plain_samplers_in_ragged_mixed_batches(rate):
    """Requests with different draft counts, greedy and random side by side: the token after
    the accepted run (none at rate 0, all at rate 1) is what the plain sampler draws at that row."""
    g = torch.Generator().manual_seed(3)
    sampler = Sampler()
    reqs, logits = [], []
    for i, n in enumerate([1, 3, 2, 3, 1, 2]):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i)
        reqs.append(_request(f"r{i}", list(range(4, 4 + n)), params, seed=100 + i, position=30))
        logits.append(torch.randn(n + 1, VOCAB, generator=g))
    results = verify(logits, reqs, synthetic_rates=[rate]).to_host()
    for r, x, (tokens, _) in zip(reqs, logits, results, strict=True):
        n = r.num_spec_tokens
        accepted = n if rate == 1.0 else 0
        assert tokens[:-1] == r.spec_token_ids[:accepted]
        row = position_rows(r.sampling, r.spec_token_ids, n + 1)[accepted]
        expected = sampler(x[accepted : accepted + 1], [row]).token_ids[0]
        assert tokens[-1] == expected


def test_rows_back_to_back_are_joined_without_a_copy():
    from libkk.runtime.verify import _concat_rows

    logits = torch.randn(9, VOCAB)
    for parts in (
        [logits[0:3], logits[3:4], logits[4:9]],
        [logits[0:3, :16], logits[3:5, :16]],  # strided rows: still one view
    ):
        joined = _concat_rows(parts)
        assert joined.data_ptr() == logits.data_ptr() and torch.equal(joined, torch.cat(parts))
    for parts in (
        [logits[0:3], logits[4:9]],  # a plain row between them
        [logits[3:4], logits[0:3]],  # out of order
        [logits[0:3], torch.randn(2, VOCAB)],  # another tensor
    ):
        joined = _concat_rows(parts)
        assert torch.equal(joined, torch.cat(parts))
        assert joined.data_ptr() != logits.data_ptr()
