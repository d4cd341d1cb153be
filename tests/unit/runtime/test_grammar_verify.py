"""Verification under a grammar: every row masked with the grammar advanced along the drafts,
sampled drafts drawn without the grammar and cut where it forbids one, and the tokens keep the
masked target's distribution exactly (a chi-square test over seeds)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import torch

from libkk.runtime.io import ScheduledRequest
from libkk.runtime.verify import verify
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import Sampler, SamplingRow
from libkk.spec_decode.logits import process_logits

_spec = importlib.util.spec_from_file_location(
    "chi2", Path(__file__).resolve().parents[1] / "sample" / "chi2.py"
)
chi2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chi2)

VOCAB = 12
POSITION = 10
ALLOWED_0 = [1, 2, 3, 5, 8, 9, 10]  # the grammar's first mask


def _mask(allowed: list[int]) -> torch.Tensor:
    word = sum(1 << t for t in set(allowed))
    return torch.tensor([word], dtype=torch.int32)  # VOCAB <= 31: one word, no sign bit


def _allowed_after(token: int) -> list[int]:
    """The grammar's mask after one token (depends on it)."""
    return [token, (token + 1) % VOCAB, (token + 3) % VOCAB, 0, 11]


def _row(params, seed, position, output, allowed) -> SamplingRow:
    return SamplingRow(params, seed, position, [1, 2, 3], list(output), (), _mask(allowed))


def _probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    return process_logits(logits[None], [row]).softmax(dim=-1)[0].double()  # [V]


def test_sampled_drafts_cut_by_the_grammar_keep_the_masked_target_distribution():
    """A sampled draft d0 ~ q (the drafter's processed distribution, no grammar) is verified when
    the grammar allows it, with q restricted to the allowed tokens and the bonus row masked with
    the grammar after d0; else the plain sampler draws with the mask. (t0, t1) must follow
    p0(t0) * p1(t1 | t0) of the masked target; both paths must run."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.3, top_k=7)
    target = torch.randn(2, VOCAB, generator=g) * 1.5  # [1 + n, V] raw
    draft = torch.randn(VOCAB, generator=g)
    draft[[4, 6]] += 2.0  # the drafter likes tokens the grammar forbids
    q = _probs(draft, _row(params, 0, POSITION, [], list(range(VOCAB))))  # no grammar
    sampler = Sampler()
    num_seeds = 6000

    drafted, plain = [], []
    for seed in range(num_seeds):
        d0 = int(torch.multinomial(q.float(), 1, generator=g))
        (drafted if d0 in ALLOWED_0 else plain).append((seed, d0))
    reqs = [
        ScheduledRequest(
            request_id=f"r{seed}",
            token_ids=[7, d0],
            num_computed_tokens=POSITION - 1,
            block_tables=[[1]],
            sampling=_row(params, seed, POSITION, [7], ALLOWED_0),
            spec_token_ids=[d0],
            draft_logits=draft[None],
            draft_grammar_masks=_mask(_allowed_after(d0))[None],
        )
        for seed, d0 in drafted
    ]
    results = [tokens for tokens, _ in verify([target] * len(reqs), reqs).to_host()]
    firsts = [(seed, tokens) for (seed, _), tokens in zip(drafted, results, strict=True)]
    for seed, _ in plain:
        row = _row(params, seed, POSITION, [7], ALLOWED_0)
        firsts.append((seed, sampler(target[:1], [row]).token_ids))
    accepted = sum(len(tokens) == 2 for _, tokens in firsts)
    assert 0.2 * num_seeds < len(plain) < 0.8 * num_seeds  # drafts were cut
    assert 0 < accepted < len(drafted)  # accepted and rejected drafts

    pairs = Counter()
    for seed, tokens in firsts:
        t0 = tokens[0]
        assert t0 in ALLOWED_0
        if len(tokens) == 2:
            t1 = tokens[1]
        else:  # the next step: the plain sampler with the grammar after t0
            row = _row(params, seed, POSITION + 1, [7, t0], _allowed_after(t0))
            t1 = sampler(target[1:], [row]).token_ids[0]
        assert t1 in _allowed_after(t0)
        pairs[(t0, t1)] += 1

    p0 = _probs(target[0], _row(params, 0, POSITION, [7], ALLOWED_0))
    expected = {}
    for t0 in range(VOCAB):
        if p0[t0] == 0:
            continue
        p1 = _probs(target[1], _row(params, 0, POSITION + 1, [7, t0], _allowed_after(t0)))
        for t1 in range(VOCAB):
            if p1[t1] > 0:
                expected[(t0, t1)] = float(p0[t0] * p1[t1]) * num_seeds
    assert set(pairs) <= set(expected)
    # Cells expected fewer than 5 times are pooled into one.
    small = [c for c, e in expected.items() if e < 5]
    cells = [([c], e) for c, e in expected.items() if e >= 5]
    cells.append((small, sum(expected[c] for c in small)))
    stat = sum((sum(pairs[c] for c in cs) - e) ** 2 / e for cs, e in cells if e > 0)
    assert stat < chi2.chi2_critical(len(cells) - 1), stat


def test_greedy_verification_follows_the_masked_argmax():
    """Greedy rows: the accepted drafts and the final token are the argmax of each row under the
    grammar advanced along the drafts; a draft the mask forbids at its row is never accepted."""
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0)
    logits = torch.randn(4, VOCAB, generator=g)  # [1 + 3, V]
    allowed = [ALLOWED_0, [0, 4, 7, 11], [2, 3, 6], [1, 5, 9]]
    want = [max(a, key=lambda t: float(logits[k, t])) for k, a in enumerate(allowed)]
    masks = torch.stack([_mask(a) for a in allowed[1:]])  # [3, 1]
    for drafts, n_acc in (
        (want[:3], 3),
        ([want[0], want[1], 8], 2),
        ([3 if want[0] != 3 else 1, 0, 0], 0),
    ):
        req = ScheduledRequest(
            request_id="r",
            token_ids=[7, *drafts],
            num_computed_tokens=POSITION - 1,
            block_tables=[[1]],
            sampling=_row(params, 0, POSITION, [7], allowed[0]),
            spec_token_ids=list(drafts),
            draft_grammar_masks=masks,
        )
        [(tokens, _)] = verify([logits], [req]).to_host()
        assert tokens == want[: n_acc + 1], (drafts, tokens)
