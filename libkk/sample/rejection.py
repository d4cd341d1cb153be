"""Reference rejection sampler for speculative decoding (Leviathan et al., arXiv 2211.17192).

Per row, drafts d_0 .. d_{n-1} (n = num_draft) proposed at positions pos .. pos + n - 1 are
verified against the target's K + 1 rows of logits:

- greedy rows (temperature 0) accept d_k while argmax(target_k) == d_k, then emit the target
  argmax at the first mismatch, or at index n (the bonus token) when every draft is accepted;
- random rows with a one-hot draft (q_k(d_k) = 1: n-gram and greedy drafters) accept d_k when it
  is the token the plain sampler draws at its position, the Gumbel argmax of p_k under that
  position's keyed noise, and emit that draw at the first rejection: d_k passes with probability
  p_k(d_k), as the ratio test would, and a rejected draw is a sample of p_k without d_k, which
  is the residual max(p - q, 0) normalized. Every token is then the plain sampler's own: a
  seeded request gives the same tokens with or without speculation, however many drafts each
  step verifies;
- other random rows accept d_k when p_k(d_k) / q_k(d_k) >= u_k, in log space
  log p(d) >= log u + log q(d), stop at the first rejection and sample from the residual
  max(p - q, 0) (normalized), or sample a bonus token from p_n when every draft is accepted.

All randomness is keyed by (seed, position, token id) (libkk.sample.gumbel), so a row's result
never depends on the rest of the batch:

- the acceptance uniform of d_k is keyed_uniform_at(seed, pos + k + ACCEPT_POSITION_SALT, d_k);
- one-hot draws, residual and bonus tokens use the target's own Gumbel noise at their position
  (no salt), so a bonus token is exactly the token the plain sampler would draw from the same
  logits;
- drafters sample with DRAFT_POSITION_SALT, so the three streams never share noise.

p = softmax(target_logits / T): callers apply penalties and top-k / top-p / min-p to the logits
first (-inf logits are never emitted). q = draft_probs; None means one-hot drafts (n-gram): q(d) = 1.

The keyed acceptance (`acceptance_uniforms`, `random_accepts`, `accepted_prefix`) and the output
layout (`accepted_output`) are shared with libkk.spec_decode.vocab_parallel and
libkk.runtime.verify, so every verification path decides alike.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from libkk.errors import SpeculationInputError
from libkk.sample.gumbel import DRAFT_POSITION_SALT, gumbel_argmax, keyed_uniform_at

# Added to positions for the acceptance uniforms: distinct from the target stream (0) and the
# draft stream (DRAFT_POSITION_SALT = 2**30); positions + salt stay below 2**32.
ACCEPT_POSITION_SALT = 2**31
assert ACCEPT_POSITION_SALT != DRAFT_POSITION_SALT


def rejection_sample(
    target_logits: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    temperatures: Tensor,
    seeds: Tensor,
    positions: Tensor,
    num_draft: Tensor,
    *,
    check_ranges: bool = True,
) -> tuple[Tensor, Tensor]:
    """Verify drafts and emit each row's accepted tokens plus one corrected or bonus token.

    target_logits: [R, K+1, V] fp32, the target's logits at the K draft positions and the bonus.
    draft_token_ids: [R, K] int64; entries at k >= num_draft[r] are ignored (any value).
    draft_probs: [R, K, V] fp32 draft distributions q, or None for one-hot drafts.
    temperatures: [R] fp32, 0 = greedy.
    seeds: [R] int64; positions: [R] int64, the position of the first draft token.
    num_draft: [R] int64 in [0, K], the drafts each row verifies.
    check_ranges: False skips checking num_draft's and the temperatures' values, which reads them
    on the host (a wait for the device); for callers that built them on the host.

    Returns (output_token_ids [R, K+1] int64, the num_accepted[r] accepted drafts then one
    target token, padded with -1; num_accepted [R] int64).
    """
    num_rows, k1, vocab_size = _check(
        target_logits, draft_token_ids, draft_probs, temperatures, seeds, positions, num_draft,
        check_ranges,
    )  # fmt: skip
    k = k1 - 1
    device = target_logits.device
    greedy = temperatures == 0  # [R]
    steps = torch.arange(k1, device=device)  # [K+1]

    # Padded drafts are clamped so they can index; they are never accepted.
    valid = steps[None, :k] < num_draft[:, None]  # [R, K]
    drafts = torch.where(valid, draft_token_ids, 0).clamp_(0, vocab_size - 1)  # [R, K]

    temp = torch.where(greedy, 1.0, temperatures.float())  # [R]
    scaled = target_logits.float() / temp[:, None, None]  # [R, K+1, V]
    target_lp = torch.log_softmax(scaled, dim=-1)  # [R, K+1, V]

    # Greedy acceptance.
    target_argmax = target_logits.argmax(dim=-1)  # [R, K+1]; ties to the lowest id
    accept_greedy = target_argmax[:, :k] == drafts  # [R, K]

    # Random acceptance: a one-hot draft is the plain sampler's draw; others log p(d) >= log u +
    # log q(d).
    p_d = target_lp[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [R, K]
    if draft_probs is None:
        q_d = torch.zeros_like(p_d)  # log 1
    else:
        q_d = draft_probs.float().gather(-1, drafts[..., None]).squeeze(-1).log()  # [R, K]
    one_hot = q_d == 0  # [R, K]
    ratio = random_accepts(p_d, q_d, seeds, positions, drafts)  # [R, K]
    draws, accept_random = _plain_draws(
        scaled, seeds, positions, drafts, num_draft, one_hot, ratio, greedy
    )

    accept = torch.where(greedy[:, None], accept_greedy, accept_random)  # [R, K]
    num_accepted = accepted_prefix(accept, num_draft)  # [R]

    # The token after the accepted prefix: the draw at j (a bonus, or a one-hot draft's
    # rejection), or a residual sample at the rejection of a drawn draft.
    rows = torch.arange(num_rows, device=device)
    j = num_accepted  # [R], index into K+1
    resample = resampled_rows(num_accepted, num_draft, greedy, one_hot)  # [R]
    sampled = draws[rows, j]  # [R]
    # On a GPU the residual is computed whether or not a row needs it: asking would wait for the
    # device (and stall the next step's host work under asynchronous scheduling).
    if k > 0 and draft_probs is not None and (target_logits.is_cuda or bool(resample.any())):
        t_lp = target_lp[rows, j]  # [R, V]
        d_lp = draft_probs[rows, j.clamp(max=k - 1)].float().log()  # [R, V]
        # log max(p - q, 0) up to normalization; Gumbel-max needs no normalization.
        residual = torch.where(
            d_lp < t_lp, t_lp + torch.log1p(-torch.exp(d_lp - t_lp)), -math.inf
        )  # [R, V]
        # NOTE: a rejection with p <= q everywhere has probability 0 but can happen through
        # rounding (p ~= q); sample from p then.
        empty = residual.amax(dim=-1) == -math.inf
        residual = torch.where(empty[:, None], t_lp, residual)
        residual_draw = gumbel_argmax(residual, seeds, positions + j)  # [R]
        sampled = torch.where(resample, residual_draw, sampled)
    final = torch.where(greedy, target_argmax[rows, j], sampled)  # [R]

    return accepted_output(draft_token_ids, num_accepted, final), num_accepted


def _plain_draws(
    scaled: Tensor,
    seeds: Tensor,
    positions: Tensor,
    drafts: Tensor,
    num_draft: Tensor,
    one_hot: Tensor,
    ratio: Tensor,
    greedy: Tensor,
) -> tuple[Tensor, Tensor]:
    """The plain sampler's draws of a block [R, K+1] (-1 where not drawn) and the random
    acceptance [R, K]: a one-hot draft passes where it is the draw, another where it passes
    the ratio test (`ratio`). Greedy rows read neither.

    A full-vocabulary draw costs what plain decoding pays per token. On a GPU every position
    is drawn at once (asking which positions a row reaches would wait for the device);
    elsewhere only the positions a row reaches, in order, as plain decoding of the same tokens
    would draw them. The draws used are the same either way."""
    num_rows, k1, vocab_size = scaled.shape
    k = k1 - 1
    if scaled.is_cuda:
        steps = torch.arange(k1, device=scaled.device)
        draws = gumbel_argmax(
            scaled.reshape(num_rows * k1, vocab_size),
            seeds.repeat_interleave(k1),
            (positions[:, None] + steps[None, :]).reshape(-1),
        ).view(num_rows, k1)
        return draws, random_draft_accepts(draws, drafts, one_hot, ratio)
    draws = torch.full((num_rows, k1), -1, dtype=torch.int64, device=scaled.device)
    accept = ratio.clone()
    reached = ~greedy
    for i in range(k1):
        rows = reached.nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        draws[rows, i] = gumbel_argmax(scaled[rows, i], seeds[rows], positions[rows] + i)
        if i == k:
            break
        accept[:, i] = torch.where(one_hot[:, i], draws[:, i] == drafts[:, i], ratio[:, i])
        reached &= accept[:, i] & (i < num_draft)
    return draws, accept


def random_draft_accepts(draws: Tensor, drafts: Tensor, one_hot: Tensor, ratio: Tensor) -> Tensor:
    """Which drafts of random rows pass.  # [R, K] bool

    A one-hot draft passes where it is the plain sampler's draw at its position (draws
    [R, K+1]), another where it passes the ratio test (`ratio`, from `random_accepts`)."""
    return torch.where(one_hot, draws[:, : drafts.shape[1]] == drafts, ratio)


def resampled_rows(
    num_accepted: Tensor, num_draft: Tensor, greedy: Tensor, one_hot: Tensor
) -> Tensor:
    """Random rows whose token after the accepted run is a residual sample: a drawn (not
    one-hot) draft was rejected. Elsewhere it is the draw at that position.  # [R] bool"""
    resample = (num_accepted < num_draft) & ~greedy
    k = one_hot.shape[1]
    if k > 0:
        rows = torch.arange(num_accepted.shape[0], device=num_accepted.device)
        resample &= ~one_hot[rows, num_accepted.clamp(max=k - 1)]
    return resample


