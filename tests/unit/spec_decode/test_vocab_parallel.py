"""Vocab-parallel drafting and verification == the full-vocab path, over simulated shards."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from libkk.distributed import as_rank
from libkk.errors import SpeculationInputError
from libkk.layers.embedding import (
    LMHead,
    merge_shard_argmax,
    shard_argmax_stats,
    vocab_parallel_head,
)
from libkk.sample.gumbel import gumbel_argmax
from libkk.sample.rejection import rejection_sample
from libkk.spec_decode.estimator import draft_feature
from libkk.spec_decode.vocab_parallel import (
    DRAFT_STATS,
    FINAL_STATS,
    VERIFY_STATS,
    VerifyPlan,
    combine_final_stats,
    final_shard_stats,
    sample_draft_full,
    stack_gather,
    tp_gather,
    vocab_parallel_draft,
    vocab_parallel_rejection_sample,
    vocab_starts,
)

VOCAB = 37
# 1 to 4 shards, even and uneven splits (a one-token shard included).
SPLITS = [[37], [18, 19], [10, 9, 18], [1, 12, 7, 17], [9, 9, 9, 10]]
TEMPS = [0.0, 0.6, 0.8, 1.0, 1.3]


def _split(x: Tensor, sizes: list[int]) -> list[Tensor]:
    return list(x.split(sizes, dim=-1))


class CountingGather:
    """stack_gather that records what crossed the (simulated) wire."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, tensors: list[Tensor]) -> Tensor:
        out = stack_gather(tensors)
        self.shapes.append(tuple(out.shape))
        return out


