"""Triton attention ops at real shapes on CUDA (Qwen3-8B: 32 q heads, 8 KV heads, head_dim 128,
block_size 16), bf16 and FP8 KV caches, against the torch references."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: before importing triton, so CPU runs keep tests/kernels' interpreter switch working.
    pytest.skip("needs CUDA (run `pytest -m gpu` on the GPU machine)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # the batch builder

from libkk.kernels import (  # noqa: E402
    FP8_DTYPE,
    paged_attention,
    paged_attention_ref,
    store_kv,
    store_kv_ref,
)
from paged_batch import make_batch  # noqa: E402

from libkk.layers.attention import TorchAttentionBackend  # noqa: E402
from libkk.layers.triton_attention import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu

QWEN3_8B = (32, 8, 128, 16)  # num_heads, num_kv_heads, head_dim, block_size
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}
SCALES = {"bf16": (1.0, 1.0), "fp8": (0.05, 0.02)}
BATCHES = {
    "prefill": [(1500, 1500), (37, 37)],
    "mixed": [(1, 4000), (512, 512), (1, 1500), (300, 1324), (4, 900), (1, 17)],
    "decode": [(1, s) for s in (1, 15, 16, 17, 300, 2048, 4097, 8192)],
    "verify": [(4, s) for s in (4, 100, 1000, 3000)],
}


def _batch(batch: str, cache: str, seed: int = 0, **kw):
    k_scale, v_scale = SCALES[cache]
    return make_batch(BATCHES[batch], *QWEN3_8B, dtype=torch.bfloat16,
                      cache_dtype=CACHE_DTYPES[cache], device="cuda", seed=seed, k_scale=k_scale,
                      v_scale=v_scale, **kw)  # fmt: skip


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_store_kv_real_shapes(cache):
    b = _batch("mixed", cache, num_pad_rows=8)
    k, v = b.k * 10, b.v  # some keys saturate FP8 at k_scale 0.05
    want = b.kv_cache.clone()
    store_kv_ref(k, v, want, b.slot_mapping, b.k_scale, b.v_scale)
    store_kv(k, v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    assert torch.equal(b.kv_cache.view(torch.uint8), want.view(torch.uint8))
    assert b.kv_cache[:, 0].float().isnan().all()  # padded rows skipped


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_paged_attention_real_shapes(batch, cache):
    b = _batch(batch, cache, seed=1)
    store_kv(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    out = paged_attention(*b.attention_args(), out=torch.full_like(b.q, float("nan")))
    want = paged_attention_ref(*b.attention_args())
    torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=2e-2)


def test_decode_graph_replays_at_other_lengths():
    """A CUDA graph captured once serves longer contexts: splits depend on shapes only."""
    short = make_batch([(1, s) for s in (1, 5, 16, 17, 40, 100, 200, 300)], *QWEN3_8B,
                       dtype=torch.bfloat16, device="cuda", seed=2)  # fmt: skip
    long = make_batch([(1, s) for s in (9000, 1, 64, 5000, 33, 7000, 2, 8191)], *QWEN3_8B,
                      dtype=torch.bfloat16, device="cuda", seed=3)  # fmt: skip
    # Static buffers sized for the long batch; the graph is captured holding the short one.
    q, cache = torch.empty_like(long.q), torch.empty_like(long.kv_cache)
    table, seq_lens = torch.zeros_like(long.block_table), torch.empty_like(long.seq_lens)
    args = (q, cache, table, seq_lens, long.query_start_loc, long.scale, long.k_scale,
            long.v_scale, 1)  # fmt: skip

    def load(src):
        q.copy_(src.q)
        cache[:, : src.kv_cache.shape[1]] = src.kv_cache
        store_kv_ref(src.k, src.v, cache, src.slot_mapping, src.k_scale, src.v_scale)
        table.zero_()[:, : src.block_table.shape[1]] = src.block_table
        seq_lens.copy_(src.seq_lens)

    load(short)
    out = torch.empty_like(q)
    paged_attention(*args, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args, out=out)
    for src in (short, long):
        load(src)
        out.fill_(float("nan"))
        graph.replay()
        want = paged_attention_ref(*args)
        torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_triton_backend_matches_torch_backend(cache):
    """Both backends store with the layer's scales and read them back the same way."""
    b = _batch("mixed", cache, seed=4)
    meta = b.metadata()
    cache_torch = b.kv_cache.clone()
    scales = (b.k_scale, b.v_scale)
    got = TritonAttentionBackend().forward(b.q, b.k, b.v, b.kv_cache, meta, b.scale, *scales)
    want = TorchAttentionBackend().forward(b.q, b.k, b.v, cache_torch, meta, b.scale, *scales)
    assert torch.equal(b.kv_cache.view(torch.uint8), cache_torch.view(torch.uint8))
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2e-2)
