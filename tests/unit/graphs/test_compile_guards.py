"""The compiled forward compiles once for every way the runner calls it: eager steps, graph
capture over DecodeGraphs' static inputs and start-up profiling all pass inference tensors, and
one token is a count like any other (the token count is unbacked: no 0/1 specialization)."""

from __future__ import annotations

import torch
from libkk.graphs.capture import DecodeGraphs
from libkk.graphs.compile import MIN_RECOMPILE_LIMIT, CompiledForward
from torch._dynamo.testing import CompileCounter

from libkk import Session
from libkk.layers.forward_context import set_forward_context


def test_graph_inputs_and_step_inputs_share_one_compiled_entry(tiny_qwen3_dir):
    torch._dynamo.reset()
    with Session(str(tiny_qwen3_dir), dtype="float32", max_model_len=128, progress=False) as s:
        model, bs = s.engine.model, s.engine.config.cache.block_size
        counter = CompileCounter()
        forward = CompiledForward(model, backend=counter)
        graphs = DecodeGraphs(forward, model=model, capture_sizes=[1, 2, 4], max_blocks_per_seq=4,
                              block_size=bs, device=torch.device("cpu"))  # fmt: skip
        static = [graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.block_table]
        assert all(t.is_inference() for t in static)
        with torch.inference_mode():
            for size in (4, 2, 1):  # as capture calls it
                with set_forward_context(graphs._metadata(1, size), model):
                    forward(graphs.input_ids[:size], graphs.positions[:size])
            meta = graphs._metadata(1, 3)  # as an eager step calls it: fresh inference tensors
            ids = torch.tensor([5, 6, 7])
            with set_forward_context(meta, model):
                forward(ids, torch.zeros(3, dtype=torch.int64))
    assert counter.frame_count == 1
    assert torch._dynamo.config.recompile_limit >= MIN_RECOMPILE_LIMIT