def acceptance_uniforms(seeds: Tensor, positions: Tensor, drafts: Tensor) -> Tensor:
    """The keyed acceptance uniforms of a block of drafts.  # [R, K] fp32

    u[r, k] = keyed_uniform_at(seeds[r], positions[r] + k + ACCEPT_POSITION_SALT, drafts[r, k]).
    seeds, positions: [R] int64, positions of the first draft; drafts: [R, K] int64.
    """
    num_rows, k = drafts.shape
    steps = torch.arange(k, device=drafts.device)
    return keyed_uniform_at(
        seeds.repeat_interleave(k),
        (positions[:, None] + steps[None, :] + ACCEPT_POSITION_SALT).reshape(-1),
        drafts.reshape(-1),
    ).view(num_rows, k)


def random_accepts(
    log_p: Tensor, log_q: Tensor, seeds: Tensor, positions: Tensor, drafts: Tensor
) -> Tensor:
    """Which drafts pass the random test log p(d) >= log u + log q(d).  # [R, K] bool

    log_p, log_q: [R, K] log-probabilities of the drafts under the target and the drafter;
    u from acceptance_uniforms. A token the target excludes (-inf) never passes, whatever q says.
    """
    u = acceptance_uniforms(seeds, positions, drafts)  # [R, K]
    return (log_p >= u.log() + log_q) & (log_p > -math.inf)


