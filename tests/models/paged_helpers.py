"""A tiny paged-KV harness for model tests: allocate caches, build metadata, run one flat step.

It does by hand what the model runner does: every request owns a list of KV blocks (handed out in
a scrambled order so block tables are never contiguous), and one step runs the new tokens of all
requests as one flat batch under `set_forward_context`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from libkk.layers.forward_context import AttentionMetadata, set_forward_context

NULL_BLOCK = 0


@dataclass
class PagedRequest:
    """Tokens of one sequence; the first `num_cached` already sit in the KV cache."""

    token_ids: list[int]
    num_cached: int = 0
    blocks: list[int] = field(default_factory=list)


def build_attn_metadata(
    requests: list[tuple[list[int], int]],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [T], positions [T], metadata) for requests given as (token_ids, num_cached).

    Request i contributes its tokens num_cached..len(token_ids)-1; `block_tables[i]` must cover
    len(token_ids) slots.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    for (token_ids, num_cached), blocks in zip(requests, block_tables, strict=True):
        seq_len = len(token_ids)
        assert 0 <= num_cached < seq_len, "every request must bring at least one new token"
        assert len(blocks) * block_size >= seq_len, "block table too short"
        for pos in range(num_cached, seq_len):
            input_ids.append(token_ids[pos])
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        starts.append(len(input_ids))
        seq_lens.append(seq_len)
    width = max(len(b) for b in block_tables)
    table = [b + [NULL_BLOCK] * (width - len(b)) for b in block_tables]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        block_size=block_size,
        max_query_len=max(b - a for a, b in zip(starts, starts[1:], strict=False)),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return ids, pos, metadata


class PagedKV:
    """KV caches for every attention layer of `model`, bound in place, plus a block allocator."""

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int = 64,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.caches: list[torch.Tensor] = []
        for attn in model.attention_layers():
            # [2, num_blocks, block_size, num_kv_heads, head_dim]; NaN so a read of an unwritten
            # slot would poison the output instead of passing silently.
            cache = torch.full(
                (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim),
                float("nan"),
                dtype=dtype,
                device=device,
            )
            attn.kv_cache = cache
            self.caches.append(cache)
        order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
        self.free_blocks = order.tolist()  # block 0 is the null block

    def allocate(self, request: PagedRequest) -> None:
        needed = -(-len(request.token_ids) // self.block_size)
        while len(request.blocks) < needed:
            request.blocks.append(self.free_blocks.pop())

    @torch.no_grad()
    def step(self, requests: list[PagedRequest]) -> tuple[torch.Tensor, list[int]]:
        """Runs the uncached tokens of every request as one flat batch.

        Returns (hidden [T, hidden], row of each request's last token) and marks all tokens cached.
        """
        for r in requests:
            self.allocate(r)
        input_ids, positions, metadata = build_attn_metadata(
            [(r.token_ids, r.num_cached) for r in requests],
            [r.blocks for r in requests],
            self.block_size,
            self.device,
        )
        with set_forward_context(metadata, self.model):
            hidden = self.model(input_ids, positions)
        for r in requests:
            r.num_cached = len(r.token_ids)
        last_rows = [end - 1 for end in metadata.query_start_loc_cpu[1:]]
        return hidden, last_rows

    def prefill_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits [len(prompt), vocab] of every position of each prompt, all in one flat step."""
        requests = [PagedRequest(list(p)) for p in prompts]
        hidden, _ = self.step(requests)
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        return list(logits.split([len(p) for p in prompts]))

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        """Prefill, then decode one token per step through the paged cache."""
        request = PagedRequest(list(prompt))
        out: list[int] = []
        for _ in range(steps):
            hidden, last = self.step([request])
            token = int(self.model.compute_logits(hidden[last]).argmax(-1)[0])
            out.append(token)
            request.token_ids.append(token)
        return out
