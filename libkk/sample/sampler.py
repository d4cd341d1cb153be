"""The sampler: one token per row of logits, with vLLM's penalties, filters and logprobs.

Order per row: tokens a grammar disallows -> -inf (structured output); banned ids -> -inf;
repetition penalty (prompt + output tokens); frequency and presence penalties (output tokens);
then greedy rows take the argmax, and random rows divide by
the temperature, apply top-k, top-p and min-p, and take argmax(logits + keyed Gumbel noise). The
noise is keyed by (seed, position, token id), so a row's token depends on its own logits, seed and
position only, never on the rest of the batch. Logprobs are of the raw logits (vLLM's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from libkk.kernels.bitmask import apply_token_bitmask, apply_token_bitmask_ref
from libkk.sample.gumbel import gumbel_argmax, gumbel_argmax_at
from libkk.sample.params import SamplingParams

# Top-k/top-p first look at this many largest logits per row (a full sort only if the cut is
# further down); rows whose kept tokens all lie among them hash only these for the Gumbel-max.
_TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample from."""

    params: SamplingParams
    seed: int  # resolved per-request seed (64-bit signed)
    position: int  # 0-based position of the token being sampled (= tokens before it)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    banned_token_ids: Sequence[int] = ()  # -inf this step (eos/stop ids while under min_tokens)
    # Structured output: the tokens the request's grammar allows next, an int32 bitmask
    # [ceil(grammar vocab / 32)] on the host; ids past it are disallowed. None: unconstrained.
    grammar_mask: Tensor | None = field(default=None, compare=False)
    # Async scheduling: the row has a grammar whose mask needs the previous step's token, still
    # in flight; the runner samples the row once the engine gives the mask (`sample_pending`).
    grammar_pending: bool = False

    def keeps_raw_argmax(self) -> bool:
        """Whether the argmax of the raw logits survives this row's processing: no banned id and
        no penalty and no grammar (temperature and the filters always keep the top token)."""
        p = self.params
        return (
            not self.banned_token_ids
            and self.grammar_mask is None
            and not self.grammar_pending
            and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0
        )

    def takes_raw_argmax(self) -> bool:
        """A greedy row asking for no logprobs whose token is the raw logits' argmax: only the
        argmax is read, and processing keeps it."""
        return self.params.greedy and self.params.logprobs is None and self.keeps_raw_argmax()


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw logits
    rank: int  # 1 + the number of tokens strictly more likely (1 = most likely)
    top: list[tuple[int, float]]  # the params.logprobs most likely (token id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask for logprobs


@dataclass
class LogprobTensors:
    """Logprobs of the sampled tokens for the rows that ask for them, as tensors (on the device
    until copied): built into TokenLogprobs once on the host."""

    rows: list[int]  # the rows that asked, in order
    num_top: list[int]  # how many top entries each of them asked for
    sampled: Tensor  # [W] fp32, the sampled token's logprob
    rank: Tensor  # [W] int64, 1 + the tokens strictly more likely
    top_logprobs: Tensor  # [W, n] fp32, best first (n = max(num_top))
    top_ids: Tensor  # [W, n] int64

    def to_host(self, non_blocking: bool = False) -> LogprobTensors:
        """A copy on the host (pinned memory, copied asynchronously, for CUDA tensors when
        `non_blocking`: valid once the copying stream got there)."""
        return LogprobTensors(
            self.rows,
            self.num_top,
            *(
                _to_host(t, non_blocking)
                for t in (self.sampled, self.rank, self.top_logprobs, self.top_ids)
            ),
        )

    def build(self, token_ids: Sequence[int], num_rows: int) -> list[TokenLogprobs | None]:
        """One entry per row (None for rows that did not ask); reads the tensors on the host."""
        result: list[TokenLogprobs | None] = [None] * num_rows
        sampled, rank = self.sampled.tolist(), self.rank.tolist()
        top_lp, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        for j, (i, n) in enumerate(zip(self.rows, self.num_top, strict=True)):
            result[i] = TokenLogprobs(
                token_id=token_ids[i],
                logprob=sampled[j],
                rank=rank[j],
                top=list(zip(top_ids[j][:n], top_lp[j][:n], strict=True)),
            )
        return result


