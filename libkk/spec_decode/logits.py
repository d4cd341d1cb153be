"""The per-position sampling rows of a verification, and the logit processing both sides share.

Verification scores drafts d_0 .. d_{n-1} at positions pos .. pos + n - 1 and a bonus at pos + n.
Row k must be processed exactly as the plain sampler would process it had d_0 .. d_{k-1} already
been accepted: penalties count them as output tokens, min_tokens bans lift once enough output
exists, and the keyed noise uses position pos + k. Model drafters sample d_k from the same processing
of their own logits, so q in the rejection test is the distribution the draft was really drawn from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec
import torch
from torch import Tensor

from libkk.sample.gumbel import DRAFT_POSITION_SALT
from libkk.sample.sampler import (
    SamplingRow,
    apply_filters,
    apply_grammar_masks,
    apply_penalties,
)


def position_rows(
    row: SamplingRow,
    drafts: Sequence[int],
    num_rows: int,
    grammar_masks: Tensor | None = None,
) -> list[SamplingRow]:
    """Rows for positions row.position + k, k < num_rows, as if drafts[:k] were accepted.

    `row` is the row of the first draft position (its output tokens end with the anchor).
    grammar_masks: [>= num_rows - 1, W], row k - 1 the grammar mask of row k (structured output;
    row 0's is row.grammar_mask); None: rows after the first are unconstrained.
    """
    if num_rows > len(drafts) + 1:
        raise ValueError(f"{num_rows} rows need at least {num_rows - 1} drafts, got {len(drafts)}")
    rows = [row]
    min_tokens = row.params.min_tokens
    num_output = len(row.output_token_ids)
    for k in range(1, num_rows):
        banned = row.banned_token_ids if num_output + k < min_tokens else ()
        rows.append(
            SamplingRow(
                params=row.params,
                seed=row.seed,
                position=row.position + k,
                prompt_token_ids=row.prompt_token_ids,
                output_token_ids=[*row.output_token_ids, *drafts[:k]],
                banned_token_ids=banned,
                grammar_mask=None if grammar_masks is None else grammar_masks[k - 1],
            )
        )
    return rows


def process_logits(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """The logits each row samples from.  # [R, V] fp32, a new tensor

    Every row: the tokens its grammar disallows (structured output), banned ids and penalties, in
    the sampler's order. Random rows then: temperature, top-k, top-p, min-p (the softmax of the
    result is the sampling distribution; dropped tokens are -inf). Greedy rows keep their
    penalized logits (their argmax is the token).
    """
    x = logits.float().clone()  # [R, V]
    constrained = [i for i, r in enumerate(rows) if r.grammar_mask is not None]
    if constrained:
        apply_grammar_masks(x, rows, constrained)
    x = apply_penalties(x, rows, inplace=True)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(random_rows) == len(rows):
        apply_filters(x, [r.params for r in rows])
    elif random_rows:
        idx = torch.tensor(random_rows, device=x.device)
        x[idx] = apply_filters(x[idx], [rows[i].params for i in random_rows])
    return x


def draft_sampling_rows(rows: Sequence[SamplingRow], sampled: Sequence[bool]) -> list[SamplingRow]:
    """The rows the sampler draws drafts with: a sampled draft on the draft stream (position +
    DRAFT_POSITION_SALT: it never shares noise with the target's token), any other the argmax of
    its processed logits (a greedy row: temperature and filters keep the argmax); no logprobs."""
    out = []
    for row, sample in zip(rows, sampled, strict=True):
        if sample:
            params = msgspec.structs.replace(row.params, logprobs=None)
            position = row.position + DRAFT_POSITION_SALT
        else:
            params = msgspec.structs.replace(row.params, temperature=0.0, logprobs=None)
            position = row.position
        out.append(dataclasses.replace(row, params=params, position=position))
    return out
