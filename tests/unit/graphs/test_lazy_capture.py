"""A lazy capture (`cudagraph_capture="lazy"`): the largest graph at start-up, each other one the
first time a batch needs it, captured over padding inputs before that batch is staged, then
replayed like any other. The graph itself is stood in for (CUDA graphs need a GPU: graph replay
against eager with lazy captures is in tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch
from libkk.graphs import capture as capture_module
from libkk.graphs.capture import DecodeGraphs, MixedGraphs
from torch import nn

from tests.models.paged_helpers import build_attn_metadata

HIDDEN = 4


class _Replayed:
    def __init__(self, log: list, name: str, output: torch.Tensor, ids: torch.Tensor) -> None:
        self.log, self.name, self.output, self.ids = log, name, output, ids

    def replay(self) -> None:
        # The static inputs as a replay would read them: each row's output is its token id.
        self.output.copy_(self.ids[:, None].float().expand(-1, HIDDEN))
        self.log.append(("replay", self.name))


@pytest.fixture
def log(monkeypatch):
    """Captures and replays in order; a capture records whether its inputs were padding."""
    events: list = []

    def fake_capture(forward, ids, pos, pool, stash, warm_ups, name):
        events.append(("capture", name, bool((ids == 0).all() and (pos == 0).all())))
        output = torch.zeros(ids.numel(), HIDDEN)
        return _Replayed(events, name, output, ids), output, None

    monkeypatch.setattr(capture_module, "_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return events


def _decode_graphs() -> DecodeGraphs:
    return DecodeGraphs(
        lambda ids, positions: ids, model=nn.Module(), capture_sizes=[1, 2, 4],
        max_blocks_per_seq=2, block_size=4, device=torch.device("cpu"), query_lens=[1, 3],
    )  # fmt: skip


def test_decode_graphs_capture_the_largest_then_each_at_its_first_batch(log):
    graphs = _decode_graphs()
    graphs.capture(progress=False, lazy=True)
    assert log == [("capture", "decode graph q=3 size=4", True)]
    # Two requests decoding one token each: the (1, 2) graph, captured over padding first.
    ids, pos, metadata = build_attn_metadata([([5, 6, 7], 2), ([8, 9], 1)], [[3], [4]], 4)
    assert graphs.can_run(metadata, 2)
    with torch.inference_mode():  # as steps run
        hidden, _ = graphs.run(ids, pos, metadata)
    assert log[1:] == [
        ("capture", "decode graph q=1 size=2", True),
        ("replay", "decode graph q=1 size=2"),
    ]
    assert hidden[:, 0].tolist() == [7.0, 9.0]  # the batch's own rows, staged after the capture
    log.clear()
    with torch.inference_mode():
        graphs.run(ids, pos, metadata)  # captured: replayed straight away
    assert log == [("replay", "decode graph q=1 size=2")]
    assert sorted(graphs.graphs) == [(1, 2), (3, 4)]
    assert graphs.planned == [(3, 4), (3, 2), (1, 4), (3, 1), (1, 2), (1, 1)]


def test_decode_graphs_captured_at_start_up_unless_lazy(log):
    graphs = _decode_graphs()
    assert not graphs.can_run(build_attn_metadata([([5, 6], 1)], [[3]], 4)[2], 1)  # none yet
    graphs.capture(progress=False)
    assert [e[1] for e in log] == [f"decode graph q={q} size={n}" for q, n in graphs.planned]
    assert sorted(graphs.graphs) == sorted(graphs.planned)


def test_mixed_graphs_capture_the_largest_then_each_at_its_first_batch(log):
    graphs = MixedGraphs(
        lambda ids, positions: ids, model=nn.Module(), capture_sizes=[2, 4, 8], max_num_seqs=2,
        max_blocks_per_seq=2, block_size=4, device=torch.device("cpu"),
    )  # fmt: skip
    graphs.capture(progress=False, lazy=True)
    assert log == [("capture", "mixed graph of 8 tokens", False)]  # positions 0..3 per request
    ids, pos, metadata = build_attn_metadata([([5, 6, 7], 0)], [[3]], 4)
    assert graphs.can_run(metadata, 3)
    with torch.inference_mode():
        hidden, _ = graphs.run(ids, pos, metadata)
    assert log[1][:2] == ("capture", "mixed graph of 4 tokens")
    assert log[2:] == [("replay", "mixed graph of 4 tokens")]
    assert hidden[:, 0].tolist() == [5.0, 6.0, 7.0]
    assert sorted(graphs.graphs) == [4, 8]