@dataclass
class SampledTokens:
    """One step's sampled tokens, left where they were sampled (the device)."""

    token_ids: Tensor  # [R] int64
    logprobs: LogprobTensors | None  # None when no row asks

    def to_host(self) -> SamplerOutput:
        """The tokens and logprobs as host lists (waits for the device)."""
        token_ids = self.token_ids.tolist()
        num_rows = len(token_ids)
        logprobs = (
            [None] * num_rows if self.logprobs is None else self.logprobs.build(token_ids, num_rows)
        )
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


class Sampler:
    """Samples one token per row; works on CPU and CUDA logits of any float dtype.

    `sample` leaves its results on the device and reads nothing back except where a filter
    needs it (rows with top-k or top-p whose cut falls past the first candidates); calling the
    sampler gives the same tokens as host lists.
    """

    def sample(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SampledTokens:
        num_rows, vocab_size = logits.shape  # logits [R, V]
        if len(rows) != num_rows:
            raise ValueError(f"got {len(rows)} sampling rows for {num_rows} rows of logits")
        if any(row.grammar_pending for row in rows):
            raise RuntimeError("a row's grammar mask is not known yet (its token is in flight)")
        device = logits.device
        x = logits.float()
        constrained = [i for i, row in enumerate(rows) if row.grammar_mask is not None]
        if constrained:
            # NOTE: masked on a copy: logprobs stay those of the raw logits.
            x = x.clone() if x is logits else x
            apply_grammar_masks(x, rows, constrained)
        x = apply_penalties(x, rows, inplace=x is not logits)  # [R, V]
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if len(random_rows) < num_rows:
            token_ids = x.argmax(dim=-1)  # [R]; ties go to the lowest id
        else:
            token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
        # NOTE: rows without top-k, top-p or min-p take the keyed Gumbel-max of their scaled
        # logits directly; the filter path may read device values on the host. Rows are
        # independent, so the split changes no row's token.
        filtered = [i for i in random_rows if _filters(rows[i].params, vocab_size)]
        unfiltered = [i for i in random_rows if not _filters(rows[i].params, vocab_size)]
        for group, sample in ((unfiltered, _sample_unfiltered), (filtered, sample_random)):
            if not group:
                continue
            picked = [rows[i] for i in group]
            seeds = _host_values([row.seed for row in picked], device)
            positions = _host_values([row.position for row in picked], device)
            params = [row.params for row in picked]
            if len(group) == num_rows:
                xr = x.clone() if x is logits else x  # sampling works in place
                token_ids = sample(xr, params, seeds, positions)
            else:
                token_ids[_host_values(group, device)] = sample(
                    x[_host_values(group, device)], params, seeds, positions
                )
        return SampledTokens(token_ids, logprob_tensors(logits, token_ids, rows))

    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).to_host()


def apply_grammar_masks(
    logits: Tensor, rows: Sequence[SamplingRow], constrained: Sequence[int]
) -> None:
    """Sets the tokens each constrained row's grammar disallows to -inf, in place.  # [R, V]

    constrained: the rows with a grammar_mask; the other rows are untouched."""
    masks = [m for i in constrained if (m := rows[i].grammar_mask) is not None]
    words = max(m.shape[0] for m in masks)
    # Rows of one session share a tokenizer; a shorter row is padded with disallowed words.
    host = torch.zeros((len(masks), words), dtype=torch.int32)  # [G, W]
    for j, m in enumerate(masks):
        host[j, : m.shape[0]] = m
    if logits.device.type != "cuda":
        apply_token_bitmask_ref(logits, host, torch.tensor(list(constrained)))
        return
    # One kernel for the whole batch; the masks and row ids go up in one pinned copy.
    count = len(masks)
    packed = torch.empty(count * (words + 1), dtype=torch.int32).pin_memory()
    packed[:count] = torch.tensor(list(constrained), dtype=torch.int32)
    packed[count:] = host.flatten()
    on_device = packed.to(logits.device, non_blocking=True)
    apply_token_bitmask(logits, on_device[count:].view(count, words), on_device[:count])


