"""The sampler: penalties, filters, keyed sampling, logprobs, and its output distribution."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from chi2 import chi2_critical

from libkk.sample.gumbel import gumbel_argmax
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import (
    Sampler,
    SamplingRow,
    apply_filters,
    apply_penalties,
    top_k_top_p,
)


def row(
    params: SamplingParams,
    seed: int = 0,
    position: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    banned: Sequence[int] = (),
) -> SamplingRow:
    return SamplingRow(
        params=params,
        seed=seed,
        position=position,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        banned_token_ids=list(banned),
    )


GREEDY = SamplingParams(temperature=0.0)
RANDOM = SamplingParams(temperature=1.0)


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=gen)
    logits[3, [10, 500, 900]] = 50.0  # a three-way tie
    out = Sampler()(logits, [row(GREEDY, seed=i) for i in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 10
    assert out.logprobs == [None] * 8
    out16 = Sampler()(logits.bfloat16(), [row(GREEDY)] * 8)
    assert out16.token_ids == logits.bfloat16().float().argmax(dim=-1).tolist()


def penalize_loop(
    logits: list[float],
    p: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    banned: Sequence[int],
) -> list[float]:
    """The penalties written out token by token (HF repetition penalty, OpenAI freq/presence)."""
    x = list(logits)
    for t in banned:
        x[t] = -math.inf
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        count = list(output).count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def test_penalties_match_a_token_loop() -> None:
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    vocab = 50
    logits = torch.randn(6, vocab, generator=gen) * 3
    settings = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.7),
        SamplingParams(),  # no penalty: untouched
        SamplingParams(repetition_penalty=1.1, presence_penalty=-1.0, frequency_penalty=2.0),
        SamplingParams(frequency_penalty=1.0),  # no output yet: untouched
    ]
    rows = []
    for i, p in enumerate(settings):
        prompt = [rng.randrange(vocab) for _ in range(12)]
        output = [] if i == 5 else [rng.randrange(vocab // 3) for _ in range(20)]  # repeats
        rows.append(row(p, prompt=prompt, output=output, banned=[7, 8] if i in (1, 4) else []))
    got = apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        want = penalize_loop(
            logits[i].tolist(), r.params, r.prompt_token_ids, r.output_token_ids, r.banned_token_ids
        )
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-6), i
    assert torch.equal(got[3], logits[3])
    # Greedy rows pick the argmax of the penalized logits; the input is not modified.
    before = logits.clone()
    greedy_rows = [
        row(
            SamplingParams(temperature=0.0, **_penalty_fields(r.params)),
            prompt=r.prompt_token_ids,
            output=r.output_token_ids,
            banned=r.banned_token_ids,
        )
        for r in rows
    ]
    out = Sampler()(logits, greedy_rows)
    assert out.token_ids == got.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)


def _penalty_fields(p: SamplingParams) -> dict[str, float]:
    return {
        "repetition_penalty": p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
    }


def test_banned_ids_are_never_sampled() -> None:
    vocab = 20
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 30.0  # overwhelmingly likely, but banned
    logits[0, 4] = 2.0
    sampler = Sampler()
    for params in (GREEDY, RANDOM, SamplingParams(temperature=2.0)):
        rows = [
            row(params, seed=s, position=p, banned=[3, 11]) for s in range(20) for p in range(20)
        ]
        out = sampler(logits.expand(len(rows), vocab), rows)
        assert 3 not in out.token_ids and 11 not in out.token_ids
        assert (params.greedy and set(out.token_ids) == {4}) or len(set(out.token_ids)) > 5


def kept(logits: torch.Tensor, **kw: float) -> set[int]:
    params = SamplingParams(**kw)
    out = apply_filters(logits.clone()[None], [params])[0]
    return set(torch.isfinite(out).nonzero()[:, 0].tolist())


def test_filters_on_known_logits() -> None:
    probs = [0.04, 0.25, 0.1, 0.4, 0.06, 0.15]  # ids by probability: 3, 1, 5, 2, 4, 0
    logits = torch.tensor(probs).log()
    assert kept(logits) == set(range(6))
    assert kept(logits, top_k=3) == {3, 1, 5}
    assert kept(logits, top_k=1) == {3}
    assert kept(logits, top_k=-1) == set(range(6))
    assert kept(logits, top_p=0.3) == {3}  # the top token alone reaches 0.3
    assert kept(logits, top_p=0.6) == {3, 1}  # 0.4 < 0.6, 0.65 >= 0.6
    assert kept(logits, top_p=0.7) == {3, 1, 5}  # 0.8 >= 0.7
    assert kept(logits, top_p=0.99) == set(range(6))
    assert kept(logits, min_p=0.3) == {3, 1, 5}  # p >= 0.12
    assert kept(logits, min_p=0.2) == {3, 1, 5, 2}  # p >= 0.08
    assert kept(logits, min_p=1.0) == {3}
    # Top-p renormalizes over what top-k kept: 0.4 / 0.65 = 0.615 >= 0.6.
    assert kept(logits, top_k=2, top_p=0.6) == {3}
    assert kept(logits, top_k=4, top_p=0.9, min_p=0.3) == {3, 1, 5}
    # Temperature changes top-p's set (flatter: more tokens needed) but not min-p's ratio test.
    assert kept(logits, temperature=3.0, top_p=0.6) == {3, 1, 5}
    assert kept(logits, temperature=3.0, min_p=0.3) == {3, 1, 5, 2, 4, 0}
    # Ties at the cut are all kept.
    tied = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0])
    assert kept(tied, top_k=2) == {1, 2, 3}


def reference_keep(row_logits: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """Top-k then top-p written out in float64 (ties at either cut kept)."""
    order = np.argsort(-row_logits, kind="stable")
    vals = row_logits[order]
    k = len(vals) if top_k <= 0 else min(top_k, len(vals))
    keep_vals = vals[vals >= vals[k - 1]]
    p = np.exp(keep_vals - keep_vals.max())
    p /= p.sum()
    before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    n = int((before < top_p).sum()) if top_p < 1.0 else k
    threshold = keep_vals[n - 1]
    return set(np.nonzero(row_logits >= threshold)[0].tolist())


def test_top_k_top_p_candidate_path_and_full_sort_agree_with_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 6000
    scales = [0.3, 1.0, 3.0, 8.0]  # flat rows fall back to the full sort, peaky ones do not
    cases = [(k, p) for k in (0, 5, 900, 1024, 3000) for p in (1.0, 0.5, 0.9, 0.99)]
    cases = [(k, p) for k, p in cases if (k, p) != (0, 1.0)]
    logits = torch.cat([torch.randn(len(cases), vocab, generator=gen) * s for s in scales])
    logits = logits.round(decimals=1)  # plenty of exact ties
    top_k = torch.tensor([k if 0 < k < vocab else vocab for k, _ in cases] * len(scales))
    top_p = torch.tensor([p for _, p in cases] * len(scales))
    out = top_k_top_p(logits, top_k, top_p)
    mismatches = 0
    for i in range(logits.shape[0]):
        k, p = cases[i % len(cases)]
        got = set(torch.isfinite(out[i]).nonzero()[:, 0].tolist())
        want = reference_keep(logits[i].double().numpy(), k, p)
        mismatches += got != want
    # fp32 vs fp64 sums may move a cut that falls within ~1e-6 of top_p; none do here.
    assert mismatches == 0


def test_sampling_equals_gumbel_max_over_filtered_logits() -> None:
    # Rows whose kept set fits in the top-C candidates hash only those; the token must be the one
    # the full-vocab Gumbel-max over the filtered logits gives, on both paths.
    gen = torch.Generator().manual_seed(9)
    vocab = 5000
    settings = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.999),  # flat rows: the cut is past the top-C
        SamplingParams(temperature=1.2, top_k=1),
        SamplingParams(temperature=0.5, top_k=30, min_p=0.2),
        SamplingParams(temperature=1.0, top_k=2000),  # beyond the candidates: full sort
        SamplingParams(temperature=0.9, min_p=0.1),  # min-p alone: no candidates
        SamplingParams(temperature=1.0, top_k=1024),  # exactly the candidates
    ]
    scales = torch.tensor([0.2, 1.0, 4.0])
    logits = torch.randn(len(settings) * 3, vocab, generator=gen)
    logits = (logits * scales.repeat_interleave(len(settings))[:, None]).round(decimals=2)
    params = settings * 3
    rows = [row(p, seed=11 * i + 1, position=3 * i) for i, p in enumerate(params)]
    got = Sampler()(logits, rows).token_ids
    seeds = torch.tensor([r.seed for r in rows])
    positions = torch.tensor([r.position for r in rows])
    want = gumbel_argmax(apply_filters(logits.clone(), params), seeds, positions).tolist()
    assert got == want


def test_seeded_rows_are_independent_of_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 3000
    settings = [
        GREEDY,
        RANDOM,
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.2),
        SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.5
        ),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=2.0, top_k=2000),  # top-k beyond the fast path
    ]
    rows = [
        row(p, seed=1000 * i - 3, position=17 + i, prompt=[1, 2, 3, i], output=[5, 5, i])
        for i, p in enumerate(settings)
    ]
    logits = torch.randn(len(rows), vocab, generator=gen) * 2
    sampler = Sampler()
    alone = [sampler(logits[i : i + 1], [r]).token_ids[0] for i, r in enumerate(rows)]
    assert sampler(logits, rows).token_ids == alone
    order = list(range(len(rows)))
    filler = torch.randn(5, vocab, generator=gen)
    for trial in range(3):
        random.Random(trial).shuffle(order)
        shuffled = torch.cat([logits[order], filler])
        extra = [row(settings[(j + trial) % len(settings)], seed=j) for j in range(5)]
        out = sampler(shuffled, [rows[i] for i in order] + extra)
        assert out.token_ids[: len(rows)] == [alone[i] for i in order]
    # The noise is keyed: another seed or position gives other tokens.
    same_logits = logits[1:2].expand(64, vocab)
    by_seed = sampler(same_logits, [row(RANDOM, seed=s, position=5) for s in range(64)])
    by_pos = sampler(same_logits, [row(RANDOM, seed=5, position=p) for p in range(64)])
    assert len(set(by_seed.token_ids)) > 32 and len(set(by_pos.token_ids)) > 32


def test_logprobs_are_raw_log_softmax() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 500, generator=gen) * 2
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=5)),
        row(
            SamplingParams(temperature=0.8, top_k=40, logprobs=3, repetition_penalty=1.5),
            seed=9,
            position=4,
            prompt=[1, 2, 3],
            output=[4],
        ),
        row(SamplingParams(temperature=1.0)),  # did not ask
        row(
            SamplingParams(temperature=1.5, logprobs=0, presence_penalty=2.0),
            seed=2,
            output=list(range(100)),
        ),
    ]
    out = Sampler()(logits, rows)
    lp = logits.log_softmax(dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        info = out.logprobs[i]
        assert info is not None
        tok = out.token_ids[i]
        assert info.token_id == tok
        assert info.logprob == pytest.approx(lp[i, tok].item(), abs=1e-6)
        assert info.rank == int((lp[i] > lp[i, tok]).sum()) + 1
        n = rows[i].params.logprobs
        top = lp[i].topk(n) if n else None
        assert len(info.top) == n
        if top is not None:
            assert [t for t, _ in info.top] == top.indices.tolist()
            assert [v for _, v in info.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.logprobs[0] is not None and out.logprobs[0].rank == 1


def expected_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """softmax(logits / T) after top-k, top-p and min-p, in float64."""
    x = logits / p.temperature
    keep = np.ones_like(x, dtype=bool)
    if p.top_k > 0:
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        keep &= x >= x[order][(before < p.top_p).sum() - 1]
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


STAT_LOGITS = np.array([1.6, 0.2, -0.4, 2.3, 0.9, -1.2, 0.5, 1.1, -0.1, 1.9, 0.0, -2.0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.5, top_k=8, top_p=0.9, min_p=0.05),
    ],
    ids=["T1", "T0.7", "top_k5", "top_p0.8", "min_p0.1", "combined"],
)
def test_sampled_distribution_matches_softmax(params: SamplingParams) -> None:
    # 40,000 draws keyed by (seed, position); a chi-square test over the kept tokens.
    vocab = len(STAT_LOGITS)
    want = expected_distribution(STAT_LOGITS, params)
    assert (want > 0).sum() >= 3  # each setting keeps several tokens
    rows = [row(params, seed=s * 7919 - 50, position=p) for s in range(200) for p in range(200)]
    logits = torch.tensor(STAT_LOGITS, dtype=torch.float32).expand(len(rows), vocab)
    counts = np.bincount(Sampler()(logits, rows).token_ids, minlength=vocab)
    kept_ids = want > 0
    assert counts[~kept_ids].sum() == 0  # filtered tokens are never drawn
    expected = want[kept_ids] * len(rows)
    assert expected.min() >= 5  # chi-square validity
    stat = float((((counts[kept_ids] - expected) ** 2) / expected).sum())
    assert stat < chi2_critical(int(kept_ids.sum()) - 1), (stat, counts, expected)


def test_sampled_distribution_large_vocab() -> None:
    # A wider vocab with a long tail, through top-p's fast path: the likely tokens binned one
    # by one, the kept tail lumped into one bin.
    gen = torch.Generator().manual_seed(6)
    vocab = 2048
    logits = torch.randn(vocab, generator=gen) * 1.5
    logits[:12] += torch.linspace(7.0, 4.0, 12)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    rows = [row(params, seed=s, position=p) for s in range(40) for p in range(100)]
    tokens = torch.tensor(Sampler()(logits.expand(len(rows), vocab), rows).token_ids)
    want = torch.tensor(expected_distribution(logits.double().numpy(), params))
    assert 50 < int((want > 0).sum()) < vocab  # top-p cut a long tail
    assert not bool(torch.isin(tokens, (want == 0).nonzero()[:, 0]).any())
    single = (want * len(rows) >= 20).nonzero()[:, 0]  # [B]
    bin_of = torch.full((vocab,), len(single), dtype=torch.int64)
    bin_of[single] = torch.arange(len(single))
    counts = torch.bincount(bin_of[tokens], minlength=len(single) + 1).double()
    expected = torch.zeros(len(single) + 1, dtype=torch.float64)
    expected.index_add_(0, bin_of, want * len(rows))
    assert len(single) >= 8 and expected[-1] >= 20
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < chi2_critical(len(single))


def test_input_is_not_modified() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 100, generator=gen)
    before = logits.clone()
    rows = [
        row(SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1), seed=1, banned=[1]),
        row(SamplingParams(temperature=2.0, repetition_penalty=2.0), output=[1, 2], banned=[3]),
        row(SamplingParams(temperature=0.3, frequency_penalty=1.0), output=[1, 2]),
    ]
    Sampler()(logits, rows)
    Sampler()(logits[:1], rows[:1])
    assert torch.equal(logits, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(8)
    vocab = 151_936
    logits = torch.randn(16, vocab, generator=gen) * 3
    settings = [
        GREEDY,
        RANDOM,
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=40, min_p=0.05, repetition_penalty=1.2),
    ]
    rows = [
        row(settings[i % 4], seed=i * 31, position=i, prompt=[1, 2], output=[3, i], banned=[7])
        for i in range(16)
    ]
    cpu = Sampler()(logits, rows).token_ids
    gpu = Sampler()(logits.cuda(), rows).token_ids
    # log/log1p may differ by an ulp between devices: only a near-tie could flip a token.
    assert sum(a != b for a, b in zip(cpu, gpu, strict=True)) <= 1
