"""The forward context: per-step attention metadata, set around `model.forward(input_ids, positions)`.

A context keeps the model signature clean and lets graph capture bind static buffers: the
attention layers read the metadata of the step being run from here, not from their arguments.
It is per thread: several sessions in one process, stepped from their own threads, each see only
their own step. It also names the running model's layers (`ModelLayers`), which a compiled
graph's opaque ops look up by their index in that model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from libkk.layers.registry import ModelLayers, model_layers


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the batch and in the paged KV cache.

    The batch is flat: request i owns query rows query_start_loc[i]:query_start_loc[i+1], which are
    its tokens at positions seq_lens[i] - query_len .. seq_lens[i] - 1. Earlier positions are read
    from the KV cache through block_table[i].

    A model with separate KV groups (docs/memory.md) has a slot mapping and a block table per
    group: `group_slot_mappings` / `group_block_tables` stack them, `slot_mapping` and
    `block_table` are group 0's, and a layer reads its group's through `for_group`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset for each token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step (cached + new)
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with the null block 0
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies for the reference path, which loops over requests.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Separate KV groups only (None: one group): [G, num_tokens] int64 and
    # [G, num_reqs, max_blocks_per_req] int32, whose row 0 is slot_mapping / block_table.
    group_slot_mappings: torch.Tensor | None = None
    group_block_tables: torch.Tensor | None = None
    _groups: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def slot_mappings(self) -> torch.Tensor:
        """Every group's slot mapping, [G, num_tokens]."""
        stacked = self.group_slot_mappings
        return self.slot_mapping[None] if stacked is None else stacked

    @property
    def block_tables(self) -> torch.Tensor:
        """Every group's block table, [G, num_reqs, max_blocks_per_req]."""
        stacked = self.group_block_tables
        return self.block_table[None] if stacked is None else stacked

    def with_slot_mappings(self, slot_mappings: torch.Tensor) -> AttentionMetadata:
        """This step's metadata over other slot mappings ([G, num_tokens']: padded rows)."""
        grouped = self.group_slot_mappings is not None
        return replace(
            self,
            slot_mapping=slot_mappings[0],
            group_slot_mappings=slot_mappings if grouped else None,
            _groups={},
        )

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group `group` attends with (this one for group 0)."""
        if group == 0:
            return self
        view = self._groups.get(group)
        if view is None:
            assert self.group_slot_mappings is not None and self.group_block_tables is not None
            view = self._groups[group] = replace(
                self,
                slot_mapping=self.group_slot_mappings[group],
                block_table=self.group_block_tables[group],
                group_slot_mappings=None,
                group_block_tables=None,
                _groups={},
            )
        return view


def grouped_metadata(
    slot_mappings: torch.Tensor, block_tables: torch.Tensor, **fields: object
) -> AttentionMetadata:
    """Metadata over stacked [G, ...] slot mappings and block tables (G >= 1)."""
    groups = slot_mappings.shape[0] > 1
    return AttentionMetadata(
        slot_mapping=slot_mappings[0],
        block_table=block_tables[0],
        group_slot_mappings=slot_mappings if groups else None,
        group_block_tables=block_tables if groups else None,
        **fields,  # type: ignore[arg-type]
    )


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    layers: ModelLayers  # of the model being run


class _ThreadContext(threading.local):
    current: ForwardContext | None = None


_context = _ThreadContext()


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata, model: nn.Module
) -> Iterator[ForwardContext]:
    """The context of one forward of `model`, in this thread."""
    previous = _context.current
    _context.current = ForwardContext(attn_metadata=attn_metadata, layers=model_layers(model))
    try:
        yield _context.current
    finally:
        _context.current = previous


def get_forward_context() -> ForwardContext:
    context = _context.current
    if context is None:
        raise RuntimeError("model.forward called outside set_forward_context(...)")
    return context


def null_prefill_metadata(
    num_tokens: int, block_size: int, device: torch.device, num_kv_groups: int = 1
) -> AttentionMetadata:
    """One request of `num_tokens` tokens living in the null block: what captures run on."""
    num_blocks = -(-num_tokens // block_size)
    return grouped_metadata(
        torch.zeros(num_kv_groups, num_tokens, dtype=torch.int64, device=device),
        torch.zeros(num_kv_groups, 1, num_blocks, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_size=block_size,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens],
    )