def _filters(params: SamplingParams, vocab_size: int) -> bool:
    """Whether a random row has top-k, top-p or min-p."""
    return 0 < params.top_k < vocab_size or params.top_p < 1.0 or params.min_p > 0.0


def _sample_unfiltered(
    logits: Tensor, params: Sequence[SamplingParams], seeds: Tensor, positions: Tensor
) -> Tensor:
    """Temperature, then the keyed Gumbel-max, for rows with no filter; modifies logits."""
    _apply_temperature(logits, params)
    return gumbel_argmax(logits, seeds, positions)


def logprob_tensors(
    logits: Tensor, token_ids: Tensor, rows: Sequence[SamplingRow]
) -> LogprobTensors | None:
    """Logprobs of the raw logits [R, V] for the rows that ask for them, as device tensors;
    None when no row asks. token_ids [R] may hold -1 for rows with no token (never read)."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return None
    idx = _host_values(wanted, logits.device)
    lp = logits[idx].float().log_softmax(dim=-1)  # [W, V]
    sampled = lp.gather(1, token_ids[idx].clamp(min=0)[:, None])  # [W, 1]
    rank = (lp > sampled).sum(dim=-1) + 1  # [W]
    num_top = [rows[i].params.logprobs or 0 for i in wanted]
    top_lp, top_ids = lp.topk(min(max(num_top), lp.shape[1]), dim=-1)  # [W, n], best first
    return LogprobTensors(wanted, num_top, sampled[:, 0], rank, top_lp, top_ids)


def _host_values(
    values: Sequence[int] | Sequence[float], device: torch.device, dtype: torch.dtype = torch.int64
) -> Tensor:
    """A host list on `device` (through pinned memory on CUDA: the copy waits for nothing the
    device has queued, so a step launched ahead of the previous one's end stays ahead)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _to_host(t: Tensor, non_blocking: bool) -> Tensor:
    if not (non_blocking and t.is_cuda):
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def apply_penalties(logits: Tensor, rows: Sequence[SamplingRow], inplace: bool = False) -> Tensor:
    """Banned ids, repetition and frequency/presence penalties.  # [R, V] fp32

    Returns `logits` itself when no row asks for any of them or `inplace`, else a modified copy.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    x = logits

    def owned() -> Tensor:
        nonlocal x
        if x is logits and not inplace:
            x = logits.clone()
        return x

    banned = [row.banned_token_ids for row in rows]
    if any(banned):
        owned()[_scatter_index(banned, device)] = -math.inf

    # NOTE: both penalties touch only the tokens seen: (row, token) pairs, not [R, V] passes.
    rep = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if rep:
        # HF/vLLM: a seen token's logit is divided by the penalty if positive, multiplied if not.
        seen = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep]
        sub, tok, _ = _unique_pairs(seen, vocab_size, device)  # [N] each
        if tok.numel():
            penalty = torch.tensor(
                [rows[i].params.repetition_penalty for i in rep], dtype=torch.float32, device=device
            )[sub]  # [N]
            r_idx = torch.tensor(rep, device=device)[sub]
            val = x[r_idx, tok]
            owned()[r_idx, tok] = torch.where(val > 0, val / penalty, val * penalty)

    freq = [
        i
        for i, row in enumerate(rows)
        if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0
    ]
    if freq:
        # OpenAI: logit -= frequency * count + presence * (count > 0), over generated tokens.
        sub, tok, count = _unique_pairs(
            [rows[i].output_token_ids for i in freq], vocab_size, device
        )
        if tok.numel():
            fp = torch.tensor(
                [rows[i].params.frequency_penalty for i in freq], dtype=torch.float32, device=device
            )[sub]  # [N]
            pp = torch.tensor(
                [rows[i].params.presence_penalty for i in freq], dtype=torch.float32, device=device
            )[sub]
            r_idx = torch.tensor(freq, device=device)[sub]
            owned()[r_idx, tok] = x[r_idx, tok] - (fp * count.float() + pp)
    return x


def apply_filters(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Temperature, top-k, top-p and min-p for random (temperature > 0) rows, in place.  # [R, V]

    The result's softmax is the distribution a row samples from; dropped tokens are -inf.
    """
    _apply_temperature(logits, params)
    return logits.masked_fill_(logits < _filter_cut(logits, params).threshold, -math.inf)


def top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Keep the top_k largest logits, then the smallest prefix of those (by logit) whose
    probability reaches top_p; the rest become -inf. The most likely token always stays.

    logits [R, V] fp32; top_k [R] int64 in [1, V] (V = off); top_p [R] fp32 in (0, 1] (1 = off).
    Both filters keep every token tied with the last one kept: the result is a logit threshold,
    so it depends on the values only, never on how a sort orders equal logits.
    """
    threshold = _top_k_top_p_cut(logits, top_k, top_p)[0]
    return logits.masked_fill(logits < threshold, -math.inf)


def min_p_filter(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens with p < min_p * p_max, i.e. logit < max logit + log(min_p).  # [R, V]"""
    limit = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # [R, 1]
    return logits.masked_fill(logits < limit, -math.inf)


@dataclass
class _Cut:
    """What the filters keep: the logits >= threshold of each row."""

    threshold: Tensor  # [R, 1]; -inf keeps everything
    # For the rows that ran top-k/top-p: (those rows [S], their C largest logits [S, C]
    # descending, the ids of those [S, C]).
    candidates: tuple[Tensor, Tensor, Tensor] | None = None


def _apply_temperature(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        logits.div_(_host_values(temps, logits.device, torch.float32)[:, None])


def _filter_cut(logits: Tensor, params: Sequence[SamplingParams]) -> _Cut:
    """Thresholds of top-k, top-p and min-p on temperature-scaled logits [R, V]."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    cut = _Cut(threshold=torch.full((num_rows, 1), -math.inf, device=device))
    # Only rows with top-k or top-p pay for the top-C / sort.
    sort_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size or p.top_p < 1.0]
    if sort_rows:
        idx = torch.tensor(sort_rows, device=device)
        top_k = torch.tensor(
            [_top_k(params[i].top_k, vocab_size) for i in sort_rows], device=device
        )
        top_p = torch.tensor(
            [params[i].top_p for i in sort_rows], dtype=torch.float32, device=device
        )
        sub = logits if len(sort_rows) == num_rows else logits[idx]  # [S, V]
        threshold, cand_logits, cand_ids = _top_k_top_p_cut(sub, top_k, top_p)
        cut.threshold[idx] = threshold
        cut.candidates = (idx, cand_logits, cand_ids)
    # Min-p after top-k/top-p: a ratio to the top token, which both keep, so order is moot.
    min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p_rows:
        idx = torch.tensor(min_p_rows, device=device)
        min_p = torch.tensor(
            [params[i].min_p for i in min_p_rows], dtype=torch.float32, device=device
        )
        limit = logits.amax(dim=-1, keepdim=True)[idx] + min_p.log()[:, None]  # [Rm, 1]
        cut.threshold[idx] = torch.maximum(cut.threshold[idx], limit)
    return cut


def _top_k_top_p_cut(logits: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Threshold [R, 1] of top-k/top-p, and the C largest logits [R, C] with their ids [R, C]."""
    vocab_size = logits.shape[1]
    # NOTE: a full sort of [64, 49152] costs ~8x a top-1024 on CPU; the cut almost always falls
    # inside the candidates, and rows where it does not fall back to the full sort.
    num_cand = min(vocab_size, _TOP_P_CANDIDATES)
    cand_logits, cand_ids = logits.topk(num_cand, dim=-1)  # [R, C] descending
    threshold, ok = _cut_threshold(
        logits, cand_logits, top_k, top_p, complete=num_cand == vocab_size
    )
    if not bool(ok.all()):
        rest = (~ok).nonzero()[:, 0]
        full = logits[rest].sort(dim=-1, descending=True).values  # [Rf, V]
        threshold[rest] = _cut_threshold(logits[rest], full, top_k[rest], top_p[rest], True)[0]
    return threshold, cand_logits, cand_ids


def sample_random(
    logits: Tensor, params: Sequence[SamplingParams], seeds: Tensor, positions: Tensor
) -> Tensor:
    """Temperature, filters, then the keyed Gumbel-max; modifies logits.  # [R] token ids"""
    num_rows, vocab_size = logits.shape
    _apply_temperature(logits, params)
    cut = _filter_cut(logits, params)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    on_cand = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    if cut.candidates is not None:
        cand_rows, cand_logits, cand_ids = cut.candidates
        # Rows whose kept tokens all lie among the candidates hash C tokens instead of V: every
        # token outside them is <= the C-th largest logit, below the threshold.
        threshold = cut.threshold[cand_rows]  # [S, 1]
        inside = threshold[:, 0] > cand_logits[:, -1]  # [S]
        if cand_logits.shape[1] == vocab_size:
            inside = torch.ones_like(inside)
        if bool(inside.any()):
            rows = cand_rows[inside]
            kept = cand_logits[inside]  # [Si, C]
            kept = kept.masked_fill(kept < threshold[inside], -math.inf)
            tokens[rows] = gumbel_argmax_at(kept, cand_ids[inside], seeds[rows], positions[rows])
            on_cand[rows] = True
    if not bool(on_cand.all()):
        rows = (~on_cand).nonzero()[:, 0]
        full = logits[rows]  # [Rf, V]
        full.masked_fill_(full < cut.threshold[rows], -math.inf)
        tokens[rows] = gumbel_argmax(full, seeds[rows], positions[rows])
    return tokens


def _cut_threshold(
    logits: Tensor, cand: Tensor, top_k: Tensor, top_p: Tensor, complete: bool
) -> tuple[Tensor, Tensor]:
    """The smallest logit kept by top-k/top-p ([R, 1]) and whether `cand` sufficed ([R] bool).

    cand [R, C] holds the C largest logits of each row in descending order (all V if complete).
    """
    num_cand = cand.shape[1]
    k_known = top_k <= num_cand  # [R]
    kth = cand.gather(1, (top_k.clamp(max=num_cand) - 1)[:, None])  # [R, 1]
    kth = torch.where(k_known[:, None], kth, -math.inf)
    # Top-p renormalizes over what top-k kept. When the k-th logit is above the C-th, top-k keeps
    # candidates only and their logsumexp is the normalizer; otherwise take it over the full row.
    lse = cand.masked_fill(cand < kth, -math.inf).logsumexp(dim=-1, keepdim=True)  # [R, 1]
    k_inside = k_known if complete else k_known & (kth[:, 0] > cand[:, -1])  # [R]
    if not bool(k_inside.all()):
        rest = (~k_inside).nonzero()[:, 0]
        sub = logits if rest.numel() == logits.shape[0] else logits[rest]  # [Rr, V]
        if bool(k_known[rest].any()):
            sub = sub.masked_fill(sub < kth[rest], -math.inf)
        lse[rest] = sub.logsumexp(dim=-1, keepdim=True)
    probs = (cand - lse).exp().masked_fill(cand < kth, 0.0)  # [R, C]
    cum = probs.cumsum(dim=-1)
    p_on = top_p < 1.0  # [R]; 1 is off (rounding can make the sum reach 1 early)
    # Tokens kept by top-p: those with less than top_p of mass strictly before them.
    before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # [R, C], nondecreasing
    num_keep = (before < top_p[:, None]).sum(dim=-1, keepdim=True)  # [R, 1], >= 1
    cut = cand.gather(1, num_keep - 1)  # [R, 1]
    cut = torch.where(p_on[:, None], cut, -math.inf)
    # The candidates suffice if the cut is inside them, or if every token top-k keeps beyond them
    # ties the k-th (then the k-th value is the threshold anyway).
    ok = (top_k == logits.shape[1]) | k_known
    ok &= ~p_on | k_known | (cum[:, -1] >= top_p)
    if complete:
        ok = torch.ones_like(ok)
    return torch.maximum(kth, cut), ok


def _top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _scatter_index(
    token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[Tensor, Tensor]:
    """(row index, token id) of every token of every list, for indexing an [R, V] tensor."""
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.int64)
    tokens = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64)  # [N]
    row_idx = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)  # [N]
    return row_idx.to(device), tokens.to(device)


def _unique_pairs(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct (list index, token id) pairs of the lists and how often each occurs.  # [N]"""
    list_idx, tokens = _scatter_index(token_lists, device)
    keys, counts = torch.unique(list_idx * vocab_size + tokens, return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts
