"""DFlash block drafting (arXiv 2602.06036): the proposer that drafts K tokens per request from one
forward of the drafter model (libkk/spec_decode/dflash_model.py), keeping the drafter's paged KV cache of
context features.

Under tensor parallelism every rank runs the same draft calls in step. With
`vocab_parallel_drafting`, drafts whose processing is at most a temperature come from each rank's
LM-head shard (libkk/spec_decode/vocab_parallel.py: one small all-gather per propose); each rank keeps its
shard of the sampled drafts' logits in `shard_drafts` for the verification of the next step, and
the proposal carries no logits for them (the model runner reads q from there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from libkk.distributed import get_tp_size
from libkk.errors import ConfigError
from libkk.layers.attention import attention_backend, store_kv
from libkk.layers.embedding import vocab_parallel_head
from libkk.layers.forward_context import AttentionMetadata
from libkk.sample.sampler import Sampler
from libkk.spec_decode.base import DraftProposal, Proposer, ProposeRequest
from libkk.spec_decode.dflash_model import (
    SHIPPED_DRAFTER,
    SHIPPED_TARGET,
    DFlashDraftModel,
    find_embedding_module,
    load_drafter,
    num_target_layers,
)
from libkk.spec_decode.logits import draft_sampling_rows, position_rows
from libkk.spec_decode.vocab_parallel import (
    ShardDrafts,
    row_covered,
    tp_gather,
    vocab_parallel_draft,
)

_SAMPLER = Sampler()  # stateless; drafts are drawn by the sampler that draws tokens


@dataclass
class _RequestState:
    blocks: list[int] = field(default_factory=list)  # drafter KV blocks, in slot order
    base: int = 0  # the position whose K/V sit in slot 0
    num_context: int = 0  # slots 0..num_context-1 hold positions base..base+num_context-1


class DFlashProposer(Proposer):
    """Drafts with a DFlash drafter; one paged KV cache (its own block pool) for all requests.

    `add_context` writes the context rows' K/V of every drafter layer (features -> k/v -> k-norm
    -> RoPE) once; `propose` runs one block per request over the cached context. The block's own
    K/V go into scratch slots after the context (overwritten by the next context rows).
    """

    def __init__(
        self,
        config: Any,  # EngineConfig; reads config.speculative and config.cache.block_size
        target_model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        spec = getattr(config, "speculative", None)
        path = getattr(spec, "draft_model", None)
        quantization = getattr(spec, "draft_quantization", None) or getattr(
            getattr(config, "model", None), "quantization", None
        )
        if path is None:
            if getattr(getattr(config, "model", None), "model", None) is not None:
                raise ConfigError(
                    "speculative method 'dflash' needs speculative.draft_model (a DFlash drafter "
                    f"folder) for a model other than the default; the shipped drafter is for "
                    f"{SHIPPED_TARGET}"
                )
            path = SHIPPED_DRAFTER
        drafter = load_drafter(path, device, dtype, quantization=quantization)
        cache = getattr(config, "cache", None)
        self._setup(
            drafter,
            target_model,
            num_speculative_tokens=getattr(spec, "num_speculative_tokens", None),
            block_size=getattr(cache, "block_size", 16),
            probabilistic=getattr(spec, "draft_sampling", "greedy") == "probabilistic",
            vocab_parallel=getattr(spec, "vocab_parallel_drafting", False),
        )

    @classmethod
    def from_drafter(
        cls,
        drafter: DFlashDraftModel,
        target_model: nn.Module,
        num_speculative_tokens: int | None = None,
        block_size: int = 16,
        probabilistic: bool = False,
        vocab_parallel: bool = False,
    ) -> DFlashProposer:
        """A proposer around an already built drafter (tests, training, benchmarks)."""
        self = cls.__new__(cls)
        self._setup(
            drafter, target_model, num_speculative_tokens, block_size, probabilistic, vocab_parallel
        )
        return self

    def _setup(
        self,
        drafter: DFlashDraftModel,
        target_model: nn.Module,
        num_speculative_tokens: int | None,
        block_size: int,
        probabilistic: bool = False,
        vocab_parallel: bool = False,
    ) -> None:
        cfg = drafter.config
        embed_module = find_embedding_module(target_model)
        embedding = embed_module.weight
        vocab_size = getattr(embed_module, "vocab_size", embedding.shape[0])
        if embedding.shape[1] != cfg.hidden_size:
            raise ConfigError(
                f"DFlash drafter hidden_size {cfg.hidden_size} does not match the target's "
                f"{embedding.shape[1]}"
            )
        if cfg.mask_token_id >= vocab_size:
            raise ConfigError(
                f"DFlash mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
                f"({vocab_size})"
            )
        num_layers = num_target_layers(target_model)
        if num_layers is not None and max(cfg.target_layer_ids) >= num_layers:
            raise ConfigError(
                f"DFlash target_layer_ids {list(cfg.target_layer_ids)} need layers the target "
                f"lacks (it has {num_layers})"
            )
        if num_speculative_tokens is not None and num_speculative_tokens > cfg.num_drafts:
            raise ConfigError(
                f"num_speculative_tokens={num_speculative_tokens} exceeds what the DFlash drafter "
                f"proposes per block ({cfg.num_drafts} = block_size - 1)"
            )
        self.drafter = drafter
        self.config = cfg
        self.target = target_model
        self.embedding = embedding
        # Under tensor parallelism the lookup is the target's vocab-parallel layer (a collective).
        self.embed_module = embed_module if get_tp_size() > 1 else None
        # `vocab_parallel_drafting`: drafts from each rank's LM-head shard (None: whole rows).
        self.vocab_head = (
            vocab_parallel_head(target_model) if vocab_parallel and get_tp_size() > 1 else None
        )
        # This rank's shard of each sampled request's last drafts (vocab-parallel drafting only).
        self.shard_drafts: dict[str, ShardDrafts] = {}
        self.vocab_size = vocab_size
        self.num_kv_heads = drafter.layers[0].self_attn.num_kv_heads  # this rank's
        self.num_heads = drafter.layers[0].self_attn.num_heads
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.num_drafts = num_speculative_tokens or cfg.num_drafts
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.probabilistic = probabilistic
        self._requests: dict[str, _RequestState] = {}
        self._free: list[int] = []
        self._caches: list[torch.Tensor] = []
        self._grow(64)

    # -- block pool ---------------------------------------------------------------------------

    def _grow(self, num_blocks: int) -> None:
        """Makes the pool `num_blocks` blocks, keeping what it holds (block 0 is the null block)."""
        old = self._caches[0].shape[1] if self._caches else 1
        cfg = self.config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        caches = []
        for i in range(cfg.num_layers):
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self._caches:
                cache[:, :old] = self._caches[i]
            caches.append(cache)
        self._caches = caches
        self._free.extend(range(num_blocks - 1, old - 1, -1))

    def _reserve(self, state: _RequestState, num_positions: int) -> None:
        needed = -(-num_positions // self.block_size)
        while len(state.blocks) < needed:
            if not self._free:
                self._grow(2 * self._caches[0].shape[1])
            state.blocks.append(self._free.pop())

    def _slots(self, state: _RequestState, start: int, count: int) -> torch.Tensor:
        idx = torch.arange(start, start + count)
        table = torch.tensor(state.blocks, dtype=torch.int64)
        slots = table[idx // self.block_size] * self.block_size + idx % self.block_size
        return slots.to(self.device)

    # -- Proposer -----------------------------------------------------------------------------

    @torch.no_grad()
    def add_context(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        expected = len(self.target_layer_ids) * self.config.hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != expected:
            raise ValueError(
                f"request {request_id!r}: context hidden states must be [N, {expected}], "
                f"got {tuple(hidden.shape)}"
            )
        state = self._requests.setdefault(request_id, _RequestState())
        held_end = state.base + state.num_context
        if start_position > held_end or start_position < state.base:
            # A gap (the target skipped positions, e.g. a prefix-cache hit) or context from
            # before what is held: start over from here; earlier positions are simply unseen.
            state.base, state.num_context = start_position, 0
        num = hidden.shape[0]
        if num == 0:
            return
        offset = start_position - state.base  # rows from here on are replaced (rollback)
        self._reserve(state, offset + num)
        positions = torch.arange(start_position, start_position + num, device=self.device)
        feats = self.drafter.features(hidden.to(self.device, self.dtype))  # [N, H]
        slots = self._slots(state, offset, num)
        cfg = self.config
        for cache, (k, v) in zip(
            self._caches, self.drafter.context_kv(feats, positions), strict=True
        ):
            store_kv(
                k.view(num, self.num_kv_heads, cfg.head_dim),
                v.view(num, self.num_kv_heads, cfg.head_dim),
                cache,
                slots,
            )
        state.num_context = offset + num

    @property
    def vocab_parallel(self) -> bool:
        """Whether drafts come from this rank's vocab shard (its runner verifies from them)."""
        return self.vocab_head is not None

    def remove(self, request_id: str) -> None:
        self.shard_drafts.pop(request_id, None)
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    def num_free_blocks(self) -> int:
        return len(self._free)

    @torch.no_grad()
    def propose(self, requests: list[ProposeRequest]) -> DraftProposal:
        token_ids: list[list[int]] = [[] for _ in requests]
        draft_logits: list[torch.Tensor | None] = [None] * len(requests)
        for r in requests:  # these requests' earlier drafts are verified or dropped by now
            self.shard_drafts.pop(r.request_id, None)
        cfg = self.config
        rows = cfg.block_size  # anchor + K masks
        max_pos = cfg.max_position_embeddings
        active = []
        for i, r in enumerate(requests):
            anchor = len(r.token_ids) - 1
            n = min(r.max_drafts, self.num_drafts)
            if n <= 0 or anchor < 0 or anchor + rows > max_pos:
                continue
            state = self._requests.setdefault(r.request_id, _RequestState())
            # Context past the anchor (a rollback) is stale; a context shorter than the anchor
            # (missing hidden states) still drafts, from what it has.
            if anchor < state.base:
                state.base, state.num_context = anchor, 0
            state.num_context = min(state.num_context, anchor - state.base)
            self._reserve(state, state.num_context + rows)
            active.append((i, r, anchor, n, state))
        if not active:
            return DraftProposal(token_ids=token_ids, draft_logits=draft_logits)

        hidden = self._forward_blocks(active)  # [A * (1 + K), H]
        # The MASK rows (all but each block's first) predict the tokens at their positions.
        n_rows = hidden.shape[0]
        keep = torch.arange(n_rows, device=self.device).view(-1, rows)[:, 1:].reshape(-1)
        mask_hidden = hidden[keep].to(self.embedding.dtype)
        num_active, k = len(active), rows - 1
        temps = [self._shard_temperature(a[1]) for a in active]
        full_logits: dict[int, torch.Tensor] = {}  # active index -> [K, vocab]
        if self.vocab_head is None:
            logits = self.target.compute_logits(mask_hidden).float().view(num_active, k, -1)
            drafts = self._sample(logits, active)  # [A, K]
            full_logits = dict(enumerate(logits))
        elif all(t == 0.0 for t in temps):  # greedy drafts: one [rows, 2] gather
            drafts = self.target.greedy_tokens(mask_hidden).view(num_active, k).cpu()
        else:
            drafts, full_logits = self._draft_from_shards(mask_hidden, active, temps)
        for j, (i, _, _, n, _) in enumerate(active):
            token_ids[i] = drafts[j, :n].tolist()
            if self._samples(requests[i]) and j in full_logits:
                draft_logits[i] = full_logits[j][:n]
        return DraftProposal(token_ids=token_ids, draft_logits=draft_logits)

    def _forward_blocks(self, active: list) -> torch.Tensor:
        """The drafter over each active request's block [anchor, MASK x K] at its positions,
        context K/V from its paged cache.  # [A * (1 + K), H]

        Each block row is its own length-1 query over (context + the whole block): attention
        with no causal mask inside the block, on the same paged backends as the target."""
        cfg = self.config
        rows = cfg.block_size  # anchor + K masks
        input_ids, positions, slots, seq_lens, tables = [], [], [], [], []
        width = max(len(s.blocks) for *_, s in active)
        for _, r, anchor, _, state in active:
            input_ids += [r.token_ids[-1]] + [cfg.mask_token_id] * (rows - 1)
            positions += range(anchor, anchor + rows)
            slots.append(self._slots(state, state.num_context, rows))
            seq_lens += [state.num_context + rows] * rows
            tables += [state.blocks + [0] * (width - len(state.blocks))] * rows
        dev = self.device
        n_rows = len(input_ids)
        metadata = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            query_start_loc=torch.arange(n_rows + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(tables, dtype=torch.int32, device=dev),
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=list(range(n_rows + 1)),
            seq_lens_cpu=seq_lens,
        )
        backend = attention_backend(torch.device(dev))
        scale = cfg.head_dim**-0.5

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = backend.forward(
                q.view(n_rows, self.num_heads, cfg.head_dim),
                k.view(n_rows, self.num_kv_heads, cfg.head_dim),
                v.view(n_rows, self.num_kv_heads, cfg.head_dim),
                self._caches[i],
                metadata,
                scale,
            )
            return out.reshape(n_rows, -1)

        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        if self.embed_module is not None:
            embeds = self.embed_module(ids).to(self.dtype)  # [n_rows, H]
        else:
            embeds = F.embedding(ids, self.embedding).to(self.dtype)
        return self.drafter.forward_block(embeds, pos, attend)  # [n_rows, H]

    def _shard_temperature(self, r: ProposeRequest) -> float | None:
        """The temperature a request's drafts take from vocab shards (0: the argmax), or None
        where they need whole rows (penalties, bans, top-k/top-p/min-p of sampled drafts)."""
        if self.vocab_head is None or not r.sampling.keeps_raw_argmax():
            return None
        if not self._samples(r):
            return 0.0  # the argmax of any processing that keeps the raw argmax
        return r.sampling.params.temperature if row_covered(r.sampling, self.vocab_size) else None

    def _draft_from_shards(
        self, mask_hidden: torch.Tensor, active: list, temps: list[float | None]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Drafts [A, K] from this rank's LM-head shard: covered requests through
        vocab_parallel_draft (keeping their shard of q in `shard_drafts`), the rest from
        gathered whole rows; also {active index: [K, vocab] gathered logits} of the rest."""
        head = self.vocab_head
        assert head is not None
        num_active = len(active)
        shard = head(mask_hidden).float()  # [A * K, P]; columns past the shard's ids: padding
        k = shard.shape[0] // num_active
        shard = shard.view(num_active, k, -1)
        drafts = torch.empty(num_active, k, dtype=torch.int64)
        dev = shard.device
        covered = [j for j, t in enumerate(temps) if t is not None]
        full_logits: dict[int, torch.Tensor] = {}
        if covered:
            vocab = head.vocab_shard
            idx = torch.tensor(covered, device=dev)
            mine = shard[idx, :, : len(vocab)]  # [C, K, Vs]
            rows = [active[j][1].sampling for j in covered]
            temperatures = torch.tensor([temps[j] for j in covered], dtype=torch.float32)
            seeds = torch.tensor([row.seed for row in rows], dtype=torch.int64)
            positions = torch.tensor([row.position for row in rows], dtype=torch.int64)
            steps = torch.arange(k, dtype=torch.int64)
            sample = vocab_parallel_draft(
                [mine.reshape(-1, mine.shape[-1])],
                [vocab.start],
                temperatures.repeat_interleave(k).to(dev),
                seeds.repeat_interleave(k).to(dev),
                (positions[:, None] + steps[None, :]).reshape(-1).to(dev),
                gather=tp_gather,
            )
            tokens = sample.token_ids.view(len(covered), k).cpu()
            logprobs = sample.logprobs.view(len(covered), k)
            lse = sample.lse.view(len(covered), k)
            for c, j in enumerate(covered):
                drafts[j] = tokens[c]
                r, n = active[j][1], active[j][3]
                if self._samples(r):
                    self.shard_drafts[r.request_id] = ShardDrafts(
                        token_ids=tokens[c, :n].tolist(),
                        logits=mine[c, :n],
                        logprobs=logprobs[c, :n],
                        lse=lse[c, :n],
                    )
        rest = [j for j, t in enumerate(temps) if t is None]
        if rest:
            idx = torch.tensor(rest, device=dev)
            p = shard.shape[-1]
            logits = head.gather_logits(shard[idx].reshape(-1, p)).view(len(rest), k, -1)
            drafts[idx.cpu()] = self._sample(logits, [active[j] for j in rest])
            full_logits = {j: logits[c] for c, j in enumerate(rest)}
        return drafts, full_logits

    def _sample(self, logits: torch.Tensor, active: list) -> torch.Tensor:
        """Drafts from [A, K, vocab] raw logits, position by position, through the sampler: row
        t is processed as the verifier processes it (penalties counting drafts 0..t-1 as output,
        then temperature and filters); greedy drafts take its argmax, probabilistic ones a keyed
        Gumbel-max on the draft stream (`draft_sampling_rows`)."""
        num_req, k, _ = logits.shape
        drafts: list[list[int]] = [[] for _ in range(num_req)]
        sampled = [self._samples(a[1]) for a in active]
        for t in range(k):
            rows = [position_rows(a[1].sampling, drafts[j], t + 1)[t] for j, a in enumerate(active)]
            tokens = _SAMPLER.sample(logits[:, t], draft_sampling_rows(rows, sampled)).token_ids
            for j, token in enumerate(tokens.tolist()):
                drafts[j].append(token)
        return torch.tensor(drafts, dtype=torch.int64)

    def _samples(self, r: ProposeRequest) -> bool:
        """Whether this request's drafts are sampled (else the argmax: one-hot q)."""
        return self.probabilistic and not r.sampling.params.greedy
