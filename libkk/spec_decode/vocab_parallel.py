"""Vocab-parallel probabilistic drafting and verification: no [rows, vocab] all-gather.

With a vocab-parallel LM head each rank holds the logits of one contiguous slice of the vocab
(a shard; sizes may differ). The full-vocab path (`sample_draft_full` for drafts, then
`libkk.sample.rejection.rejection_sample`) needs whole rows; this module gives the same tokens
from small per-shard summaries:

Drafting (`vocab_parallel_draft`): each shard takes z = logits / T (raw logits for greedy rows),
adds the keyed Gumbel noise of its own token ids (keyed by the *absolute* id, on the draft
stream, so it is the very noise the full row would get) and reports per row

    (noisy max, its token id, that token's raw logit, row max m_s of z, rest_s)

where the shard's row sum-exp is sum exp(z - m_s) = 1 + rest_s (the max element kept apart, so
that confident rows keep their precision). One gather; the winner is the first shard holding the
global noisy max (shards are in vocab order, so this is argmax's lowest-id tie rule), and the
row's log-sum-exp is gmax + log(sum_s (1 + rest_s) exp(m_s - gmax)), computed as
gmax + log1p(everything but the global max element). log q(d) = z_d - lse, with no softmax over
V, and the estimator's feature logit(q_max) = -log(that rest) comes for free.

Verification (`vocab_parallel_rejection_sample`), two gathers:
1. per shard and position, (max z, rest sum-exp, max raw logit, its id, z of the draft token
   if the shard owns it, and the noisy max of z with the target-stream noise at that position
   and its id): combined into the target's log-sum-exp, log p(d) = z_d - lse, the greedy
   argmax and the plain sampler's draw (a one-hot draft is accepted when it is that draw);
   acceptance then runs on [R, K] values exactly as in rejection_sample.
2. at each row's first rejection j, each shard forms the residual log max(p - q, 0) of its slice
   (q from the draft shard's logits and the draft log-sum-exp) where a drawn draft was rejected,
   or z (a bonus token, a one-hot draft's rejection), and Gumbel-samples it with the
   target-stream noise at position + j; the shard winners are merged the same way. Each shard
   also reports whether its residual is empty and its sample from p, so that the rare "empty
   residual" fallback of the full path needs no third round.

Everything is written against `gather`: a callable taking the list of the per-shard tensors this
process computed and returning them stacked over *all* shards in vocab order, [S, ...]. In one
process (tests) that is `torch.stack`; under tensor parallelism each rank holds one shard and
passes `lambda ts: all_gather_into_stack(ts[0])`.

Exactness. Tokens and noise are computed from the same fp32 values as the full path, so greedy
drafts and verification are bit-identical and random drafts are identical. Log-probabilities come
from a differently ordered sum than torch's softmax, so they may differ in the last ulp; a
decision flips only when it is that close to a tie (probability ~1e-7 per decision).

Not covered (callers fall back to the full-vocab path): top-k / top-p / min-p (they need a global
sort or threshold). Per-token processing (penalties, banned ids) could be applied by each shard to
its slice before calling in; the engine falls back for it instead (`row_covered`).

In the engine (tensor parallelism with `speculative.vocab_parallel_drafting`): every rank's DFlash
proposer drafts from its LM-head shard and keeps that shard of each sampled request's draft
logits (`ShardDrafts`, by request id; the proposal itself carries no logits, so the step rank 0
sends stays small), and every rank's model runner verifies a step's drafts from its target-logit
shard with `gather = tp_gather`. A step with any row not covered is verified on whole rows (the
stored shards gathered back into q), decided alike on every rank from the step rank 0 sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from libkk.distributed import get_tp_state
from libkk.errors import SpeculationInputError
from libkk.sample.gumbel import (
    DRAFT_POSITION_SALT,
    gumbel_argmax,
    keyed_uniform_at,
    uniform_to_gumbel_,
)
from libkk.sample.rejection import (
    accepted_output,
    accepted_prefix,
    check_value_ranges,
    random_accepts,
    random_draft_accepts,
    resampled_rows,
)
from libkk.sample.sampler import SamplingRow
from libkk.spec_decode.estimator import FEATURE_CLAMP, ONE_HOT_FEATURE

Gather = Callable[[list[Tensor]], Tensor]

# Per-shard summary layouts (float64, so fp32 values and int64 token ids travel exactly).
DRAFT_STATS = 5  # noisy max, token id, raw logit of that token, row max of z, rest sum-exp
# row max of z, rest sum-exp, raw max, raw argmax id, z of the draft token, noisy max of z, its id
VERIFY_STATS = 7
FINAL_STATS = 5  # noisy max, token id, max before noise, fallback noisy max, fallback id

_CPU_BLOCK_ELEMS = 1 << 20


def stack_gather(tensors: list[Tensor]) -> Tensor:
    """The gather of one process that holds every shard."""
    return torch.stack(tensors)


def tp_gather(tensors: list[Tensor]) -> Tensor:
    """The gather under tensor parallelism: this rank's one shard in, every rank's out, stacked in
    rank order (which is vocab order) over the tensor-parallel group. A collective."""
    if len(tensors) != 1:
        raise SpeculationInputError(f"tp_gather takes this rank's one shard, got {len(tensors)}")
    state = get_tp_state()
    x = tensors[0].contiguous()
    if state.world_size == 1:
        return x[None]
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    torch.distributed.all_gather(parts, x, group=state.group)
    return torch.stack(parts)


def row_covered(row: SamplingRow, vocab_size: int) -> bool:
    """Whether a row's processing is at most a temperature (no banned id, penalty, top-k, top-p
    or min-p), so that its tokens can come from vocab shards. Later rows of the same request
    (`libkk.spec_decode.logits.position_rows`) then are covered too: they only lift bans."""
    if not row.keeps_raw_argmax():
        return False
    p = row.params
    return p.greedy or not (0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)


@dataclass
class ShardDrafts:
    """One rank's share of a request's sampled drafts, kept for their verification."""

    token_ids: list[int]  # the drafts, in order
    logits: Tensor  # [n, Vs] fp32 raw draft logits of this rank's vocab shard
    logprobs: Tensor  # [n] fp32 log q(draft) (DraftSample.logprobs)
    lse: Tensor  # [n] fp32 the draft's log-sum-exp of logits / T (DraftSample.lse)

    def check_drafts(self, request_id: str, verified: Sequence[int]) -> None:
        """Raises unless these are the drafts being verified (their first len(verified))."""
        if self.token_ids[: len(verified)] != list(verified):
            raise RuntimeError(
                f"request {request_id!r}: the kept draft shard is for drafts "
                f"{self.token_ids}, not the verified {list(verified)}"
            )


def vocab_starts(shard_sizes: Sequence[int]) -> list[int]:
    """First token id of each shard, for contiguous shards of the given sizes in vocab order."""
    starts, total = [], 0
    for size in shard_sizes:
        if size < 1:
            raise SpeculationInputError(f"shard sizes must be >= 1, got {list(shard_sizes)}")
        starts.append(total)
        total += size
    return starts


@dataclass
class DraftSample:
    """One drafted token per row, with what verification needs of q."""

    token_ids: Tensor  # [R] int64
    logprobs: Tensor  # [R] fp32 log q(token) = z_token - lse (at T = 1 for greedy rows)
    lse: Tensor  # [R] fp32 log-sum-exp of z = logits / T (T = 1 for greedy rows)
    features: Tensor  # [R] fp32 logit(max q), the acceptance estimator's feature


# ---------------------------------------------------------------------------------------------
# Full-vocab reference


def sample_draft_full(
    draft_logits: Tensor, temperatures: Tensor, seeds: Tensor, positions: Tensor
) -> Tensor:
    """Full-vocab drafting: argmax for greedy rows, else the keyed Gumbel-max of logits / T on
    the draft stream (positions + DRAFT_POSITION_SALT).  # [R] int64

    draft_logits: [R, V] raw; temperatures: [R] (0 = greedy); positions: [R] of the drafted token.
    """
    greedy = temperatures == 0
    temp = torch.where(greedy, 1.0, temperatures.float())
    sampled = gumbel_argmax(
        draft_logits.float() / temp[:, None], seeds, positions + DRAFT_POSITION_SALT
    )
    return torch.where(greedy, draft_logits.argmax(dim=-1), sampled)


# ---------------------------------------------------------------------------------------------
# Shared pieces


def _noisy_argmax(
    values: Sequence[Tensor], vocab_start: int, seeds: Tensor, positions: Tensor
) -> list[tuple[Tensor, Tensor]]:
    """For each [R, Vs] tensor: max and first argmax (absolute id) of values + keyed Gumbel
    noise of token ids vocab_start .. vocab_start + Vs - 1 (one noise draw shared by all)."""
    num_rows, size = values[0].shape
    device = values[0].device
    ids = torch.arange(vocab_start, vocab_start + size, dtype=torch.int64, device=device)
    best = [torch.empty(num_rows, dtype=torch.float32, device=device) for _ in values]
    arg = [torch.empty(num_rows, dtype=torch.int64, device=device) for _ in values]
    step = num_rows if device.type != "cpu" else max(1, _CPU_BLOCK_ELEMS // max(size, 1))
    for i in range(0, num_rows, step):
        sl = slice(i, i + step)
        rows = seeds[sl].shape[0]
        g = uniform_to_gumbel_(keyed_uniform_at(seeds[sl], positions[sl], ids.expand(rows, size)))
        for n, v in enumerate(values):
            score = g + v[sl]  # [rows, Vs]
            best[n][sl] = score.amax(dim=-1)
            arg[n][sl] = score.argmax(dim=-1) + vocab_start
    return list(zip(best, arg, strict=True))


def _max_restexp(z: Tensor) -> tuple[Tensor, Tensor]:
    """Row max and sum of exp(z - max) over every element but the (first) max itself, along the
    last dim; (-inf, 0) for all -inf rows. The row's sum-exp is 1 + rest; keeping the 1 apart
    keeps logit(q_max) = -log(rest) exact for confident rows."""
    m = z.amax(dim=-1)
    safe = torch.where(m == -math.inf, 0.0, m)
    e = torch.exp(z - safe[..., None])
    e.scatter_(-1, z.argmax(dim=-1, keepdim=True), 0.0)
    return m, e.sum(dim=-1)


def _combine_lse(row_max: Tensor, rest: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Global (max, log-sum-exp, log of the rest) from per-shard [S, ...] row max and rest
    sum-exp (`_max_restexp`); fp32 max and lse, float64 log-rest (= -logit(q_max))."""
    row_max, rest = row_max.double(), rest.double()
    gmax = row_max.amax(dim=0)  # [...]
    safe = torch.where(gmax == -math.inf, 0.0, gmax)
    scale = torch.exp(row_max - safe)  # [S, ...]; 1 at the shards holding the max
    first = (row_max == gmax).to(torch.int8).argmax(dim=0, keepdim=True)
    others = scale.scatter(0, first, 0.0)  # the global max element itself left out
    total_rest = (rest * scale + others).sum(dim=0)
    lse = safe + torch.log1p(total_rest)
    lse = torch.where(gmax == -math.inf, -math.inf, lse)
    return gmax.float(), lse.float(), torch.log(total_rest)


