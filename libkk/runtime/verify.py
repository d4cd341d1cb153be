"""Verification of drafts: the target's 1 + n rows per request -> accepted drafts + one token.

Each row k is processed as the plain sampler would process it had d_0 .. d_{k-1} been accepted
(libkk/spec/logits.py: penalties, bans, temperature, top-k/top-p/min-p), so random rows pass
temperature 1 to `rejection_sample` with the processed logits, and greedy rows temperature 0 with
their penalized logits. q comes from the raw draft logits through the same processing.

`synthetic` (benchmarks only) accepts draft k with a configured probability, keyed like the exact
test's uniform; the token after the accepted run is then the target's own sample at that row.
Outputs differ from the target's under it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from libkk.runtime.io import ScheduledRequest
from libkk.sample.gumbel import gumbel_argmax, keyed_uniform_at
from libkk.sample.rejection import ACCEPT_POSITION_SALT, rejection_sample
from libkk.sample.sampler import SamplingRow, TokenLogprobs, _logprobs
from libkk.spec.logits import position_rows, process_logits


def verify(
    logits: Sequence[Tensor],  # per request [1 + n, vocab] raw target logits
    requests: Sequence[ScheduledRequest],
    *,
    synthetic_rates: Sequence[float] | None = None,
) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
    """Per request: the accepted drafts then one target token, with their logprobs (None where
    the request asked for none)."""
    device = logits[0].device
    k = max(r.num_spec_tokens for r in requests)
    vocab = logits[0].shape[-1]
    rows: list[list[SamplingRow]] = []
    for r in requests:
        assert r.sampling is not None
        rows.append(position_rows(r.sampling, r.spec_token_ids, r.num_spec_tokens + 1))
    flat_rows = [row for per in rows for row in per]
    processed = process_logits(torch.cat(list(logits)), flat_rows)  # [sum(1 + n), V]

    # Request i's row j (j <= its n drafts) sits at processed[offset_i + j]; rows past n repeat
    # its last row (masked off by num_draft). One gather, no per-request copies.
    index, drafts_l, offset = [], [], 0
    for r in requests:
        n = r.num_spec_tokens
        index.append([offset + min(j, n) for j in range(k + 1)])
        drafts_l.append([*r.spec_token_ids[:n], *([0] * (k - n))])
        offset += n + 1
    target = processed[torch.tensor(index, device=device)]  # [R, K+1, V]
    drafts = torch.tensor(drafts_l, dtype=torch.int64)
    num_draft = torch.tensor([r.num_spec_tokens for r in requests], dtype=torch.int64)
    drafts, num_draft = drafts.to(device), num_draft.to(device)
    greedy = [r.sampling.params.greedy for r in requests]  # type: ignore[union-attr]
    temperatures = torch.tensor([0.0 if g else 1.0 for g in greedy], device=device)
    seeds = torch.tensor([r.sampling.seed for r in requests], dtype=torch.int64, device=device)  # type: ignore[union-attr]
    positions = torch.tensor(
        [r.sampling.position for r in requests],  # type: ignore[union-attr]
        dtype=torch.int64,
        device=device,
    )

    if synthetic_rates is not None:
        out, num_accepted = _synthetic(
            target, drafts, num_draft, greedy, seeds, positions, synthetic_rates
        )
    elif all(greedy):
        # NOTE: rejection_sample's greedy result without the keyed noise it would draw for
        # random rows (a full-vocabulary hash per row).
        out, num_accepted = _greedy(target, drafts, num_draft)
    else:
        out, num_accepted = rejection_sample(
            target,
            drafts,
            _draft_probs(requests, rows, drafts, k, vocab, device),
            temperatures,
            seeds,
            positions,
            num_draft,
        )

    results: list[tuple[list[int], list[TokenLogprobs | None]]] = []
    accepted = num_accepted.tolist()
    out_l = out.tolist()
    for i, r in enumerate(requests):
        tokens = out_l[i][: accepted[i] + 1]
        lps: list[TokenLogprobs | None] = [None] * len(tokens)
        if r.sampling.params.logprobs is not None:  # type: ignore[union-attr]
            lps = _logprobs(
                logits[i][: len(tokens)],
                torch.tensor(tokens, dtype=torch.int64, device=device),
                rows[i][: len(tokens)],
            )
        results.append((tokens, lps))
    return results


def _draft_probs(
    requests: Sequence[ScheduledRequest],
    rows: list[list[SamplingRow]],
    drafts: Tensor,  # [R, K]
    k: int,
    vocab: int,
    device: torch.device,
) -> Tensor | None:
    """q [R, K, V] from the raw draft logits (one-hot rows for requests without), or None when
    every request's drafts are one-hot."""
    if all(r.draft_logits is None for r in requests):
        return None
    q = torch.zeros(len(requests), k, vocab, dtype=torch.float32, device=device)
    for i, r in enumerate(requests):
        n = r.num_spec_tokens
        if n == 0:
            continue
        if r.draft_logits is None:
            q[i, :n].scatter_(1, drafts[i, :n, None], 1.0)
            continue
        raw = r.draft_logits[:n].to(device)  # [n, V]
        q[i, :n] = process_logits(raw, rows[i][:n]).softmax(dim=-1)
    return q


