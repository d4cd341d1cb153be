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


def _one_graph_ops(model, ids, pos, metadata) -> list:
    """The functions the traced forward calls, asserting it traced as one graph, unbroken."""
    from libkk.layers.forward_context import set_forward_context

    torch._dynamo.reset()
    with torch.no_grad(), set_forward_context(metadata, model):
        explained = torch._dynamo.explain(model.forward)(ids, pos)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    return [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]


def test_the_compiled_forward_has_no_graph_break(tiny_llama_dir):
    model, _, ids, pos, metadata = _step(tiny_llama_dir)
    ops = _one_graph_ops(model, ids, pos, metadata)
    attention = (torch.ops.libkk.attention, torch.ops.libkk.attention.default)
    assert sum(op in attention for op in ops) == len(model.attention_layers())


def test_the_compiled_forward_equals_eager(tiny_llama_dir):
    from libkk.layers.forward_context import set_forward_context

    model, kv, ids, pos, metadata = _step(tiny_llama_dir)
    with torch.no_grad(), set_forward_context(metadata, model):
        eager = model.forward(ids, pos)
        for cache in kv.caches:  # the compiled run must write the KV cache itself
            cache.fill_(float("nan"))
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="aot_eager", dynamic=True)(ids, pos)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_piecewise_backend_splits_at_attention_and_equals_eager(tiny_llama_dir):
    """The piecewise backend cuts the graph at each attention op; the pieces (compiled by a
    stand-in compiler on CPU, where no graphs are captured) give the eager result."""
    from libkk.graphs.piecewise import PiecewiseBackend
    from torch._dynamo.backends.common import aot_autograd

    from libkk.layers.forward_context import set_forward_context

    compiled_pieces = []

    def compile_piece(gm, example_inputs):
        compiled_pieces.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    model, kv, ids, pos, metadata = _step(tiny_llama_dir)
    backend = PiecewiseBackend(sizes=[8], compile_piece=compile_piece)
    with torch.no_grad(), set_forward_context(metadata, model):
        eager = model.forward(ids, pos)
        for cache in kv.caches:
            cache.fill_(float("nan"))
        torch._dynamo.reset()
        out = torch.compile(model.forward, backend=backend, dynamic=True)(ids, pos)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    num_layers = len(model.attention_layers())
    assert len(backend.pieces) == num_layers + 1
    for gm in compiled_pieces:  # no piece holds an attention call
        assert not any("libkk.attention" in str(n.target) for n in gm.graph.nodes)


def test_piecewise_pieces_compile_once_for_every_token_count(tiny_llama_dir):
    """Through CompiledForward (the token count unbacked) the piecewise backend splits and
    compiles the graph once; a one-token decode step reuses it and equals eager."""
    from libkk.graphs.compile import CompiledForward
    from libkk.graphs.piecewise import PiecewiseBackend
    from torch._dynamo.backends.common import aot_autograd

    from libkk.layers.forward_context import set_forward_context

    def compile_piece(gm, example_inputs):
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    model, kv, ids, pos, metadata = _step(tiny_llama_dir)
    backend = PiecewiseBackend(sizes=[1, 8], compile_piece=compile_piece)
    torch._dynamo.reset()
    forward = CompiledForward(model, backend=backend)
    decode = build_attn_metadata([([5, 6, 7, 8, 9, 10], 5)], [[3, 7]], 4)  # request 0's next token
    with torch.no_grad():
        with set_forward_context(metadata, model):
            forward(ids, pos)  # the prefill fills the cache
        d_ids, d_pos, d_meta = decode
        with set_forward_context(d_meta, model):
            eager = model.forward(d_ids, d_pos)
            out = forward(d_ids, d_pos)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert len(backend.pieces) == len(model.attention_layers()) + 1  # one split, no recompile


def test_piecewise_compile_traces_the_model_once(tiny_llama_dir):
    """The norms' eps floats stay constants in the plain torch.compile path too (as when
    precompiling): made symbolic, Dynamo restarts its analysis from inside the backend's first
    piece compile to tensorify them, tracing the model and compiling pieces a second time at
    every start of the PIECEWISE modes."""
    from libkk.graphs.compile import CompiledForward
    from libkk.graphs.piecewise import PiecewiseBackend
    from torch._dynamo.backends.common import aot_autograd

    from libkk.layers.forward_context import set_forward_context

    compiles = []

    def compile_piece(gm, example_inputs):
        compiles.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    class Counted(PiecewiseBackend):
        calls = 0

        def __call__(self, gm, example_inputs):
            Counted.calls += 1
            return super().__call__(gm, example_inputs)

    model, _, ids, pos, metadata = _step(tiny_llama_dir)
    backend = Counted(sizes=[8], compile_piece=compile_piece)
    torch._dynamo.reset()
    with torch.no_grad(), set_forward_context(metadata, model):
        CompiledForward(model, backend=backend)(ids, pos)
    assert Counted.calls == 1
    assert len(compiles) == len(backend.pieces) == len(model.attention_layers()) + 1


def test_plain_torch_experts_compile_without_graph_breaks(tmp_path):
    """The plain-torch experts read their routing counts on the host: a compiled forward calls
    them as one opaque op per layer (`libkk::experts`), so it traces as one graph, compiles once
    whatever the routing, and gives the eager result."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from libkk.layers.forward_context import set_forward_context

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), progress=False)
    kv = PagedKV(model, num_blocks=16, block_size=4)
    steps = [
        build_attn_metadata([([5, 6, 7, 8, 9], 0), ([11, 12, 13], 0)], [[3, 7], [5]], 4),
        build_attn_metadata([([40, 41, 42, 43, 44, 45, 46], 0)], [[2, 4]], 4),
    ]
    ops = _one_graph_ops(model, *steps[0])
    experts = (torch.ops.libkk.experts, torch.ops.libkk.experts.default)
    assert sum(op in experts for op in ops) == config.num_hidden_layers

    torch._dynamo.reset()
    frames = []
    compiled = torch.compile(
        model.forward, backend=lambda gm, _: frames.append(gm) or gm.forward, dynamic=True
    )
    for ids, pos, metadata in steps:  # different tokens, so different routings
        with torch.no_grad(), set_forward_context(metadata, model):
            eager = model.forward(ids, pos)
            for cache in kv.caches:
                cache.fill_(float("nan"))
            torch.testing.assert_close(compiled(ids, pos), eager, rtol=1e-5, atol=1e-5)
    assert len(frames) == 1
