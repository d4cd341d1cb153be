"""Prompt/output lookup drafting: no weights, one-hot drafts.

The longest suffix of the request's tokens (between prompt_lookup_min and prompt_lookup_max tokens)
that also occurs earlier in them is matched; the tokens that followed its latest earlier occurrence
are the drafts. Repetitive text (code edits, quoting, lists) drafts well; anything else drafts
nothing and costs nothing.
"""

from __future__ import annotations

import numpy as np

from libkk.spec_decode.base import DraftProposal, Proposer, ProposeRequest


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """Drafts for `token_ids`: the tokens after the latest earlier occurrence of its longest
    matching suffix of length in [min_n, max_n] (an empty list if none matches)."""
    num = len(token_ids)
    if max_drafts <= 0 or num < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Every match ends at an earlier occurrence of the last token: one pass finds those, then the
    # ones still matching are extended backwards a token at a time (not a window compare per
    # suffix length over the whole sequence).
    ends = np.flatnonzero(tokens[: num - 1] == tokens[num - 1])  # ascending
    longest = 1
    for k in range(1, min(max_n, num - 1)):
        reach = ends[ends >= k]  # ends with a token k places before them
        longer = reach[tokens[reach - k] == tokens[num - 1 - k]]
        if longer.size == 0:
            break
        ends, longest = longer, k + 1
    if ends.size == 0 or longest < min_n:
        return []
    start = int(ends[-1]) + 1  # the latest occurrence of the longest match
    return token_ids[start : start + max_drafts]


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