def accepted_prefix(accept: Tensor, num_draft: Tensor) -> Tensor:
    """The number of leading slots of `accept` [R, K] (bool) that pass, at most num_draft [R].
    # [R] int64"""
    steps = torch.arange(accept.shape[1], device=accept.device)
    valid = steps[None, :] < num_draft[:, None]  # [R, K]
    return (accept & valid).long().cumprod(dim=-1).sum(dim=-1)


def accepted_output(draft_token_ids: Tensor, num_accepted: Tensor, final: Tensor) -> Tensor:
    """The emitted tokens: each row's num_accepted [R] drafts of draft_token_ids [R, K], then its
    final token [R], padded with -1.  # [R, K+1] int64"""
    num_rows, k = draft_token_ids.shape
    device = draft_token_ids.device
    steps = torch.arange(k, device=device)
    out = torch.full((num_rows, k + 1), -1, dtype=torch.int64, device=device)
    out[:, :k] = torch.where(steps[None, :] < num_accepted[:, None], draft_token_ids, -1)
    out[torch.arange(num_rows, device=device), num_accepted] = final
    return out


def _check(
    target_logits: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    temperatures: Tensor,
    seeds: Tensor,
    positions: Tensor,
    num_draft: Tensor,
    check_ranges: bool,
) -> tuple[int, int, int]:
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [R, K+1, V], got {tuple(target_logits.shape)}")
    num_rows, k1, vocab_size = target_logits.shape
    if k1 < 1:
        raise ValueError("target_logits needs K+1 >= 1 rows per request")
    if draft_token_ids.dtype != torch.int64 or draft_token_ids.shape != (num_rows, k1 - 1):
        raise ValueError(
            f"draft_token_ids must be int64 [{num_rows}, {k1 - 1}], "
            f"got {draft_token_ids.dtype} {tuple(draft_token_ids.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_rows, k1 - 1, vocab_size):
        raise ValueError(
            f"draft_probs must be [{num_rows}, {k1 - 1}, {vocab_size}], "
            f"got {tuple(draft_probs.shape)}"
        )
    for name, t, dtype in (
        ("temperatures", temperatures, None),
        ("seeds", seeds, torch.int64),
        ("positions", positions, torch.int64),
        ("num_draft", num_draft, torch.int64),
    ):
        if t.shape != (num_rows,) or (dtype is not None and t.dtype != dtype):
            raise ValueError(
                f"{name} must be [{num_rows}] {dtype or ''}, got {t.dtype} {tuple(t.shape)}"
            )
    if check_ranges:  # else the caller built num_draft and temperatures: no device read
        check_value_ranges(num_draft, k1 - 1, temperatures)
    return num_rows, k1, vocab_size


def check_value_ranges(num_draft: Tensor, k: int, temperatures: Tensor) -> None:
    """num_draft in [0, k] and temperatures >= 0; reads both on the host (a wait for the device)."""
    if bool(((num_draft < 0) | (num_draft > k)).any()):
        raise SpeculationInputError(f"num_draft must lie in [0, {k}], got {num_draft.tolist()}")
    if bool((temperatures < 0).any()):
        raise SpeculationInputError("temperatures must be >= 0")
