"""Random paged-attention batches for kernel tests (CPU interpreter and GPU alike).

A batch is a list of requests given as (query_len, seq_len): each request's context
(seq_len - query_len positions) already sits in the cache, and its query_len new tokens bring
q/k/v rows. Blocks are handed out in a scrambled order, every slot that holds no context is NaN
(the null block too), and new K/V rows are views of one fused qkv tensor, as models produce them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from libkk.kernels import store_kv_ref

from libkk.layers.forward_context import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]; rows past the last request are padding
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], a strided view
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], a strided view
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64; padded rows in the null block or -1
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    k_scale: torch.Tensor  # [1] fp32
    v_scale: torch.Tensor  # [1] fp32
    scale: float
    query_lens: list[int]
    seq_lens_list: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens)

    def attention_args(self, kv_cache: torch.Tensor | None = None) -> tuple:
        """Positional arguments of paged_attention / paged_attention_ref."""
        return (
            self.q, self.kv_cache if kv_cache is None else kv_cache, self.block_table,
            self.seq_lens, self.query_start_loc, self.scale, self.k_scale, self.v_scale,
            self.max_query_len,
        )  # fmt: skip

    def metadata(self) -> AttentionMetadata:
        starts = self.query_start_loc.tolist()
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            block_size=self.kv_cache.shape[2],
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens_list),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(self.seq_lens_list),
        )


def make_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_pad_rows: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // block_size) for _, seq_len in requests]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for n in blocks_per_req:
        tables.append(order[:n])
        order = order[n:]
    width = max(max(blocks_per_req), 1) + 1  # a padded column of null blocks
    table = [t + [0] * (width - len(t)) for t in tables]

    kv_cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.float32
    ).to(device=device, dtype=cache_dtype)
    scales = (torch.tensor([k_scale], device=device), torch.tensor([v_scale], device=device))

    def slot(req: int, pos: int) -> int:
        return tables[req][pos // block_size] * block_size + pos % block_size

    # Context positions, written by the reference store.
    ctx_slots = [slot(i, p) for i, (q, s) in enumerate(requests) for p in range(s - q)]
    if ctx_slots:
        n = len(ctx_slots)
        ctx_kv = torch.randn(2, n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        slots = torch.tensor(ctx_slots, dtype=torch.int64, device=device)
        store_kv_ref(ctx_kv[0], ctx_kv[1], kv_cache, slots, *scales)

    new_slots = [slot(i, p) for i, (q, s) in enumerate(requests) for p in range(s - q, s)]
    pad_slots = [(-1 if r % 2 else r % block_size) for r in range(num_pad_rows)]
    num_tokens = len(new_slots) + num_pad_rows
    width_qkv = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width_qkv, generator=gen).to(device, dtype)
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    starts = [0]
    for q_len, _ in requests:
        starts.append(starts[-1] + q_len)
    return PagedBatch(
        q=q.reshape(num_tokens, num_heads, head_dim),
        k=k.view(num_tokens, num_kv_heads, head_dim),
        v=v.view(num_tokens, num_kv_heads, head_dim),
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(new_slots + pad_slots, dtype=torch.int64, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in requests], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        k_scale=scales[0],
        v_scale=scales[1],
        scale=head_dim**-0.5,
        query_lens=[q for q, _ in requests],
        seq_lens_list=[s for _, s in requests],
    )
