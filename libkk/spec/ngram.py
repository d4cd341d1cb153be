"""Prompt/output lookup drafting: no weights, one-hot drafts.

The longest suffix of the request's tokens (between prompt_lookup_min and prompt_lookup_max tokens)
that also occurs earlier in them is matched; the tokens that followed its latest earlier occurrence
are the drafts. Repetitive text (code edits, quoting, lists) drafts well; anything else drafts
nothing and costs nothing.
"""

from __future__ import annotations

import numpy as np

from libkk.spec.base import DraftProposal, Proposer, ProposeRequest


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """Drafts for `token_ids`: the tokens after the latest earlier occurrence of its longest
    matching suffix of length in [min_n, max_n] (an empty list if none matches)."""
    num = len(token_ids)
    if max_drafts <= 0 or num < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        # Windows starting at i < num - n (an earlier occurrence, followed by at least one token).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: num - 1], n)  # [num - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + max_drafts]
    return []


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                f"({prompt_lookup_max})"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[ProposeRequest]) -> DraftProposal:
        drafts = [ngram_lookup(r.token_ids, self.min_n, self.max_n, r.max_drafts) for r in requests]
        return DraftProposal(token_ids=drafts, draft_logits=[None] * len(requests))
