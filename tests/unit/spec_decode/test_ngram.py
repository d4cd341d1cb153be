"""Prompt/output lookup drafting."""

from __future__ import annotations

import random

import pytest

from libkk.sample.params import SamplingParams
from libkk.sample.sampler import SamplingRow
from libkk.spec_decode.base import ProposeRequest
from libkk.spec_decode.ngram import NgramProposer, ngram_lookup


def _brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_longest_suffix_latest_occurrence():
    # Suffix [1, 2, 3] occurs at 0; the longer match wins over the later [3] at 5.
    assert ngram_lookup([1, 2, 3, 9, 8, 3, 7, 1, 2, 3], 1, 3, 4) == [9, 8, 3, 7]
    # Only [3] matches: its latest earlier occurrence (index 5) is used.
    assert ngram_lookup([1, 2, 3, 9, 8, 3, 7, 5, 3], 1, 3, 2) == [7, 5]
    # Drafts stop at the end of the tokens and at max_drafts.
    assert ngram_lookup([4, 5, 4], 1, 2, 5) == [5, 4]
    assert ngram_lookup([4, 5, 4, 5], 1, 2, 1) == [4]


def test_no_match_and_min_length():
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 4) == []
    assert ngram_lookup([7], 1, 3, 4) == []
    # [2, 3] would match, but min_n = 3 demands a three-token suffix.
    assert ngram_lookup([2, 3, 5, 2, 3], 3, 4, 4) == []
    assert ngram_lookup([2, 3, 5, 2, 3], 2, 4, 4) == [5, 2, 3]
    assert ngram_lookup([1, 1, 1], 1, 3, 0) == []


def test_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 6)
        assert ngram_lookup(tokens, lo, hi, k) == _brute(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_proposer_one_hot_drafts_per_request():
    row = SamplingRow(
        params=SamplingParams(), seed=0, position=5, prompt_token_ids=[], output_token_ids=[]
    )
    proposer = NgramProposer(1, 3)
    out = proposer.propose(
        [
            ProposeRequest("a", [1, 2, 3, 1, 2], row, max_drafts=2),
            ProposeRequest("b", [9, 8, 7], row, max_drafts=4),
        ]
    )
    assert out.token_ids == [[3, 1], []]
    assert out.draft_logits == [None, None]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