def _case(seed: int, num_rows: int = 41, k: int = 4) -> dict[str, Tensor]:
    """Random draft/target logits close enough that every verification depth occurs."""
    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([TEMPS[i % len(TEMPS)] for i in range(num_rows)])
    draft_logits = torch.randn(num_rows, k, VOCAB, generator=g) * 2.5
    target = torch.randn(num_rows, k + 1, VOCAB, generator=g) * 2.5
    # Per row, how close the target is to the drafter: from identical-ish to unrelated.
    mix = torch.rand(num_rows, 1, 1, generator=g) ** 2
    target[:, :k] = (1 - mix) * draft_logits + mix * target[:, :k]
    # Some rows nearly one-hot, so one-hot drafts also get accepted all the way.
    sharp = 1.0 + 3.0 * torch.rand(num_rows, 1, 1, generator=g)
    draft_logits *= sharp
    target *= sharp
    target[-1] = 0.0  # a padded row: constant logits, nothing to verify
    draft_logits[-1] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=g)
    positions = torch.randint(0, 5000, (num_rows,), generator=g)
    # Every (temperature, num_draft) pair occurs in each case.
    num_draft = (torch.arange(num_rows) // len(TEMPS)) % (k + 1)
    num_draft[-1] = 0
    return dict(
        temps=temps,
        draft_logits=draft_logits,
        target=target,
        seeds=seeds,
        positions=positions,
        num_draft=num_draft,
    )


def _draft_all(c: dict[str, Tensor], sizes: list[int] | None):
    """Draft K slots per row (flattened [R*K] rows), full path or vocab-parallel."""
    num_rows, k, _ = c["draft_logits"].shape
    flat = c["draft_logits"].reshape(num_rows * k, VOCAB)
    temps = c["temps"].repeat_interleave(k)
    seeds = c["seeds"].repeat_interleave(k)
    positions = (c["positions"][:, None] + torch.arange(k)).reshape(-1)
    if sizes is None:
        return sample_draft_full(flat, temps, seeds, positions).view(num_rows, k)
    return vocab_parallel_draft(_split(flat, sizes), vocab_starts(sizes), temps, seeds, positions)


@pytest.mark.parametrize("sizes", SPLITS, ids=lambda s: "x".join(map(str, s)))
def test_draft_tokens_match_full_vocab(sizes: list[int]) -> None:
    for seed in range(6):
        c = _case(seed)
        num_rows, k, _ = c["draft_logits"].shape
        full = _draft_all(c, None)
        vp = _draft_all(c, sizes)
        assert torch.equal(vp.token_ids.view(num_rows, k), full)
        # q of the drawn token and the row's log-sum-exp agree with the full softmax.
        temp = torch.where(c["temps"] == 0, 1.0, c["temps"])[:, None, None]
        z = c["draft_logits"] / temp
        lse = torch.logsumexp(z, dim=-1).reshape(-1)
        torch.testing.assert_close(vp.lse, lse, rtol=0, atol=1e-5)
        logq = torch.log_softmax(z, dim=-1).gather(-1, full[..., None]).reshape(-1)
        torch.testing.assert_close(vp.logprobs, logq, rtol=0, atol=1e-5)
        feats = draft_feature(c["draft_logits"], c["temps"][:, None]).reshape(-1)
        torch.testing.assert_close(vp.features, feats, rtol=1e-4, atol=1e-4)


def test_greedy_drafts_take_the_lowest_id_among_equal_logits() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[0, [5, 20, 30]] = 2.0  # ties across shards
    logits[1, [19, 18]] = 1.0  # ties around a shard boundary (18 | 19)
    logits[2] = -math.inf
    logits[2, 36] = 0.0
    sizes = [18, 19]
    temps = torch.zeros(3)
    seeds = torch.arange(3, dtype=torch.int64)
    positions = torch.zeros(3, dtype=torch.int64)
    vp = vocab_parallel_draft(_split(logits, sizes), vocab_starts(sizes), temps, seeds, positions)
    assert vp.token_ids.tolist() == [5, 18, 36]
    assert vp.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def _reference(c: dict[str, Tensor], drafts: Tensor, one_hot: bool) -> tuple[Tensor, Tensor]:
    temp = torch.where(c["temps"] == 0, 1.0, c["temps"])[:, None, None]
    probs = None if one_hot else torch.softmax(c["draft_logits"] / temp, dim=-1)
    return rejection_sample(
        c["target"], drafts, probs, c["temps"], c["seeds"], c["positions"], c["num_draft"]
    )


@pytest.mark.parametrize("sizes", SPLITS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("one_hot", [False, True], ids=["probabilistic", "one_hot"])
def test_rejection_sampling_matches_full_vocab(sizes: list[int], one_hot: bool) -> None:
    depths: set[tuple[float, int, int]] = set()
    residuals = 0
    for seed in range(12):
        c = _case(100 + seed)
        num_rows, k, _ = c["draft_logits"].shape
        drafts = _draft_all(c, None)
        vp = _draft_all(c, sizes)
        assert torch.equal(vp.token_ids.view(num_rows, k), drafts)
        # Padded slots may hold anything.
        slots = torch.arange(k)[None, :]
        drafts = torch.where(slots < c["num_draft"][:, None], drafts, -1)
        ref_out, ref_acc = _reference(c, drafts, one_hot)
        gather = CountingGather()
        out, acc = vocab_parallel_rejection_sample(
            _split(c["target"], sizes),
            None if one_hot else _split(c["draft_logits"], sizes),
            vocab_starts(sizes),
            drafts,
            None if one_hot else vp.logprobs.view(num_rows, k),
            None if one_hot else vp.lse.view(num_rows, k),
            c["temps"],
            c["seeds"],
            c["positions"],
            c["num_draft"],
            gather=gather,
        )
        assert torch.equal(acc, ref_acc)
        assert torch.equal(out, ref_out)
        # Two small gathers, none with a vocab dimension.
        assert gather.shapes == [
            (len(sizes), num_rows, k + 1, VERIFY_STATS),
            (len(sizes), num_rows, FINAL_STATS),
        ]
        for r in range(num_rows):
            depths.add((float(c["temps"][r]), int(c["num_draft"][r]), int(acc[r])))
        residuals += int(((acc < c["num_draft"]) & (c["temps"] > 0)).sum())
    # Every verification depth, for greedy and sampled rows: rejection at each slot and full
    # acceptance (bonus token) for every num_draft.
    for greedy in (True, False):
        seen = {(n, a) for t, n, a in depths if (t == 0) == greedy}
        for n in range(k + 1):
            assert (n, n) in seen, f"greedy={greedy}: never all {n} accepted"
            for a in range(n):
                assert (n, a) in seen, f"greedy={greedy}: never rejected at {a} of {n}"
    assert residuals > 50


def test_one_hot_rows_mixed_into_probabilistic_ones() -> None:
    sizes = [10, 9, 18]
    for seed in range(4):
        c = _case(300 + seed)
        num_rows, k, _ = c["draft_logits"].shape
        drafts = _draft_all(c, None)
        vp = _draft_all(c, sizes)
        one_hot = torch.arange(num_rows) % 3 == 0  # every third row drafted greedily elsewhere
        # Those rows: one-hot q at the given draft, as log q = 0 at it and -inf elsewhere.
        hot = torch.full_like(c["draft_logits"], -math.inf).scatter(-1, drafts[..., None], 0.0)
        draft_logits = torch.where(one_hot[:, None, None], hot, c["draft_logits"])
        logprobs = torch.where(one_hot[:, None], 0.0, vp.logprobs.view(num_rows, k))
        lse = torch.where(one_hot[:, None], 0.0, vp.lse.view(num_rows, k))
        temp = torch.where(c["temps"] == 0, 1.0, c["temps"])[:, None, None]
        probs = torch.softmax(c["draft_logits"] / temp, dim=-1)
        probs = torch.where(one_hot[:, None, None], hot.exp(), probs)
        args = (c["temps"], c["seeds"], c["positions"], c["num_draft"])
        ref_out, ref_acc = rejection_sample(c["target"], drafts, probs, *args)
        out, acc = vocab_parallel_rejection_sample(
            _split(c["target"], sizes),
            _split(draft_logits, sizes),
            vocab_starts(sizes),
            drafts,
            logprobs,
            lse,
            *args,
        )
        assert torch.equal(acc, ref_acc)
        assert torch.equal(out, ref_out)


def test_draft_gather_is_small() -> None:
    c = _case(7)
    num_rows, k, _ = c["draft_logits"].shape
    sizes = [10, 9, 18]
    gather = CountingGather()
    flat = c["draft_logits"].reshape(num_rows * k, VOCAB)
    vocab_parallel_draft(
        _split(flat, sizes),
        vocab_starts(sizes),
        c["temps"].repeat_interleave(k),
        c["seeds"].repeat_interleave(k),
        torch.zeros(num_rows * k, dtype=torch.int64),
        gather=gather,
    )
    assert gather.shapes == [(3, num_rows * k, DRAFT_STATS)]


def test_empty_residual_falls_back_to_the_target_like_the_full_path() -> None:
    # p == q: a rejection has probability 0 but the full path then samples from p; force one.
    num_rows, k = 6, 2
    g = torch.Generator().manual_seed(3)
    target = torch.randn(num_rows, k + 1, VOCAB, generator=g)
    draft = target[:, :k].clone()
    temps = torch.full((num_rows,), 0.9)
    seeds = torch.arange(num_rows, dtype=torch.int64) * 7919
    positions = torch.arange(num_rows, dtype=torch.int64) * 3
    z = target / 0.9
    lse = torch.logsumexp(z, dim=-1)  # [R, K+1]
    plan = VerifyPlan(
        num_accepted=torch.zeros(num_rows, dtype=torch.int64),
        resample=torch.ones(num_rows, dtype=torch.bool),  # drawn drafts
        greedy=torch.zeros(num_rows, dtype=torch.bool),
        lse=lse,
        target_argmax=target.argmax(dim=-1),
        drafts=torch.zeros(num_rows, k, dtype=torch.int64),
    )
    sizes = [20, 17]
    shards = zip(_split(target, sizes), _split(draft, sizes), vocab_starts(sizes), strict=True)
    local = [
        final_shard_stats(t, d, lse[:, :k], s, plan, temps, seeds, positions) for t, d, s in shards
    ]
    out = combine_final_stats(stack_gather(local), plan, plan.drafts)
    expected = gumbel_argmax(torch.log_softmax(z[:, 0], dim=-1), seeds, positions)
    assert out[:, 0].tolist() == expected.tolist()
    assert bool((out[:, 1:] == -1).all())


def test_bad_inputs_raise() -> None:
    c = _case(1)
    num_rows, k, _ = c["draft_logits"].shape
    drafts = torch.zeros(num_rows, k, dtype=torch.int64)
    args = (c["temps"], c["seeds"], c["positions"], c["num_draft"])
    with pytest.raises(SpeculationInputError, match="all be given"):
        vocab_parallel_rejection_sample(
            [c["target"]], [c["draft_logits"]], [0], drafts, None, None, *args
        )
    with pytest.raises(SpeculationInputError, match="one vocab start per shard"):
        vocab_parallel_rejection_sample([c["target"]], None, [0, 5], drafts, None, None, *args)
    with pytest.raises(SpeculationInputError, match="draft_token_ids"):
        vocab_parallel_rejection_sample([c["target"]], None, [0], drafts[:, :1], None, None, *args)
    with pytest.raises(SpeculationInputError, match="num_draft must lie"):
        bad = (c["temps"], c["seeds"], c["positions"], c["num_draft"] + k + 1)
        vocab_parallel_rejection_sample([c["target"]], None, [0], drafts, None, None, *bad)
    with pytest.raises(SpeculationInputError, match="shard sizes"):
        vocab_starts([4, 0])
    with pytest.raises(SpeculationInputError, match="seeds must be"):
        vocab_parallel_draft(
            [c["draft_logits"][:, 0]], [0], c["temps"], c["seeds"][:3], c["positions"]
        )


@pytest.mark.parametrize("sizes", [[7, 7, 6], [20], [1, 9, 10]])
def test_greedy_shard_stats_give_the_full_row_argmax(sizes: list[int]) -> None:
    """(max, token) per shard, merged: argmax of the whole row, ties to the lowest id, with
    all-negative rows (a padded shard's zero columns must not be passed in)."""
    g = torch.Generator().manual_seed(4)
    vocab = sum(sizes)
    logits = torch.randn(40, vocab, generator=g) - 10.0
    logits[:10] = torch.randint(0, 3, (10, vocab), generator=g).float()  # many exact ties
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    stats = [
        shard_argmax_stats(logits[:, s : s + n], s) for s, n in zip(starts, sizes, strict=True)
    ]
    assert torch.equal(merge_shard_argmax(torch.stack(stats)), logits.argmax(dim=-1))


# ---------------------------------------------------------------------------------------------
# Engine pieces: the gather of one rank's shard, the LM head's shard geometry


def test_tp_gather_at_one_rank_stacks_the_one_shard() -> None:
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(tp_gather([x]), x[None])
    with pytest.raises(SpeculationInputError, match="one shard"):
        tp_gather([x, x])


@pytest.mark.parametrize(("vocab", "size"), [(250, 3), (250, 4), (40, 2)])
def test_lm_head_shards_cover_the_vocabulary_in_rank_order(vocab: int, size: int) -> None:
    shards = []
    for rank in range(size):
        with as_rank(rank, size):
            head = LMHead(vocab, 8)
            assert vocab_parallel_head(torch.nn.Module()) is None  # no lm_head
            model = torch.nn.Module()
            model.lm_head = head
            assert vocab_parallel_head(model) is head
            shards.append(head.vocab_shard)
            assert head.weight.shape[0] >= len(head.vocab_shard)  # padding rows past the ids
    assert [t for shard in shards for t in shard] == list(range(vocab))


def test_a_head_that_leaves_a_rank_without_tokens_is_not_used_from_shards() -> None:
    with as_rank(3, 4):  # 5 tokens over 4 ranks: 2 per rank, the last rank holds none
        model = torch.nn.Module()
        model.lm_head = LMHead(5, 8)
        assert vocab_parallel_head(model) is None
