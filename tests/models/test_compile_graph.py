"""Under torch.compile the model traces as one graph: attention is one opaque op per layer."""

from __future__ import annotations

import torch

from libkk.models.loader import load_model
from tests.models.paged_helpers import PagedKV, build_attn_metadata


def _step(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), progress=False)
    kv = PagedKV(model, num_blocks=16, block_size=4)
    requests = [([5, 6, 7, 8, 9], 0), ([11, 12, 13], 0)]
    tables = [[3, 7], [5]]
    ids, pos, metadata = build_attn_metadata(requests, tables, 4)
    return model, kv, ids, pos, metadata


def test_the_compiled_forward_has_no_graph_break(tiny_llama_dir):
    from libkk.layers.forward_context import set_forward_context

    model, _, ids, pos, metadata = _step(tiny_llama_dir)
    torch._dynamo.reset()
    with torch.no_grad(), set_forward_context(metadata):
        explained = torch._dynamo.explain(model.forward)(ids, pos)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    attention = (torch.ops.libkk.attention, torch.ops.libkk.attention.default)
    assert sum(op in attention for op in ops) == len(model.attention_layers())


def test_the_compiled_forward_equals_eager(tiny_llama_dir):
    from libkk.layers.forward_context import set_forward_context

    model, kv, ids, pos, metadata = _step(tiny_llama_dir)
    with torch.no_grad(), set_forward_context(metadata):
        eager = model.forward(ids, pos)
        for cache in kv.caches:  # the compiled run must write the KV cache itself
            cache.fill_(float("nan"))
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="aot_eager", dynamic=True)(ids, pos)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
