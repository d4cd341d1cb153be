"""FULL CUDA graphs of the model forward for uniform decode batches.

A uniform decode batch has one new token per request. Such a batch of n requests is padded to the
smallest capture size >= n (a precomputed table) and replayed from static input buffers. Padded
rows are requests of length 1 that live in the null block: their K/V writes are skipped and their
outputs ignored. All graphs share one memory pool and are captured largest first, so smaller ones
reuse the larger ones' memory; the static buffers and each graph's output stay referenced for the
graphs' life.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from libkk.layers.forward_context import AttentionMetadata, set_forward_context

DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8))


def padded_size_table(sizes: Sequence[int]) -> list[int]:
    """table[n] = the smallest capture size >= n, for n in 0..max(sizes)."""
    ordered = sorted(set(sizes))
    table, i = [ordered[0]], 0
    for n in range(1, ordered[-1] + 1):
        while ordered[i] < n:
            i += 1
        table.append(ordered[i])
    return table


class DecodeGraphs:
    """Captured forwards for decode batches of up to `max(capture_sizes)` requests."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        capture_sizes: Sequence[int],
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if not capture_sizes:
            raise ValueError("capture_sizes is empty")
        self.forward = forward  # model.forward(input_ids, positions), compiled or not
        self.sizes = sorted(set(capture_sizes))
        self.max_size = self.sizes[-1]
        self.pad_to = padded_size_table(self.sizes)
        self.block_size = block_size
        n, dev = self.max_size, device
        # Static inputs. Rows past a batch's size keep the padding values set here: token 0 at
        # position 0, writing to slot 0 (the null block), attending to itself alone.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.block_table.shape[1] * self.block_size,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
        )

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        for size in tqdm(
            list(reversed(self.sizes)),
            desc="Capturing CUDA graphs",
            unit="graph",
            disable=not progress,
        ):
            metadata = self._metadata(size)
            ids, pos = self.input_ids[:size], self.positions[:size]
            with set_forward_context(metadata):
                for _ in range(2):  # compiles the kernels and settles allocations
                    self.forward(ids, pos)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[size] = self.forward(ids, pos)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        return (
            bool(self.graphs)
            and metadata.max_query_len == 1
            and num_tokens == metadata.num_reqs <= self.max_size
            and metadata.block_table.shape[1] <= self.block_table.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [num_reqs, hidden]
        n = metadata.num_reqs
        size = self.pad_to[n]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        width = metadata.block_table.shape[1]
        # Columns past `width` may hold older tables; the kernels read only blocks < seq_len.
        self.block_table[:n, :width].copy_(metadata.block_table)
        if size > n:  # rows a previous, larger batch used: back to padding
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
            self.block_table[n:size, 0].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]