def _first_max(values: Tensor, payload: Tensor) -> Tensor:
    """payload at the first shard (dim 0) holding the max of values [S, ...]."""
    first = (values == values.amax(dim=0, keepdim=True)).to(torch.int8).argmax(dim=0, keepdim=True)
    return payload.gather(0, first).squeeze(0)


def _check_rows(num_rows: int, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.shape != (num_rows,):
            raise SpeculationInputError(f"{name} must be [{num_rows}], got {tuple(t.shape)}")
        if name != "temperatures" and t.dtype != torch.int64:
            raise SpeculationInputError(f"{name} must be int64, got {t.dtype}")


def _check_shards(shards: Sequence[Tensor], starts: Sequence[int], what: str) -> None:
    if len(shards) == 0 or len(shards) != len(starts):
        raise SpeculationInputError(
            f"{what}: need one vocab start per shard and at least one shard, got "
            f"{len(shards)} shards and {len(starts)} starts"
        )


# ---------------------------------------------------------------------------------------------
# Drafting


def draft_shard_stats(
    logits: Tensor, vocab_start: int, temperatures: Tensor, seeds: Tensor, positions: Tensor
) -> Tensor:
    """One shard's drafting summary.  # [R, DRAFT_STATS] float64

    logits: [R, Vs] raw draft logits of token ids vocab_start .. vocab_start + Vs - 1;
    positions: [R] of the drafted token (the draft-stream salt is added here).
    """
    greedy = temperatures == 0
    temp = torch.where(greedy, 1.0, temperatures.float())
    raw = logits.float()
    z = raw / temp[:, None]  # [R, Vs]
    ((noisy, token),) = _noisy_argmax([z], vocab_start, seeds, positions + DRAFT_POSITION_SALT)
    noisy = torch.where(greedy, raw.amax(dim=-1), noisy)
    token = torch.where(greedy, raw.argmax(dim=-1) + vocab_start, token)
    token_logit = raw.gather(1, (token - vocab_start)[:, None])[:, 0]
    row_max, rest = _max_restexp(z)
    return torch.stack([noisy, token.float(), token_logit, row_max, rest], dim=-1).double()


def combine_draft_stats(stats: Tensor, temperatures: Tensor) -> DraftSample:
    """Merge the gathered [S, R, DRAFT_STATS] summaries into the drafted tokens."""
    noisy, token, token_logit, row_max, rest = stats.unbind(-1)  # [S, R] each
    greedy = temperatures == 0
    temp = torch.where(greedy, 1.0, temperatures.float())
    token_ids = _first_max(noisy, token).long()
    z_token = _first_max(noisy, token_logit).float() / temp
    _, lse, log_rest = _combine_lse(row_max, rest)
    features = (-log_rest).clamp(-FEATURE_CLAMP, FEATURE_CLAMP).float()
    features = torch.where(greedy, ONE_HOT_FEATURE, features)
    return DraftSample(token_ids=token_ids, logprobs=z_token - lse, lse=lse, features=features)


def vocab_parallel_draft(
    logit_shards: Sequence[Tensor],
    starts: Sequence[int],
    temperatures: Tensor,
    seeds: Tensor,
    positions: Tensor,
    gather: Gather = stack_gather,
) -> DraftSample:
    """sample_draft_full over vocab shards: the same tokens, plus log q(token) and the lse.

    logit_shards: this process's [R, Vs] raw draft logits; starts: their first token ids.
    """
    _check_shards(logit_shards, starts, "vocab_parallel_draft")
    _check_rows(
        logit_shards[0].shape[0], temperatures=temperatures, seeds=seeds, positions=positions
    )
    local = [
        draft_shard_stats(x, s, temperatures, seeds, positions)
        for x, s in zip(logit_shards, starts, strict=True)
    ]
    return combine_draft_stats(gather(local), temperatures)


# ---------------------------------------------------------------------------------------------
# Verification


@dataclass
class VerifyPlan:
    """What the first gather of verification decides, identical on every rank."""

    num_accepted: Tensor  # [R] int64
    resample: Tensor  # [R] bool: a drawn draft was rejected: the last token is the residual's
    greedy: Tensor  # [R] bool
    lse: Tensor  # [R, K+1] fp32 the target's log-sum-exp of z
    target_argmax: Tensor  # [R, K+1] int64 of the raw target logits
    drafts: Tensor  # [R, K] int64, padded slots set to 0


def verify_shard_stats(
    target_logits: Tensor,
    vocab_start: int,
    draft_token_ids: Tensor,
    temperatures: Tensor,
    num_draft: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> Tensor:
    """One shard's summary of the target rows.  # [R, K+1, VERIFY_STATS] float64

    target_logits: [R, K+1, Vs] raw target logits of this shard's token ids; positions: of the
    first draft.
    """
    num_rows, k1, size = target_logits.shape
    k = k1 - 1
    greedy = temperatures == 0
    temp = torch.where(greedy, 1.0, temperatures.float())
    raw = target_logits.float()
    z = raw / temp[:, None, None]  # [R, K+1, Vs]
    row_max, rest = _max_restexp(z)  # [R, K+1]
    raw_max = raw.amax(dim=-1)
    raw_arg = raw.argmax(dim=-1) + vocab_start
    valid = torch.arange(k, device=z.device)[None, :] < num_draft[:, None]  # [R, K]
    drafts = torch.where(valid, draft_token_ids, 0)
    local = drafts - vocab_start
    owned = (local >= 0) & (local < size)
    z_draft = z[:, :k].gather(-1, local.clamp(0, size - 1)[..., None])[..., 0]  # [R, K]
    z_draft = torch.where(owned, z_draft, -math.inf)
    z_draft = torch.cat([z_draft, torch.full_like(z_draft[:, :1], -math.inf)], dim=1)  # [R, K+1]
    steps = torch.arange(k1, device=z.device)
    ((noisy, noisy_arg),) = _noisy_argmax(
        [z.reshape(num_rows * k1, size)],
        vocab_start,
        seeds.repeat_interleave(k1),
        (positions[:, None] + steps[None, :]).reshape(-1),
    )
    noisy, noisy_arg = noisy.view(num_rows, k1), noisy_arg.view(num_rows, k1).float()
    stats = [row_max, rest, raw_max, raw_arg.float(), z_draft, noisy, noisy_arg]
    return torch.stack(stats, dim=-1).double()


def combine_verify_stats(
    stats: Tensor,
    draft_token_ids: Tensor,
    draft_logprobs: Tensor | None,
    temperatures: Tensor,
    seeds: Tensor,
    positions: Tensor,
    num_draft: Tensor,
) -> VerifyPlan:
    """Acceptance from the gathered [S, R, K+1, VERIFY_STATS] summaries (as rejection_sample).

    draft_logprobs: [R, K] log q(d) (DraftSample.logprobs per slot), None for one-hot drafts.
    """
    row_max, rest, raw_max, raw_arg, z_draft, noisy, noisy_arg = stats.unbind(-1)  # [S, R, K+1]
    k = row_max.shape[2] - 1
    greedy = temperatures == 0
    valid = torch.arange(k, device=row_max.device)[None, :] < num_draft[:, None]  # [R, K]
    drafts = torch.where(valid, draft_token_ids, 0)
    _, lse, _ = _combine_lse(row_max, rest)  # [R, K+1]
    target_argmax = _first_max(raw_max, raw_arg).long()  # [R, K+1]
    accept_greedy = target_argmax[:, :k] == drafts
    p_d = z_draft.amax(dim=0)[:, :k].float() - lse[:, :k]  # [R, K]; one shard owns d
    q_d = torch.zeros_like(p_d) if draft_logprobs is None else draft_logprobs.float()
    one_hot = q_d == 0  # [R, K]
    draws = _first_max(noisy, noisy_arg).long()  # [R, K+1] the plain sampler's draws
    ratio = random_accepts(p_d, q_d, seeds, positions, drafts)  # [R, K]
    accept_random = random_draft_accepts(draws, drafts, one_hot, ratio)  # [R, K]
    accept = torch.where(greedy[:, None], accept_greedy, accept_random)
    num_accepted = accepted_prefix(accept, num_draft)  # [R]
    return VerifyPlan(
        num_accepted=num_accepted,
        resample=resampled_rows(num_accepted, num_draft, greedy, one_hot),
        greedy=greedy,
        lse=lse,
        target_argmax=target_argmax,
        drafts=drafts,
    )


def final_shard_stats(
    target_logits: Tensor,
    draft_logits: Tensor | None,
    draft_lse: Tensor | None,
    vocab_start: int,
    plan: VerifyPlan,
    temperatures: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> Tensor:
    """One shard's sample of the token after the accepted prefix.  # [R, FINAL_STATS] float64

    Residual max(p - q, 0) where a drawn draft was rejected, the target's z otherwise (a bonus
    token, a one-hot draft's rejection: the plain sampler's draw); plus a sample from p in case
    the residual turns out empty on every shard.
    draft_logits: [R, K, Vs] raw draft logits of this shard (None: one-hot drafts);
    draft_lse: [R, K] the draft's log-sum-exp per slot (DraftSample.lse), None for one-hot.
    """
    num_rows, k1, size = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    rows = torch.arange(num_rows, device=device)
    j = plan.num_accepted
    temp = torch.where(plan.greedy, 1.0, temperatures.float())
    z_j = target_logits[rows, j].float() / temp[:, None]  # [R, Vs]
    t_lp = z_j - plan.lse[rows, j][:, None]  # [R, Vs]
    primary = z_j
    if k > 0:
        jd = j.clamp(max=k - 1)
        if draft_logits is None:
            local = plan.drafts[rows, jd] - vocab_start  # [R]
            d_lp = torch.full_like(t_lp, -math.inf)
            owned = (local >= 0) & (local < size)
            d_lp[rows[owned], local[owned]] = 0.0
        else:
            if draft_lse is None:
                raise SpeculationInputError("draft_lse is needed with draft_logits")
            d_lp = draft_logits[rows, jd].float() / temp[:, None] - draft_lse[rows, jd][:, None]
        residual = torch.where(
            d_lp < t_lp, t_lp + torch.log1p(-torch.exp(d_lp - t_lp)), -math.inf
        )  # [R, Vs]
        primary = torch.where(plan.resample[:, None], residual, z_j)
    (n1, id1), (n2, id2) = _noisy_argmax([primary, t_lp], vocab_start, seeds, positions + j)
    return torch.stack([n1, id1.float(), primary.amax(dim=-1), n2, id2.float()], dim=-1).double()


def combine_final_stats(stats: Tensor, plan: VerifyPlan, draft_token_ids: Tensor) -> Tensor:
    """Output tokens [R, K+1] (accepted drafts, then the final token, padded with -1)."""
    n1, id1, pmax, n2, id2 = stats.unbind(-1)  # [S, R]
    rows = torch.arange(n1.shape[1], device=n1.device)
    j = plan.num_accepted
    empty = (pmax.amax(dim=0) == -math.inf) & plan.resample
    sampled = torch.where(empty, _first_max(n2, id2), _first_max(n1, id1)).long()
    final = torch.where(plan.greedy, plan.target_argmax[rows, j], sampled)
    return accepted_output(draft_token_ids, j, final)


def vocab_parallel_rejection_sample(
    target_shards: Sequence[Tensor],
    draft_shards: Sequence[Tensor] | None,
    starts: Sequence[int],
    draft_token_ids: Tensor,
    draft_logprobs: Tensor | None,
    draft_lse: Tensor | None,
    temperatures: Tensor,
    seeds: Tensor,
    positions: Tensor,
    num_draft: Tensor,
    gather: Gather = stack_gather,
    *,
    check_ranges: bool = True,
) -> tuple[Tensor, Tensor]:
    """rejection_sample over vocab shards: (output_token_ids [R, K+1], num_accepted [R]).

    target_shards: this process's [R, K+1, Vs] raw target logits; draft_shards: its [R, K, Vs]
    raw draft logits, or None for one-hot drafts (then draft_logprobs and draft_lse are None
    too); starts: the shards' first token ids. draft_logprobs / draft_lse: [R, K] from drafting
    (DraftSample.logprobs / .lse per slot). The rest as in rejection_sample: positions is the
    position of the first draft; padded slots (k >= num_draft) may hold any id; verified drafts
    must lie in [0, V). Callers that process logits first (penalties, then temperature) pass the
    processed logits with temperature 1 for random rows, as libkk.runtime.verify does. A batch
    that mixes one-hot rows into probabilistic ones gives those rows draft logits of 0 at the
    draft token and -inf elsewhere (log q(d) = 0, lse = 0). check_ranges as in rejection_sample.
    """
    _check_shards(target_shards, starts, "vocab_parallel_rejection_sample")
    one_hot = draft_shards is None
    if one_hot != (draft_logprobs is None) or one_hot != (draft_lse is None):
        raise SpeculationInputError(
            "draft_shards, draft_logprobs and draft_lse must all be given or all be None"
        )
    if target_shards[0].dim() != 3:
        raise SpeculationInputError(
            f"target shards must be [R, K+1, Vs], got {tuple(target_shards[0].shape)}"
        )
    num_rows, k1 = target_shards[0].shape[:2]
    k = k1 - 1
    if draft_token_ids.dtype != torch.int64 or draft_token_ids.shape != (num_rows, k):
        raise SpeculationInputError(
            f"draft_token_ids must be int64 [{num_rows}, {k}], got "
            f"{draft_token_ids.dtype} {tuple(draft_token_ids.shape)}"
        )
    _check_rows(
        num_rows, temperatures=temperatures, seeds=seeds, positions=positions, num_draft=num_draft
    )
    if check_ranges:
        check_value_ranges(num_draft, k, temperatures)
    for name, t in (("draft_logprobs", draft_logprobs), ("draft_lse", draft_lse)):
        if t is not None and t.shape != (num_rows, k):
            raise SpeculationInputError(f"{name} must be [{num_rows}, {k}], got {tuple(t.shape)}")

    local = [
        verify_shard_stats(x, s, draft_token_ids, temperatures, num_draft, seeds, positions)
        for x, s in zip(target_shards, starts, strict=True)
    ]
    plan = combine_verify_stats(
        gather(local), draft_token_ids, draft_logprobs, temperatures, seeds, positions, num_draft
    )
    drafts = [None] * len(target_shards) if draft_shards is None else list(draft_shards)
    local = [
        final_shard_stats(x, d, draft_lse, s, plan, temperatures, seeds, positions)
        for x, d, s in zip(target_shards, drafts, starts, strict=True)
    ]
    out = combine_final_stats(gather(local), plan, draft_token_ids)
    return out, plan.num_accepted
