"""Which (query length, size) graphs DecodeGraphs captures, and which one a batch runs in."""

from __future__ import annotations

import torch
from libkk.graphs.capture import DecodeGraphs
from torch import nn


def _graphs(middle_lens_max_size: int | None) -> DecodeGraphs:
    return DecodeGraphs(
        lambda ids, positions: ids,  # never called: nothing is captured here
        model=nn.Module(),
        capture_sizes=[1, 2, 4, 8],
        max_blocks_per_seq=4,
        block_size=16,
        device=torch.device("cpu"),
        query_lens=[1, 2, 3, 4],
        middle_lens_max_size=middle_lens_max_size,
    )


def test_middle_query_lengths_only_for_small_batches() -> None:
    graphs = _graphs(middle_lens_max_size=2)
    # Up to 2 requests every length has a graph; 3 requests pad to the graph of 4, which has
    # only the shortest and the longest length.
    assert graphs.graph_query_len(2, 1) == 2
    assert graphs.graph_query_len(3, 2) == 3
    assert graphs.graph_query_len(2, 3) == 4
    assert graphs.graph_query_len(1, 8) == 1
    assert graphs.graph_query_len(5, 1) is None
    captured = {(q, n) for q in graphs.query_lens for n in graphs.sizes if graphs._captures(q, n)}
    assert captured == {(q, n) for q in (1, 4) for n in (1, 2, 4, 8)} | {
        (q, n) for q in (2, 3) for n in (1, 2)
    }
    # Without a limit: the whole grid.
    every = _graphs(middle_lens_max_size=None)
    assert every.graph_query_len(2, 8) == 2
