"""Drafting with a smaller model that shares the target's tokenizer.

The drafter is loaded by the same loader into the same model classes and attends through the same
`Attention` layers, over its own paged KV cache (its own block pool and block tables). Per request
it remembers which tokens its cache holds; on each `propose` the longest prefix shared with the
request's tokens is kept (accepted drafts stay, rejected ones are overwritten later), the rest is
run as one catch-up query ending at the anchor, and then one token per round for K - 1 rounds.

Drafts are greedy (argmax of the processed draft logits; one-hot q) or probabilistic (keyed
Gumbel-max on the draft stream, position + DRAFT_POSITION_SALT); the raw logits are returned so the
verifier recomputes q with the same processing (libkk/spec_decode/logits.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from libkk.errors import ConfigError
from libkk.layers.forward_context import AttentionMetadata, set_forward_context
from libkk.models.loader import load_model
from libkk.sample.sampler import Sampler
from libkk.spec_decode.base import DraftProposal, Proposer, ProposeRequest
from libkk.spec_decode.logits import draft_sampling_rows, position_rows

_SAMPLER = Sampler()  # stateless; drafts are drawn by the sampler that draws tokens


def check_vocab_compatible(target_dir: Path | None, target_vocab: int, draft_dir: Path,
                           draft_vocab: int) -> None:  # fmt: skip
    """Raises ConfigError unless the drafter's vocabulary is the target's (same size and, where
    both folders hold a tokenizer.json, the same token -> id map)."""
    if draft_vocab != target_vocab:
        raise ConfigError(
            f"draft_model {str(draft_dir)!r} has vocab_size {draft_vocab} but the target has "
            f"{target_vocab}: the drafter must use the target's tokenizer"
        )
    if target_dir is None:
        return
    vocabs = []
    for folder in (target_dir, draft_dir):
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            return
        data = json.loads(path.read_text())
        added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        vocabs.append((data.get("model", {}).get("vocab"), added))
    if vocabs[0] != vocabs[1]:
        raise ConfigError(
            f"draft_model {str(draft_dir)!r} has a different tokenizer vocabulary than the target "
            f"{str(target_dir)!r}: the drafter must use the target's tokenizer"
        )


class _BlockPool:
    """Free list over the drafter's KV blocks; block 0 is the null block."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        taken = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]
        return taken

    def give(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


class _DraftState:
    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.cached: list[int] = []  # tokens whose KV the drafter's cache holds, from position 0


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: nn.Module,
        *,
        num_speculative_tokens: int,
        probabilistic: bool,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.probabilistic = probabilistic
        self.block_size = block_size
        self.device = device
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # NOTE: as for the target's cache, CPU pages are left untouched (the reference attention
        # reads only written slots) and CUDA memory is zeroed (kernels may read whole blocks).
        make = torch.zeros if device.type == "cuda" else torch.empty
        self.kv_caches = [
            make(shape, dtype=kv_dtype, device=device) for _ in model.attention_layers()
        ]
        for cache in self.kv_caches:
            cache[:, 0].zero_()
        for layer, cache in zip(model.attention_layers(), self.kv_caches, strict=True):
            layer.kv_cache = cache
        self.pool = _BlockPool(num_blocks)
        self.states: dict[str, _DraftState] = {}

    @classmethod
    def load(
        cls,
        draft_dir: Path,
        *,
        target_dir: Path | None,
        target_vocab_size: int,
        num_speculative_tokens: int,
        probabilistic: bool,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        progress: bool = False,
    ) -> DraftModelProposer:
        model, arch = load_model(draft_dir, dtype, device, progress=progress)
        check_vocab_compatible(target_dir, target_vocab_size, draft_dir, arch.vocab_size)
        return cls(
            model,
            num_speculative_tokens=num_speculative_tokens,
            probabilistic=probabilistic,
            num_blocks=num_blocks,
            block_size=block_size,
            device=device,
            kv_dtype=dtype,
        )

    def remove(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.pool.give(state.block_ids)

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> DraftProposal:
        drafts: list[list[int]] = [[] for _ in requests]
        raw: list[list[torch.Tensor]] = [[] for _ in requests]
        # Round 0: each request's catch-up query ending at its anchor; later rounds: one token.
        active: list[int] = []
        queries: list[tuple[list[int], int]] = []  # (tokens, first position)
        for i, r in enumerate(requests):
            if r.max_drafts <= 0 or not r.token_ids:
                continue
            state = self.states.setdefault(r.request_id, _DraftState())
            keep = _common_prefix(state.cached, r.token_ids)
            keep = min(keep, len(r.token_ids) - 1)  # the anchor always runs: its logits draft d_0
            # Slots up to the last draft that runs through the drafter (d_{n-2}).
            if not self._reserve(state, len(r.token_ids) + r.max_drafts - 1):
                self.remove(r.request_id)
                continue
            state.cached = r.token_ids[:keep]
            active.append(i)
            queries.append((r.token_ids[keep:], keep))
        for step in range(self.k):
            if not active:
                break
            logits = self._forward(
                [requests[i].request_id for i in active], queries
            )  # [len(active), vocab]
            self._sample(requests, active, logits, step, drafts, raw)
            next_active, next_queries = [], []
            for i in active:
                r = requests[i]
                state = self.states[r.request_id]
                if len(drafts[i]) < r.max_drafts:
                    next_active.append(i)
                    next_queries.append(([drafts[i][-1]], len(state.cached)))
            active, queries = next_active, next_queries
        draft_logits: list[torch.Tensor | None] = [
            torch.stack(rows) if rows and self._samples(r) else None
            for r, rows in zip(requests, raw, strict=True)
        ]
        return DraftProposal(token_ids=drafts, draft_logits=draft_logits)

    # ---- internals ------------------------------------------------------------------------

    def _samples(self, r: ProposeRequest) -> bool:
        """Whether this request's drafts are sampled (else argmax, one-hot q)."""
        return self.probabilistic and not r.sampling.params.greedy

    def _reserve(self, state: _DraftState, num_slots: int) -> bool:
        need = -(-num_slots // self.block_size) - len(state.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.take(need)
        if blocks is None:
            return False
        state.block_ids.extend(blocks)
        return True

    def _forward(
        self, request_ids: list[str], queries: list[tuple[list[int], int]]
    ) -> torch.Tensor:  # [num_queries, vocab] fp32 logits at each query's last row
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for rid, (tokens, start) in zip(request_ids, queries, strict=True):
            state = self.states[rid]
            for j, t in enumerate(tokens):
                pos = start + j
                input_ids.append(t)
                positions.append(pos)
                slots.append(state.block_ids[pos // bs] * bs + pos % bs)
            state.cached.extend(tokens)
            query_start_loc.append(len(input_ids))
            seq_lens.append(start + len(tokens))
            tables.append(state.block_ids)
        max_blocks = max(-(-s // bs) for s in seq_lens)
        table = torch.zeros((len(tables), max_blocks), dtype=torch.int32)
        for i, ids in enumerate(tables):
            n = min(len(ids), max_blocks)
            table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=table.to(dev),
            block_size=bs,
            max_query_len=max(len(t) for t, _ in queries),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        with set_forward_context(metadata, self.model):
            hidden = self.model(ids_t, pos_t)  # [num_tokens, hidden]
        last = torch.tensor(query_start_loc[1:], device=dev) - 1
        return self.model.compute_logits(hidden[last]).float()

    def _sample(
        self,
        requests: list[ProposeRequest],
        active: list[int],
        logits: torch.Tensor,  # [len(active), vocab] raw
        step: int,
        drafts: list[list[int]],
        raw: list[list[torch.Tensor]],
    ) -> None:
        rows = [position_rows(requests[i].sampling, drafts[i], step + 1)[step] for i in active]
        sampled = [self._samples(requests[i]) for i in active]
        tokens = _SAMPLER.sample(logits, draft_sampling_rows(rows, sampled)).token_ids  # [A]
        for j, (i, token) in enumerate(zip(active, tokens.tolist(), strict=True)):
            drafts[i].append(token)
            raw[i].append(logits[j])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
