"""Per-layer FP8 KV scales on CUDA: a graph captured before calibration (as decode graphs are,
before the first prefill) replays with the calibrated scales."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run `pytest -m gpu` on the GPU machine)", allow_module_level=True)

from libkk.kernels import paged_attention_ref  # noqa: E402

from libkk.layers.attention import FP8_MAX, Attention  # noqa: E402
from libkk.layers.forward_context import AttentionMetadata, set_forward_context  # noqa: E402

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 64, 16
FP8 = torch.float8_e4m3fn


def _layer() -> Attention:
    layer = Attention(HEADS, DIM, KV_HEADS, DIM**-0.5).cuda()
    layer.kv_cache = torch.full((2, 8, PAGE, KV_HEADS, DIM), float("nan"), device="cuda").to(FP8)
    return layer


def _metadata(slots, starts, seq_lens, table, max_query_len) -> AttentionMetadata:
    dev = "cuda"
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=seq_lens,
        block_table=table,
        block_size=PAGE,
        max_query_len=max_query_len,
        max_seq_len=table.shape[1] * PAGE,
        query_start_loc_cpu=list(starts),
        seq_lens_cpu=seq_lens.tolist(),
    )


def test_decode_graph_captured_before_calibration_reads_calibrated_scales():
    torch.manual_seed(0)
    layer = _layer()
    layer.calibrate_kv_scales_on_first_prefill()
    # Static decode buffers for two requests (one token each), already holding the real slots:
    # the capture sees real rows, and calibration must still wait (no host syncs in a capture).
    slots = torch.tensor([2 * PAGE + 4, 3 * PAGE + 9], device="cuda")  # positions 20 and 9
    table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([21, 10], dtype=torch.int32, device="cuda")
    decode = _metadata(slots, [0, 1, 2], seq_lens, table, 1)
    q = torch.zeros(2, HEADS * DIM, device="cuda")
    k = torch.zeros(2, KV_HEADS * DIM, device="cuda")
    v = torch.zeros(2, KV_HEADS * DIM, device="cuda")
    warm = _layer()  # compiles the kernels outside the capture, on another layer
    with set_forward_context(decode, layer):
        warm.attend(q, k, v)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.attend(q, k, v)
    assert layer.calibration_pending and layer.kv_scales == (1.0, 1.0)

    # The first prefill (20 and 9 tokens, |k|, |v| >> 448) calibrates eagerly.
    prefill_slots = torch.tensor(
        [PAGE + p for p in range(16)] + [2 * PAGE + p for p in range(4)] + [3 * PAGE + p for p in range(9)],
        device="cuda",
    )  # fmt: skip
    prefill = _metadata(
        prefill_slots, [0, 20, 29], torch.tensor([20, 9], dtype=torch.int32, device="cuda"),
        table, 20,
    )  # fmt: skip
    pk = torch.randn(29, KV_HEADS * DIM, device="cuda") * 3000.0
    pv = torch.randn(29, KV_HEADS * DIM, device="cuda") * 2000.0
    with set_forward_context(prefill, layer):
        layer.attend(torch.randn(29, HEADS * DIM, device="cuda"), pk, pv)
    k_scale, v_scale = layer.kv_scales
    assert k_scale == pytest.approx(pk.abs().max().item() / FP8_MAX, rel=1e-6)
    assert v_scale == pytest.approx(pv.abs().max().item() / FP8_MAX, rel=1e-6)
    assert not layer.calibration_pending

    # A decode step replays the graph: its stores and reads use the calibrated scales. (Smaller
    # K/V than the prefill's, so nothing saturates; q small so scores stay ordinary.)
    q.copy_(torch.randn_like(q) / 3000.0)
    k.copy_(torch.randn_like(k) * 1000.0)
    v.copy_(torch.randn_like(v) * 1000.0)
    graph.replay()
    cache = layer.kv_cache
    flat = cache.view(torch.uint8).view(2, -1, KV_HEADS, DIM)  # fp8 has no index kernels
    stored = flat[0][slots].view(FP8).float() * k_scale
    # e4m3: relative error <= 2^-4, absolute <= scale * 2^-10 among subnormals.
    want_k = k.view(2, KV_HEADS, DIM)
    torch.testing.assert_close(stored, want_k, rtol=2**-4, atol=k_scale * 2**-10)
    args = (cache, table, seq_lens, decode.query_start_loc, DIM**-0.5)
    q3 = q.view(2, HEADS, DIM)
    want = paged_attention_ref(q3, *args, layer.k_scale, layer.v_scale, 1)
    torch.testing.assert_close(out.view(2, HEADS, DIM), want, atol=1e-2, rtol=1e-4)
    ones = torch.ones(1, device="cuda")
    unscaled = paged_attention_ref(q3, *args, ones, ones, 1)
    assert (unscaled - want).abs().max() > 100.0
