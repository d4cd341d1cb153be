"""verify_from_shards (the runner's vocab-parallel verification) against verify on whole rows.

In one process the shard is the whole vocabulary and the gather stacks it; the split into several
shards is tested in test_vocab_parallel.py (the functions) and tests/e2e/test_vocab_parallel_tp.py
(the engine at tp=2 and 3). Here: the requests' rows, the kept shard drafts of sampled requests,
one-hot q for the others, padded verification depths and the greedy shortcut.
"""

from __future__ import annotations

import pytest
import torch

from libkk.runtime.io import ScheduledRequest
from libkk.runtime.verify import shards_cover, verify, verify_from_shards
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import SamplingRow
from libkk.spec_decode.vocab_parallel import ShardDrafts, stack_gather, vocab_parallel_draft

VOCAB = 40


def _request(rid, params, num_drafts, seed, draft_logits=None, drafts=None, banned=()):
    drafts = drafts if drafts is not None else [(7 * seed + j) % VOCAB for j in range(num_drafts)]
    row = SamplingRow(
        params=params,
        seed=seed,
        position=20 + seed,
        prompt_token_ids=[1, 2],
        output_token_ids=[3],
        banned_token_ids=banned,
    )
    return ScheduledRequest(
        request_id=rid,
        token_ids=[5, *drafts],
        num_computed_tokens=19 + seed,
        block_tables=[[1]],
        sampling=row,
        spec_token_ids=list(drafts),
        draft_logits=draft_logits,
    )


def _sampled_drafts(rid, params, n, seed, gen):
    """A request whose drafts were sampled from its draft logits (as DFlash drafts them), and the
    ShardDrafts a rank holding the whole vocabulary keeps for it."""
    logits = torch.randn(n, VOCAB, generator=gen) * 2
    position = 20 + seed
    sample = vocab_parallel_draft(
        [logits],
        [0],
        torch.full((n,), params.temperature),
        torch.full((n,), seed, dtype=torch.int64),
        position + torch.arange(n),
    )
    drafts = sample.token_ids.tolist()
    kept = ShardDrafts(drafts, logits, sample.logprobs, sample.lse)
    return _request(rid, params, n, seed, draft_logits=logits, drafts=drafts), kept


@pytest.mark.parametrize("trial", range(6))
def test_sampled_and_one_hot_drafts_verify_as_on_whole_rows(trial):
    gen = torch.Generator().manual_seed(trial)
    requests, kept = [], {}
    for i, temperature in enumerate([0.6, 1.0, 1.3]):
        params = SamplingParams(temperature=temperature)
        request, shard = _sampled_drafts(f"s{i}", params, 1 + (i + trial) % 4, 10 * trial + i, gen)
        requests.append(request)
        kept[request.request_id] = shard
    requests.append(_request("g", SamplingParams(temperature=0.0), 3, 50 + trial))  # one-hot
    requests.append(_request("o", SamplingParams(temperature=0.9), 2, 60 + trial))  # one-hot
    logits = [torch.randn(r.num_spec_tokens + 1, VOCAB, generator=gen) * 2 for r in requests]

    whole = verify(logits, requests).to_host()
    without_q = [
        ScheduledRequest(**{**vars(r), "draft_logits": None}) for r in requests
    ]  # as the engine schedules drafts whose q is kept in shards
    assert shards_cover(without_q, VOCAB)
    shards = verify_from_shards(logits, without_q, 0, kept, stack_gather).to_host()
    assert [tokens for tokens, _ in shards] == [tokens for tokens, _ in whole]
    assert all(lp is None for _, lps in shards for lp in lps)


def test_greedy_steps_take_the_argmax_shortcut():
    gen = torch.Generator().manual_seed(3)
    requests = [
        _request(f"g{i}", SamplingParams(temperature=0.0), n, i) for i, n in enumerate([0, 1, 4])
    ]
    logits = [torch.randn(r.num_spec_tokens + 1, VOCAB, generator=gen) for r in requests]
    # Drafts equal to the target's argmax are accepted: make the last request's first two so.
    requests[2].spec_token_ids[:2] = logits[2][:2].argmax(dim=-1).tolist()
    whole = verify(logits, requests).to_host()
    shards = verify_from_shards(logits, requests, 0, {}, stack_gather).to_host()
    assert shards == whole
    assert len(shards[2][0]) >= 3


def test_rows_the_shards_do_not_cover():
    plain = SamplingParams(temperature=0.8)
    assert shards_cover([_request("a", plain, 2, 1)], VOCAB)
    for params in (
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=0.8, min_p=0.1),
        SamplingParams(temperature=0.8, logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
    ):
        assert not shards_cover([_request("a", plain, 2, 1), _request("b", params, 2, 2)], VOCAB)
    assert not shards_cover([_request("a", plain, 2, 1, banned=(1,))], VOCAB)
    # Greedy rows ignore the filters; whole draft logits mean q is not kept in shards.
    assert shards_cover([_request("a", SamplingParams(temperature=0.0, top_p=0.5), 2, 1)], VOCAB)
    assert not shards_cover([_request("a", plain, 2, 1, draft_logits=torch.zeros(2, VOCAB))], VOCAB)


def test_kept_drafts_must_be_the_verified_ones():
    gen = torch.Generator().manual_seed(0)
    request, shard = _sampled_drafts("s", SamplingParams(temperature=1.0), 3, 4, gen)
    request.draft_logits = None
    shard.token_ids = [(t + 1) % VOCAB for t in shard.token_ids]
    logits = [torch.randn(4, VOCAB, generator=gen)]
    with pytest.raises(RuntimeError, match="kept draft shard"):
        verify_from_shards(logits, [request], 0, {"s": shard}, stack_gather).to_host()