def _greedy(target: Tensor, drafts: Tensor, num_draft: Tensor) -> tuple[Tensor, Tensor]:
    """Accept drafts while they equal the target's argmax; then the argmax.  # [R, K+1], [R]"""
    num_rows, k1, _ = target.shape
    k = k1 - 1
    steps = torch.arange(k, device=target.device)
    argmax = target.argmax(dim=-1)  # [R, K+1]; ties to the lowest id
    accept = (argmax[:, :k] == drafts) & (steps[None, :] < num_draft[:, None])  # [R, K]
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [R]
    out = torch.where(steps[None, :] < num_accepted[:, None], drafts, -1)
    out = torch.cat([out, torch.full_like(out[:, :1], -1)], dim=1)  # [R, K+1]
    rows = torch.arange(num_rows, device=target.device)
    out[rows, num_accepted] = argmax[rows, num_accepted]
    return out, num_accepted


def _synthetic(
    target: Tensor,  # [R, K+1, V] processed
    drafts: Tensor,  # [R, K]
    num_draft: Tensor,  # [R]
    greedy: list[bool],
    seeds: Tensor,
    positions: Tensor,
    rates: Sequence[float],
) -> tuple[Tensor, Tensor]:
    num_rows, k1, _ = target.shape
    k = k1 - 1
    device = target.device
    steps = torch.arange(k, device=device)
    per_pos = [rates[min(j, len(rates) - 1)] for j in range(k)]
    rate = torch.tensor(per_pos, dtype=torch.float32, device=device)  # [K]
    u = keyed_uniform_at(
        seeds.repeat_interleave(k),
        (positions[:, None] + steps[None, :] + ACCEPT_POSITION_SALT).reshape(-1),
        drafts.reshape(-1),
    ).view(num_rows, k)
    accept = (u < rate[None, :]) & (steps[None, :] < num_draft[:, None])  # [R, K]
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [R]
    rows = torch.arange(num_rows, device=device)
    final_logits = target[rows, num_accepted]  # [R, V]
    final = final_logits.argmax(dim=-1)
    random_rows = [i for i, g in enumerate(greedy) if not g]
    if random_rows:  # keyed noise only where a row samples
        idx = torch.tensor(random_rows, device=device)
        final[idx] = gumbel_argmax(final_logits[idx], seeds[idx], (positions + num_accepted)[idx])
    out = torch.full((num_rows, k1), -1, dtype=torch.int64, device=device)
    out[:, :k] = torch.where(steps[None, :] < num_accepted[:, None], drafts, -1)
    out[rows, num_accepted] = final
    return out, num_accepted
