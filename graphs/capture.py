"""FULL CUDA graphs of the model forward: DecodeGraphs for uniform decode and verification
batches, MixedGraphs (cudagraph_mode "FULL") for batches of any composition up to the largest
capture size in tokens.

One graph is captured per (query length Q, batch size): Q = 1 for plain decode, 1 + K to verify K
drafts. A batch of n requests runs in the smallest captured Q that holds its longest request and
the smallest capture size >= n (a precomputed table), replayed from static input buffers:
- padded requests have Q tokens that live in the null block: their K/V writes are skipped and
  their outputs ignored;
- a request with fewer than Q tokens (fewer drafts than K, or a decode row beside verifying rows)
  gets its rows at the head of its Q slots and padding rows after them, which write to the null
  slot and extend its sequence by the missing positions; causal masking keeps its real rows from
  seeing them, so they are exact, and only the real rows are returned.
All graphs share one memory pool and are captured largest first, so smaller ones reuse the larger
ones' memory; the static buffers and each graph's output stay referenced for the graphs' life.
A lazy capture (`capture(lazy=True)`) captures the largest graph only, which sets the pool's size,
and each other graph the first time a batch needs it, over padding inputs as at start-up, before
the batch's inputs are staged.

Under tensor parallelism each graph holds the forward's NCCL collectives, so every rank must
capture the same graphs in the same order (NCCL requires a captured collective to be captured on
every rank, and a replay to be one on every rank): the ranks check the whole plan, then meet
before each graph (`lockstep`, which fails with the graph named if a rank stops or differs). Each
graph is tracked for the group's teardown (NCCL cannot destroy a communicator a live graph uses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from libkk.kernels import NeedsWarmUp
from torch import nn
from tqdm import tqdm

from libkk.distributed import lockstep, track_captured_graph
from libkk.layers.forward_context import (
    AttentionMetadata,
    grouped_metadata,
    set_forward_context,
)

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


def sizes_up_to(sizes: Sequence[int], n: int) -> list[int]:
    """The sizes a batch of at most n can pad to: those below n and the smallest >= n."""
    ordered = sorted(set(sizes))
    above = [s for s in ordered if s >= n]
    return [s for s in ordered if s < n] + above[:1]


class DecodeGraphs:
    """Captured forwards for uniform batches of up to `max(capture_sizes)` requests.

    A uniform batch gives every request the same query length q: 1 for plain decode, 1 + K when
    every request verifies K drafts. One graph is captured per (q, size) for q in `query_lens`,
    except that lengths between the shortest and the longest are captured only for sizes up to
    `middle_lens_max_size` (when given): larger batches pad to the longest.
    `stash`, if given, returns a tensor the forward leaves beside its output (the hidden states
    of chosen layers for a drafter); its per-graph instance is kept and returned by `run`.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        model: nn.Module,
        capture_sizes: Sequence[int],
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        query_lens: Sequence[int] = (1,),
        middle_lens_max_size: int | None = None,
        stash: Callable[[], torch.Tensor | None] | None = None,
        num_kv_groups: int = 1,
    ) -> None:
        if not capture_sizes:
            raise ValueError("capture_sizes is empty")
        if not query_lens or min(query_lens) < 1:
            raise ValueError(f"query_lens must be >= 1, got {list(query_lens)}")
        self.forward = forward  # model.forward(input_ids, positions), compiled or not
        self.model = model  # whose forward `forward` runs (the captures' forward context)
        self.stash = stash
        self.sizes = sorted(set(capture_sizes))
        self.query_lens = sorted(set(query_lens))
        # Lengths between the shortest and the longest: graphs of up to this many requests only.
        self.middle_lens_max_size = middle_lens_max_size
        self.max_size = self.sizes[-1]
        self.pad_to = padded_size_table(self.sizes)
        self.block_size = block_size
        n, dev, g = self.max_size, device, num_kv_groups
        t = n * self.query_lens[-1]
        # Static inputs. Rows past a batch's size keep the padding values set here: token 0 at
        # position 0, writing to slot 0 (the null block), attending to the null block alone.
        # Made as inference tensors, like every step's inputs: a compiled forward guards on the
        # inputs' dispatch keys, and normal tensors here would compile it a second time.
        with torch.inference_mode():
            self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
            # Every KV group's slot mapping and block table (docs/memory.md).
            self.slot_mapping = torch.zeros(g, t, dtype=torch.int64, device=dev)
            self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
            self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=dev)
            self.block_table = torch.zeros(g, n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        # The (q, size) graphs to capture, largest first: smaller graphs reuse its memory.
        self.planned = [
            (q, size)
            for q in reversed(self.query_lens)
            for size in reversed(self.sizes)
            if self._captures(q, size)
        ]
        self.planned.sort(key=lambda k: -k[0] * k[1])
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.stashed: dict[tuple[int, int], torch.Tensor | None] = {}
        self.pool = None
        self._q = 0  # the query length the request-level buffers are laid out for

    def _layout(self, q: int) -> None:
        """Lays the request-level padding out for query length q (cheap; only when q changes)."""
        if q != self._q:
            n = self.max_size
            self.query_start_loc.copy_(torch.arange(n + 1, dtype=torch.int32) * q)
            self.seq_lens.fill_(q)
            self._q = q

    def _metadata(self, q: int, size: int) -> AttentionMetadata:
        return grouped_metadata(
            self.slot_mapping[:, : size * q],
            self.block_table[:, :size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_size=self.block_size,
            max_query_len=q,
            max_seq_len=self.block_table.shape[2] * self.block_size,
            query_start_loc_cpu=[i * q for i in range(size + 1)],
            seq_lens_cpu=[q] * size,
        )

    @torch.inference_mode()
    def capture(self, progress: bool = True, lazy: bool = False) -> None:
        """Captures the planned graphs (lazy: the largest alone; `run` captures the others)."""
        self.pool = torch.cuda.graph_pool_handle()
        keys = self.planned[:1] if lazy else self.planned
        lockstep(f"decode graph plan (q, size): {keys}")
        bar = tqdm(keys, desc="Capturing CUDA graphs", unit="graph", disable=not progress)
        for i, (q, size) in enumerate(bar):
            # The first graph's two warm-ups compile the forward, if compiled (torch.compile is
            # lazy), and make the one-time state (cuBLAS workspaces, allocator blocks, loaded
            # kernels). Later graphs capture straight away (their own kernel variants load
            # during capture), unless an op needs a run outside capture first.
            self._capture_one(q, size, warm_ups=2 if i == 0 else 0)
        torch.cuda.synchronize()

    def _ensure(self, q: int, size: int) -> None:
        """Captures the (q, size) graph if it is not yet (a lazy capture), over padding inputs."""
        if (q, size) not in self.graphs:
            self._stage_padding(q, size)
            self._capture_one(q, size, warm_ups=0)

    def _capture_one(self, q: int, size: int, warm_ups: int) -> None:
        ids, pos = self.input_ids[: size * q], self.positions[: size * q]
        name = f"decode graph q={q} size={size}"
        self._layout(q)
        with set_forward_context(self._metadata(q, size), self.model):
            try:
                captured = _capture(self.forward, ids, pos, self.pool, self.stash, warm_ups, name)
            except NeedsWarmUp:
                captured = _capture(self.forward, ids, pos, self.pool, self.stash, 1, name)
        graph, self.outputs[q, size], self.stashed[q, size] = captured
        self.graphs[q, size] = graph

    def _stage_padding(self, q: int, size: int) -> None:
        """The (q, size) graph's inputs as padding rows alone: token 0 at position 0, writing and
        reading the null block."""
        self._layout(q)
        t = size * q
        self.input_ids[:t].zero_()
        self.positions[:t].zero_()
        self.slot_mapping[:, :t].zero_()
        self.seq_lens[:size].fill_(q)
        self.block_table[:, :size].zero_()

    def _captures(self, q: int, size: int) -> bool:
        limit = self.middle_lens_max_size
        ends = (self.query_lens[0], self.query_lens[-1])
        return q in ends or limit is None or size <= limit

    def graph_query_len(self, max_query_len: int, num_reqs: int) -> int | None:
        """The smallest query length >= max_query_len captured for num_reqs requests (padded to
        a captured size; None: none is)."""
        size = self.pad_to[min(num_reqs, self.max_size)]
        return next(
            (q for q in self.query_lens if q >= max_query_len and self._captures(q, size)), None
        )

    def can_run(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        n = metadata.num_reqs
        q = self.graph_query_len(metadata.max_query_len, n)
        if (
            self.pool is None  # not captured
            or q is None
            or n > self.max_size
            or metadata.block_table.shape[1] > self.block_table.shape[2]
        ):
            return False
        if num_tokens == n * q:
            return True
        # Ragged: padding rows extend each short request's sequence; it must fit the block table.
        capacity = self.block_table.shape[2] * self.block_size
        starts = metadata.query_start_loc_cpu
        return all(
            seq_len + q - (starts[i + 1] - starts[i]) <= capacity
            for i, seq_len in enumerate(metadata.seq_lens_cpu)
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [num_tokens, hidden], the stash's rows or None) of the replayed graph."""
        n = metadata.num_reqs
        q = self.graph_query_len(metadata.max_query_len, n)
        assert q is not None
        size = self.pad_to[n]
        self._ensure(q, size)
        t = input_ids.shape[0]
        self._layout(q)
        rows: torch.Tensor | None = None  # the real rows' places in a ragged batch
        if t == n * q:
            self.input_ids[:t].copy_(input_ids)
            self.positions[:t].copy_(positions)
            self.slot_mapping[:, :t].copy_(metadata.slot_mappings)
            self.seq_lens[:n].copy_(metadata.seq_lens)
        else:
            starts = metadata.query_start_loc_cpu
            lens = [starts[i + 1] - starts[i] for i in range(n)]
            rows = torch.tensor(
                [i * q + j for i, num in enumerate(lens) for j in range(num)],
                device=self.input_ids.device,
            )
            for buffer, real in (
                (self.input_ids[None], input_ids[None]),
                (self.positions[None], positions[None]),
                (self.slot_mapping, metadata.slot_mappings),
            ):
                buffer[:, : n * q].zero_()  # padding rows: token 0 at position 0, the null slot
                buffer.index_copy_(1, rows, real)
            padded_lens = [s + q - num for s, num in zip(metadata.seq_lens_cpu, lens, strict=True)]
            self.seq_lens[:n].copy_(torch.tensor(padded_lens, dtype=torch.int32))
        width = metadata.block_table.shape[1]
        # Columns past `width` may hold older tables; real rows read only blocks < their seq_len.
        self.block_table[:, :n, :width].copy_(metadata.block_tables)
        if size > n:  # rows a previous, larger batch used: back to padding
            self.input_ids[n * q : size * q].zero_()
            self.positions[n * q : size * q].zero_()
            self.slot_mapping[:, n * q : size * q].zero_()
            self.seq_lens[n:size].fill_(q)
            self.block_table[:, n:size, 0].zero_()
        self.graphs[q, size].replay()
        hidden, stashed = self.outputs[q, size], self.stashed[q, size]
        if rows is None:
            return hidden[:t], None if stashed is None else stashed[:t]
        return hidden[rows], None if stashed is None else stashed[rows]

    def replay_padding(self, size: int, q: int) -> torch.Tensor:
        """Replays the (q, size) graph on padding rows alone (token 0 at position 0, writing and
        reading the null block) and returns its output [size * q, hidden]: the graph's device
        work with no request touched, for cost profiles."""
        self._ensure(q, size)
        self._stage_padding(q, size)
        self.graphs[q, size].replay()
        return self.outputs[q, size]


class MixedGraphs:
    """Captured forwards for batches of any composition (prefill chunks beside decode and
    verification rows), one per token count in `capture_sizes` (2 and up: one token is a
    uniform batch, which DecodeGraphs serves).

    Attention reads everything that varies per step from device buffers (query starts, lengths,
    block tables), and its varlen kernel's grid depends only on the token count and the number
    of request slots, so one graph per padded token count serves every split of those tokens
    into requests. A graph of T tokens has min(T, max_num_seqs) + 1 request slots: the batch's
    n requests first, then a padding request that holds the T - t padding tokens (token 0,
    writing to the null slot, attending to the null block alone, as DecodeGraphs' padding
    rows), then empty requests (no tokens, no context), which attention skips.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        model: nn.Module,
        capture_sizes: Sequence[int],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        stash: Callable[[], torch.Tensor | None] | None = None,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        # A request slot holds at most a block table row of tokens: a size whose tokens the
        # slots cannot hold (a long-context step of few requests) is not captured.
        self.capacity = max_blocks_per_seq * block_size
        self.sizes = sorted(
            {s for s in capture_sizes if s >= 2 and self._slots(s) * self.capacity >= s}
        )
        if not self.sizes:
            raise ValueError(f"no capture size of 2 tokens or more in {list(capture_sizes)}")
        self.forward = forward
        self.model = model
        self.stash = stash
        self.max_size = self.sizes[-1]
        self.pad_to = padded_size_table(self.sizes)
        self.block_size = block_size
        t, r, g = self.max_size, self._slots(self.max_size), num_kv_groups
        with torch.inference_mode():  # inference tensors, as in DecodeGraphs
            self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
            self.positions = torch.zeros(t, dtype=torch.int64, device=device)
            self.slot_mapping = torch.zeros(g, t, dtype=torch.int64, device=device)
            self.padding_positions = torch.arange(t, dtype=torch.int64, device=device)
            self.query_start_loc = torch.zeros(r + 1, dtype=torch.int32, device=device)
            self.seq_lens = torch.zeros(r, dtype=torch.int32, device=device)
            self.block_table = torch.zeros(
                g, r, max_blocks_per_seq, dtype=torch.int32, device=device
            )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.stashed: dict[int, torch.Tensor | None] = {}
        self.pool = None

    def _slots(self, size: int) -> int:
        return min(size, self.max_num_seqs) + 1

    def _metadata(self, size: int, starts: list[int], seq_lens: list[int]) -> AttentionMetadata:
        r = self._slots(size)
        return grouped_metadata(
            self.slot_mapping[:, :size],
            self.block_table[:, :r],
            query_start_loc=self.query_start_loc[: r + 1],
            seq_lens=self.seq_lens[:r],
            block_size=self.block_size,
            # The graph's own choice of attention kernel, right for any split of its tokens:
            # more request slots than one, so never the uniform decode path.
            max_query_len=size,
            max_seq_len=self.block_table.shape[2] * self.block_size,
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )

    def can_run(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        return (
            self.pool is not None  # captured
            and 2 <= num_tokens <= self.max_size
            and self.pad_to[num_tokens] - num_tokens <= self.capacity  # one padding request
            and metadata.num_reqs <= self.max_num_seqs
            and metadata.block_table.shape[1] <= self.block_table.shape[2]
        )

    def stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[int, AttentionMetadata]:
        """Writes a batch into the static inputs, padded to its graph's token count; returns that
        count and the metadata the graph reads (host lists included, for the reference path)."""
        t, n = input_ids.shape[0], metadata.num_reqs
        size = self.pad_to[t]
        r, pad = self._slots(size), size - t
        self.input_ids[:t].copy_(input_ids)
        self.input_ids[t:size].zero_()
        self.positions[:t].copy_(positions)
        self.positions[t:size].copy_(self.padding_positions[:pad])
        self.slot_mapping[:, :t].copy_(metadata.slot_mappings)
        self.slot_mapping[:, t:size].zero_()
        self.query_start_loc[: n + 1].copy_(metadata.query_start_loc)
        self.query_start_loc[n + 1 : r + 1].fill_(size)  # the padding request ends at size
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n].fill_(pad)
        self.seq_lens[n + 1 : r].zero_()
        # Columns past `width` may hold older tables; real rows read only blocks < their seq_len.
        self.block_table[:, :n, : metadata.block_table.shape[1]].copy_(metadata.block_tables)
        self.block_table[:, n].zero_()
        starts = [*metadata.query_start_loc_cpu, *([size] * (r - n))]
        seq_lens = [*metadata.seq_lens_cpu, pad, *([0] * (r - n - 1))]
        return size, self._metadata(size, starts, seq_lens)

    @torch.inference_mode()
    def capture(
        self, progress: bool = True, pool: object | None = None, lazy: bool = False
    ) -> None:
        """Captures every size, largest first, in `pool` (DecodeGraphs' pool: one for all); lazy:
        the largest alone (`run` captures the others)."""
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        sizes = sorted(self.sizes, reverse=True)[: 1 if lazy else None]
        lockstep(f"mixed graph plan (tokens): {sizes}")
        for i, size in enumerate(tqdm(sizes, desc="Capturing mixed-batch CUDA graphs",
                                      unit="graph", disable=not progress)):  # fmt: skip
            self._capture_one(size, warm_ups=2 if i == 0 else 0)
        torch.cuda.synchronize()

    def _capture_one(self, size: int, warm_ups: int) -> None:
        metadata = self._padding_only(size)
        ids, pos = self.input_ids[:size], self.positions[:size]
        name = f"mixed graph of {size} tokens"
        with set_forward_context(metadata, self.model):
            try:  # warm-ups as DecodeGraphs: the first graph, or an op that asks
                captured = _capture(self.forward, ids, pos, self.pool, self.stash, warm_ups, name)
            except NeedsWarmUp:
                captured = _capture(self.forward, ids, pos, self.pool, self.stash, 1, name)
        self.graphs[size], self.outputs[size], self.stashed[size] = captured

    def _padding_only(self, size: int) -> AttentionMetadata:
        """Lays out a capture: the graph's tokens as padding requests in the null block, each as
        long as a block table row holds (and its positions in range), the other slots empty."""
        r, capacity = self._slots(size), self.capacity
        counts = [min(capacity, max(size - i * capacity, 0)) for i in range(r)]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        self.input_ids[:size].zero_()
        self.positions[:size].copy_(torch.cat([self.padding_positions[:c] for c in counts if c]))
        self.slot_mapping[:, :size].zero_()
        self.query_start_loc[: r + 1].copy_(torch.tensor(starts, dtype=torch.int32))
        self.seq_lens[:r].copy_(torch.tensor(counts, dtype=torch.int32))
        self.block_table[:, :r].zero_()
        return self._metadata(size, starts, counts)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [num_tokens, hidden], the stash's rows or None) of the replayed graph."""
        t = input_ids.shape[0]
        if self.pad_to[t] not in self.graphs:  # a lazy capture: before the batch is staged
            self._capture_one(self.pad_to[t], warm_ups=0)
        size, _ = self.stage(input_ids, positions, metadata)
        self.graphs[size].replay()
        stashed = self.stashed[size]
        return self.outputs[size][:t], None if stashed is None else stashed[:t]


def _capture(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    pos: torch.Tensor,
    pool: object,
    stash: Callable[[], torch.Tensor | None] | None,
    warm_ups: int,
    name: str,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
    """(graph, its output, its stash) of one forward over the static inputs, under the forward
    context already set; raises NeedsWarmUp (the partial capture reset) if an op needs a run
    outside capture first."""
    if warm_ups:
        lockstep(f"{name}: warm-up")
        for _ in range(warm_ups):
            forward(ids, pos)
        torch.cuda.synchronize()
    lockstep(f"{name}: capture")  # every rank captures the same collectives
    graph = torch.cuda.CUDAGraph()
    track_captured_graph(graph)  # before: a failed capture is reset too
    try:
        with torch.cuda.graph(graph, pool=pool):
            output = forward(ids, pos)
            stashed = stash() if stash else None
    except NeedsWarmUp:
        graph.reset()  # the partial capture: its memory goes back to the pool
        raise
    return graph, output, stashed
