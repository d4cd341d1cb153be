"""Verification of drafts: the target's 1 + n rows per request -> accepted drafts + one token.

Each row k is processed as the plain sampler would process it had d_0 .. d_{k-1} been accepted
(libkk/spec_decode/logits.py: grammar mask, penalties, bans, temperature, top-k/top-p/min-p), so
random rows pass temperature 1 to `rejection_sample` with the processed logits, and greedy rows
temperature 0 with their penalized logits. q comes from the raw draft logits through the same
processing; under a grammar, q is masked after it (drafters draw without the grammar, and the
engine cuts the drafts at the first one it forbids: a verified draft's law is q restricted to the
allowed tokens). Row k's mask is the grammar's after d_0 .. d_{k-1}
(`ScheduledRequest.draft_grammar_masks`).

`verify_from_shards` is the same verification from this rank's vocab shard of the target logits
under tensor parallelism (libkk/spec_decode/vocab_parallel.py), for steps whose rows need no processing
beyond a temperature and no logprobs (`shards_cover`); every rank calls it in step.

`synthetic` (benchmarks only) accepts draft k with a configured probability, keyed like the exact
test's uniform; the token after the accepted run is then the target's own sample at that row.
Outputs differ from the target's under it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from libkk.layers.embedding import merge_shard_argmax, shard_argmax_stats
from libkk.runtime.input_batch import host_to_device
from libkk.runtime.io import ScheduledRequest, token_rows
from libkk.sample.gumbel import gumbel_argmax
from libkk.sample.rejection import (
    acceptance_uniforms,
    accepted_output,
    accepted_prefix,
    rejection_sample,
)
from libkk.sample.sampler import (
    LogprobTensors,
    SamplingRow,
    TokenLogprobs,
    apply_grammar_masks,
    logprob_tensors,
)
from libkk.spec_decode.logits import position_rows, process_logits
from libkk.spec_decode.vocab_parallel import (
    Gather,
    ShardDrafts,
    row_covered,
    vocab_parallel_rejection_sample,
)


def verify(
    logits: Sequence[Tensor],  # per request [1 + n, vocab] raw target logits
    requests: Sequence[ScheduledRequest],
    *,
    synthetic_rates: Sequence[float] | None = None,
) -> VerifiedTokens:
    """Per request: the accepted drafts then one target token, with their logprobs where the
    request asks for them; nothing is read back from the device."""
    device = logits[0].device
    k = max(r.num_spec_tokens for r in requests)
    vocab = logits[0].shape[-1]
    rows: list[list[SamplingRow]] = []
    for r in requests:
        assert r.sampling is not None
    greedy = [r.sampling.params.greedy for r in requests]  # type: ignore[union-attr]
    if all(r.sampling.takes_raw_argmax() for r in requests):  # type: ignore[union-attr]
        # Only the argmax of each row is read and processing keeps it (bans and penalties never
        # grow over a request's positions): no per-position rows.
        processed = _concat_rows(logits)  # [sum(1 + n), V]
    else:
        for r in requests:
            rows.append(
                position_rows(
                    r.sampling,  # type: ignore[arg-type]
                    r.spec_token_ids,
                    r.num_spec_tokens + 1,
                    r.draft_grammar_masks,
                )
            )
        flat_rows = [row for per in rows for row in per]
        processed = process_logits(_concat_rows(logits), flat_rows)  # [sum(1 + n), V]

    # temperature 1 for sampled rows (process_logits has applied theirs), 0 for greedy ones
    index, drafts, num_draft, seeds, positions, temperatures = _step_inputs(
        requests, k, device, [0.0 if g else 1.0 for g in greedy]
    )

    # NOTE: greedy and synthetic verification read one argmax per row, or one row per request:
    # no [R, K+1, V] copy of the rows by `index` (~150 MB a step at batch 32 with K = 7).
    if synthetic_rates is not None:
        out, _ = _synthetic(
            processed, index, drafts, num_draft, greedy, seeds, positions, synthetic_rates
        )
    elif all(greedy):
        # NOTE: rejection_sample's greedy result without the keyed noise it would draw for
        # random rows (a full-vocabulary hash per row).
        out, _ = _accept_argmax(processed.argmax(dim=-1)[index], drafts, num_draft)
    else:
        out, _ = rejection_sample(
            processed[index],  # [R, K+1, V]
            drafts,
            _draft_probs(requests, rows, drafts, k, vocab, device),
            temperatures.float(),
            seeds,
            positions,
            num_draft,
            check_ranges=False,  # built here: num_draft <= K, temperatures 0 or 1
        )

    return VerifiedTokens(out, _verify_logprobs(logits, out, requests, rows))


@dataclass
class VerifiedTokens:
    """Verification's result, on the device: per request its accepted drafts then one target
    token, -1 after them."""

    tokens: Tensor  # [R, K+1] int64
    # Logprobs of the R * (K+1) token slots, row-major (None when no request asked).
    logprobs: LogprobTensors | None = None

    def to_host(self) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """Per request: its tokens and their logprobs (None where it asked for none)."""
        return token_rows(self.tokens, self.logprobs)


def _verify_logprobs(
    logits: Sequence[Tensor],
    out: Tensor,  # [R, K+1]
    requests: Sequence[ScheduledRequest],
    rows: list[list[SamplingRow]],
) -> LogprobTensors | None:
    """Logprobs of the raw target logits at every row of the requests that ask for them, of the
    token in each slot (slots past a request's tokens hold -1: their entries are never read)."""
    width = out.shape[1]
    slots: list[int] = []
    parts: list[Tensor] = []
    slot_rows: list[SamplingRow] = []
    for i, r in enumerate(requests):
        if r.sampling.params.logprobs is None:  # type: ignore[union-attr]
            continue
        n = r.num_spec_tokens + 1
        parts.append(logits[i][:n])
        slot_rows.extend(rows[i][:n])
        slots.extend(range(i * width, i * width + n))
    if not slots:
        return None
    index = host_to_device(torch.tensor(slots, dtype=torch.int64), out.device)
    lp = logprob_tensors(torch.cat(parts), out.reshape(-1)[index], slot_rows)
    assert lp is not None
    return dataclasses.replace(lp, rows=[slots[j] for j in lp.rows])


def _step_inputs(
    requests: Sequence[ScheduledRequest],
    k: int,
    device: torch.device,
    temperatures: Sequence[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """On the device, in one copy: the row index [R, K+1] into the step's concatenated target
    rows (request i's row j <= n_i at offset_i + j; rows past n_i repeat its last row, masked
    off by num_draft), the drafts [R, K] (0-padded), num_draft [R], seeds [R], positions [R],
    and `temperatures` [R] (a float64 view of the copy: no kernel until a sampled path converts)."""
    num = len(requests)
    n = np.fromiter((r.num_spec_tokens for r in requests), np.int64, num)
    # [index K+1 | drafts K | n | seed | position | temperature]
    host = np.zeros((num, 2 * k + 5), np.int64)
    offsets = np.zeros(num, np.int64)
    np.cumsum(n[:-1] + 1, out=offsets[1:])
    host[:, : k + 1] = offsets[:, None] + np.minimum(np.arange(k + 1)[None, :], n[:, None])
    for i, r in enumerate(requests):
        host[i, k + 1 : k + 1 + n[i]] = r.spec_token_ids
    host[:, 2 * k + 1] = n
    host[:, 2 * k + 2] = [r.sampling.seed for r in requests]  # type: ignore[union-attr]
    host[:, 2 * k + 3] = [r.sampling.position for r in requests]  # type: ignore[union-attr]
    host[:, 2 * k + 4] = np.asarray(temperatures, np.float64).view(np.int64)
    packed = host_to_device(torch.from_numpy(host), device)
    return (packed[:, : k + 1], packed[:, k + 1 : 2 * k + 1], packed[:, 2 * k + 1],
            packed[:, 2 * k + 2], packed[:, 2 * k + 3],
            packed[:, 2 * k + 4].view(torch.float64))  # fmt: skip


def shards_cover(requests: Sequence[ScheduledRequest], vocab_size: int) -> bool:
    """Whether `verify_from_shards` gives these requests' tokens: rows processed by at most a
    temperature, no logprobs asked, q one-hot or kept in shards (no whole draft logits)."""
    for r in requests:
        row = r.sampling
        if row is None or row.params.logprobs is not None or r.draft_logits is not None:
            return False
        if not row_covered(row, vocab_size):
            return False
    return True


def verify_from_shards(
    logits: Sequence[Tensor],  # per request [1 + n, Vs] raw target logits of this rank's shard
    requests: Sequence[ScheduledRequest],
    vocab_start: int,
    shard_drafts: Mapping[str, ShardDrafts],
    gather: Gather,
) -> VerifiedTokens:
    """`verify` from vocab shards (requests must pass `shards_cover`): per request the accepted
    drafts then one target token, no logprobs. q of a request's drafts is its entry in
    `shard_drafts` (this rank's shard of sampled drafts), one-hot where it has none."""
    device = logits[0].device
    size = logits[0].shape[-1]
    k = max(r.num_spec_tokens for r in requests)
    rows = [r.sampling for r in requests]
    temps = [row.params.temperature for row in rows]  # type: ignore[union-attr]
    index, drafts, num_draft, seeds, positions, temperatures = _step_inputs(
        requests, k, device, temps
    )
    shard = _concat_rows(logits)  # [sum(1 + n), Vs]

    if all(row.params.greedy for row in rows):  # type: ignore[union-attr]
        # The argmax alone: one [rows, 2] gather of each shard's (max, token), no keyed noise.
        stats = shard_argmax_stats(shard, vocab_start)[index.reshape(-1)]  # [R * (K+1), 2]
        argmax = merge_shard_argmax(gather([stats])).view(len(requests), k + 1)
        out, num_accepted = _accept_argmax(argmax, drafts, num_draft)
        return _accepted_tokens(out, num_accepted)

    stored = [shard_drafts.get(r.request_id) for r in requests]
    draft_shards = draft_logprobs = draft_lse = None
    if any(s is not None for s in stored):
        # Sampled drafts: q from the kept shard; one-hot drafts: log q = 0 at the draft token
        # (where this shard holds it), -inf elsewhere; padded slots: -inf everywhere.
        draft_shards = torch.full((len(requests), k, size), -math.inf, device=device)
        draft_logprobs = torch.zeros(len(requests), k, device=device)
        draft_lse = torch.zeros(len(requests), k, device=device)
        for i, (r, s) in enumerate(zip(requests, stored, strict=True)):
            n = r.num_spec_tokens
            if s is None:
                continue
            s.check_drafts(r.request_id, r.spec_token_ids)
            draft_shards[i, :n] = s.logits[:n]
            draft_logprobs[i, :n] = s.logprobs[:n]
            draft_lse[i, :n] = s.lse[:n]
        one_hot = host_to_device(torch.tensor([s is None for s in stored]), device)
        valid = torch.arange(k, device=device)[None, :] < num_draft[:, None]
        local = drafts - vocab_start
        owned = (local >= 0) & (local < size) & valid & one_hot[:, None]  # [R, K]
        # log q = 0 at owned one-hot drafts, by a scatter that needs no host read of `owned`
        at = local.clamp(0, size - 1)[..., None]  # [R, K, 1]
        kept = draft_shards.gather(2, at)
        draft_shards.scatter_(2, at, torch.where(owned[..., None], 0.0, kept))

    out, num_accepted = vocab_parallel_rejection_sample(
        [shard[index]],  # [R, K+1, Vs]
        None if draft_shards is None else [draft_shards],
        [vocab_start],
        drafts,
        draft_logprobs,
        draft_lse,
        temperatures.float(),
        seeds,
        positions,
        num_draft,
        gather=gather,
        check_ranges=False,  # built here: num_draft <= K, temperatures from validated params
    )
    return _accepted_tokens(out, num_accepted)


def _accepted_tokens(out: Tensor, num_accepted: Tensor) -> VerifiedTokens:
    """Per row: the accepted drafts and the final token of `out` [R, K+1], -1 after them."""
    steps = torch.arange(out.shape[1], device=out.device)
    return VerifiedTokens(torch.where(steps[None, :] <= num_accepted[:, None], out, -1))


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
        draft_rows = rows[i][:n]
        constrained = [j for j, row in enumerate(draft_rows) if row.grammar_mask is not None]
        if not constrained:
            q[i, :n] = process_logits(raw, draft_rows).softmax(dim=-1)
            continue
        # NOTE: drafters draw without the grammar and drafts it forbids were cut, so a verified
        # draft's law is q restricted to the allowed tokens: the grammar masks the processed
        # draft logits (after filters, unlike the target's), then the softmax renormalizes.
        unmasked = [dataclasses.replace(row, grammar_mask=None) for row in draft_rows]
        x = process_logits(raw, unmasked)
        apply_grammar_masks(x, draft_rows, constrained)
        q[i, :n] = x.softmax(dim=-1)
    return q


def _concat_rows(logits: Sequence[Tensor]) -> Tensor:
    """The requests' rows as one [sum(1 + n), V] tensor: a view when they lie back to back in
    one tensor (the step's logits hold no plain rows between them), else a copy."""
    first = logits[0]
    row_bytes = first.stride(0) * first.element_size()
    adjacent = all(
        b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.shape[0] * row_bytes
        and b.stride() == first.stride()
        for a, b in itertools.pairwise(logits)
    )
    if not adjacent or first.stride(-1) != 1:
        return torch.cat(list(logits))
    total = sum(x.shape[0] for x in logits)
    return first.as_strided((total, first.shape[1]), first.stride())


def _accept_argmax(argmax: Tensor, drafts: Tensor, num_draft: Tensor) -> tuple[Tensor, Tensor]:
    """Accept drafts while they equal the target's argmax [R, K+1] (ties to the lowest id);
    then the argmax at the first rejection.  # [R, K+1], [R]"""
    k = argmax.shape[1] - 1
    num_accepted = accepted_prefix(argmax[:, :k] == drafts, num_draft)  # [R]
    rows = torch.arange(argmax.shape[0], device=argmax.device)
    return accepted_output(drafts, num_accepted, argmax[rows, num_accepted]), num_accepted


def _synthetic(
    processed: Tensor,  # [sum(1 + n), V]
    index: Tensor,  # [R, K+1] each request's rows in `processed`
    drafts: Tensor,  # [R, K]
    num_draft: Tensor,  # [R]
    greedy: list[bool],
    seeds: Tensor,
    positions: Tensor,
    rates: Sequence[float],
) -> tuple[Tensor, Tensor]:
    num_rows, k1 = index.shape
    k = k1 - 1
    device = processed.device
    per_pos = [rates[min(j, len(rates) - 1)] for j in range(k)]
    rate = host_to_device(torch.tensor(per_pos, dtype=torch.float32), device)  # [K]
    u = acceptance_uniforms(seeds, positions, drafts)  # [R, K]
    num_accepted = accepted_prefix(u < rate[None, :], num_draft)  # [R]
    rows = torch.arange(num_rows, device=device)
    final_logits = processed[index[rows, num_accepted]]  # [R, V]
    final = final_logits.argmax(dim=-1)
    random_rows = [i for i, g in enumerate(greedy) if not g]
    if random_rows:  # keyed noise only where a row samples
        idx = host_to_device(torch.tensor(random_rows), device)
        final[idx] = gumbel_argmax(final_logits[idx], seeds[idx], (positions + num_accepted)[idx])
    return accepted_output(drafts, num_accepted, final), num_accepted
