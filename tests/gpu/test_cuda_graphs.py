"""FULL CUDA graph replay gives the same tokens as eager execution (greedy), whatever the batch."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _generate(path, prompts, mode, compile_=False, kv_cache_dtype="auto"):
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with Session(
        str(path),
        device="cuda",
        dtype="float32",
        max_num_seqs=16,
        max_model_len=512,
        cudagraph_mode=mode,
        torch_compile=compile_,
        kv_cache_dtype=kv_cache_dtype,
        progress=False,
    ) as s:
        if mode != "NONE":
            assert s.engine.runner.graphs is not None and s.engine.runner.graphs.graphs
        return [o.token_ids for o in s.generate(prompts, params)]


@pytest.mark.parametrize("batch", [1, 3, 8, 13])
def test_graph_replay_equals_eager(tiny_qwen3_dir, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(2, 2048, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 200, (batch,), generator=g)
    ]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE")
    graphed = _generate(tiny_qwen3_dir, prompts, "FULL_DECODE_ONLY")
    assert graphed == eager


def test_compiled_graphs_equal_eager(tiny_qwen3_dir):
    """torch.compile (split at attention) + graphs vs plain eager: fp32, so the fused norms and
    rotary round differently only in the last bits; greedy tokens must still agree."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (5, 77, 160)]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE")
    assert _generate(tiny_qwen3_dir, prompts, "FULL_DECODE_ONLY", compile_=True) == eager


def test_fp8_kv_cache_graphs_equal_eager(tiny_qwen3_dir):
    """An FP8 cache through the Triton store and attention: replay and eager read the same bytes."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (9, 100)]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE", kv_cache_dtype="fp8")
    assert _generate(tiny_qwen3_dir, prompts, "FULL_DECODE_ONLY", kv_cache_dtype="fp8") == eager
