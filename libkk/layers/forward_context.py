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
from dataclasses import dataclass

import torch
from torch import nn

from libkk.layers.registry import ModelLayers, model_layers


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the batch and in the paged KV cache.

    The batch is flat: request i owns query rows query_start_loc[i]:query_start_loc[i+1], which are
    its tokens at positions seq_lens[i] - query_len .. seq_lens[i] - 1. Earlier positions are read
    from the KV cache through block_table[i].
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

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


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
    num_tokens: int, block_size: int, device: torch.device
) -> AttentionMetadata:
    """One request of `num_tokens` tokens living in the null block: what captures run on."""
    num_blocks = -(-num_tokens // block_size)
    return AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_table=torch.zeros(1, num_blocks, dtype=torch.int32, device=device),
        block_size=block_size,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens],
    )
