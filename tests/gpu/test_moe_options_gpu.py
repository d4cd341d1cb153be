"""The W4A16 MoE kernels with expert biases and the clamped SwiGLU on CUDA in bf16, at the
gpt-oss-20b expert shape (32 experts, top-4, hidden 2880, intermediate 2880): the fused op on every
static tile path (pair-major narrow and wide, split-K, sorted decode, prefill, large prefill) and
the sorted ops alone against the torch reference; no error beyond the bf16 dequantized
reference's own; CUDA graph replay and torch.compile equal to eager; QuantFusedMoE with biases
against the dense layer on the dequantized weights.

Run: python -m pytest -q -m gpu tests/gpu/test_moe_options_gpu.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: before importing triton, so CPU runs keep tests/kernels' interpreter switch working.
    pytest.skip("needs CUDA (run `pytest -m gpu` on the GPU machine)", allow_module_level=True)

from libkk.kernels import moe as M  # noqa: E402

from libkk.layers.moe import FusedMoE  # noqa: E402
from libkk.layers.quant_moe import MoeOptions, QuantFusedMoE  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
E, TOP_K, HIDDEN, INTER = 32, 4, 2880, 2880
GPT_OSS = M.ExpertActivation("clamped_swiglu", alpha=1.702, limit=7.0)
# The projections here are ~N(0, 0.5..2): a limit they cross, so both clamps act.
TIGHT = M.ExpertActivation("clamped_swiglu", alpha=1.702, limit=0.5)
ACTS = pytest.mark.parametrize("act", [GPT_OSS, TIGHT], ids=["gpt-oss", "tight"])


def random_packed(e: int, n: int, k: int, fmt: str, parts: int, seed: int):
    """Random packed weights with realistic scale bytes: (weight, scale, global)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, device=DEV, dtype=torch.uint8)
    cols = k // M.GROUP[fmt]
    if fmt == "nvfp4":
        s = torch.rand(e, n, cols, generator=g, device=DEV) * 3.5 + 0.25
        scale = s.to(torch.float8_e4m3fn).view(torch.uint8)
        glob = torch.rand(e, parts, generator=g, device=DEV) * 0.01 + 0.002
    else:
        scale = torch.randint(117, 121, (e, n, cols), generator=g, device=DEV, dtype=torch.uint8)
        glob = torch.ones(e, parts, device=DEV)
    return w, scale, glob


@pytest.fixture(scope="module", params=["mxfp4", "nvfp4"])
def layer(request):
    """(fmt, packed weights, w13 bias, w2 bias), biases in bf16."""
    fmt = request.param
    weights = (*random_packed(E, 2 * INTER, HIDDEN, fmt, 2, 1),
               *random_packed(E, HIDDEN, INTER, fmt, 1, 2))  # fmt: skip
    g = torch.Generator(device=DEV).manual_seed(3)
    b13 = (torch.randn(E, 2 * INTER, generator=g, device=DEV) * 0.5).to(torch.bfloat16)
    b2 = (torch.randn(E, HIDDEN, generator=g, device=DEV) * 0.5).to(torch.bfloat16)
    return fmt, weights, b13, b2


def _inputs(t: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=g, device=DEV).to(torch.bfloat16)
    weights, ids = M.moe_topk_routing_ref(torch.randn(t, E, generator=g, device=DEV), TOP_K, True)
    return x, weights, ids


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@ACTS
@pytest.mark.parametrize("t", [1, 2, 8, 16, 64, 300, 4096])
def test_fused_moe_with_options_bf16(layer, t, act):
    """The static tile table's path for t tokens (pair-major narrow/wide, sorted decode,
    prefill, large prefill) against the reference, and no further from the fp32 products of
    the same weights than the bf16 reference is: the kernels round where it rounds."""
    fmt, weights_, b13, b2 = layer
    x, weights, ids = _inputs(t, seed=t)
    opts = dict(w13_bias=b13, w2_bias=b2, activation=act)
    out = M.fused_moe_w4a16(x, *weights_, weights, ids, fmt, **opts)
    want = M.fused_moe_w4a16_ref(x, *weights_, weights, ids, fmt, **opts)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert _rel(out, want) < 1e-2, _rel(out, want)
    exact = M.fused_moe_w4a16_ref(x.float(), *weights_, weights, ids, fmt, w13_bias=b13.float(),
                                  w2_bias=b2.float(), activation=act)  # fmt: skip
    assert _rel(out, exact) <= 1.1 * _rel(want, exact) + 1e-4, (_rel(out, exact), _rel(want, exact))


@ACTS
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_pair_major_with_options_bf16(layer, t, split_k, act):
    fmt, weights_, b13, b2 = layer
    x, weights, ids = _inputs(t, seed=10 + t)
    opts = dict(w13_bias=b13, w2_bias=b2, activation=act)
    want = M.fused_moe_w4a16_ref(x, *weights_, weights, ids, fmt, **opts)
    for base in (M.PAIR_DECODE_NARROW, M.PAIR_DECODE_CONFIG):
        cfg = M.MoeTileConfig(**{**vars(base), "split_k": split_k})
        out = M.fused_moe_w4a16(x, *weights_, weights, ids, fmt, cfg, **opts)
        assert _rel(out, want) < 1e-2, (cfg, _rel(out, want))


@ACTS
@pytest.mark.parametrize("t", [1, 64, 512])
def test_gemm_ops_with_options_bf16(layer, t, act):
    fmt, (w13, s13, g13, w2, s2, g2), b13, b2 = layer
    x, weights, ids = _inputs(t, seed=20 + t)
    cfg = M.DECODE_CONFIG if t <= 64 else M.PREFILL_CONFIG
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    align = M.moe_align_block_size(ids, E, cfg.block_m)
    a = (act.kind, act.alpha, act.limit)
    inter = torch.full((t * TOP_K, INTER), float("nan"), dtype=torch.bfloat16, device=DEV)
    M.moe_w4a16_gate_up(x, w13, s13, g13, *align, inter, TOP_K, fmt, *tiles, b13, *a)
    inter_ref = torch.full_like(inter, float("nan"))
    M.moe_w4a16_gate_up_ref(x, w13, s13, g13, *align, inter_ref, TOP_K, fmt, *tiles, b13, *a)
    assert not inter.isnan().any()
    scale = inter_ref.float().abs().max().item()
    torch.testing.assert_close(inter, inter_ref, rtol=2e-2, atol=1e-2 * scale)

    y = torch.full((t * TOP_K, HIDDEN), float("nan"), dtype=torch.bfloat16, device=DEV)
    M.moe_w4a16_down(inter_ref, w2, s2, g2, weights, *align, y, fmt, *tiles, w2_bias=b2)
    y_ref = torch.full_like(y, float("nan"))
    M.moe_w4a16_down_ref(inter_ref, w2, s2, g2, weights, *align, y_ref, fmt, *tiles, w2_bias=b2)
    assert not y.isnan().any()
    scale = y_ref.float().abs().max().item()
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=1e-2 * scale)


def test_options_replay_in_cuda_graph_and_compile(layer):
    fmt, weights_, b13, b2 = layer
    opts = dict(w13_bias=b13, w2_bias=b2, activation=TIGHT)
    t = 8
    static = list(_inputs(t, seed=1))

    def run(x, weights, ids):
        return M.fused_moe_w4a16(x, *weights_, weights, ids, fmt, **opts)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        run(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*static)
    compiled = torch.compile(run, fullgraph=True)
    for seed in (2, 3):
        new = _inputs(t, seed=seed)
        for buf, value in zip(static, new, strict=True):
            buf.copy_(value)
        graph.replay()
        want = run(*new)
        assert torch.equal(out, want)
        # compiled: the measured op with flat options; Inductor's top-k sum may round apart
        got = compiled(*new)
        assert _rel(got, want) < 1e-3


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_packed_layer_with_biases_equals_dense_layer_bf16(fmt):
    """QuantFusedMoE (fused kernels) with biases and the clamped SwiGLU, against FusedMoE holding
    the dequantized weights and the same biases in fp32: as close as FusedMoE in bf16 is (whose own
    roundings, the activation's `up + 1` among them, are of the same order as the tolerance).

    The reference's weights are fp32, not the bf16 layer's: an NVFP4 weight (e2m1 x E4M3 x an
    fp32 global) does not fit bf16, and the pair-major kernels form it in fp32 (the tile kernels
    round it to bf16 as the dense layer does); at these weights' size bf16-rounded reference
    weights alone put the reference 0.4-1.2% away from the fp32 one (measured on the CPU)."""
    e, h, i = 8, 512, 256
    with torch.device(DEV):
        torch.set_default_dtype(torch.bfloat16)
        try:
            packed = QuantFusedMoE(e, h, i, fmt, MoeOptions(fmt, False, "fp8"), bias=True,
                                   activation=TIGHT)  # fmt: skip
            dense = FusedMoE(e, h, i, bias=True, activation=TIGHT)
        finally:
            torch.set_default_dtype(torch.float32)
        exact = FusedMoE(e, h, i, bias=True, activation=TIGHT)
    for prefix, parts, rows, cols in (("w13", 2, 2 * i, h), ("w2", 1, h, i)):
        w, s, g = random_packed(e, rows, cols, fmt, parts, seed=parts)
        getattr(packed, f"{prefix}_weight").data.copy_(w)
        getattr(packed, f"{prefix}_weight_scale").data.copy_(s)
        if fmt == "nvfp4":
            getattr(packed, f"{prefix}_weight_scale_2").data.copy_(g * 30)
        glob = getattr(packed, f"{prefix}_weight_scale_2")
        dense_w = M.dequantize_w4_ref(w, s, glob, fmt, torch.bfloat16)
        bias = torch.randn(e, rows, device=DEV) * 0.5
        for layer in (packed, dense, exact):
            getattr(layer, f"{prefix}_bias").data.copy_(bias)
        getattr(dense, f"{prefix}_weight").data.copy_(dense_w)
        getattr(exact, f"{prefix}_weight").data.copy_(
            M.dequantize_w4_ref(w, s, glob, fmt, torch.float32)
        )
    packed.settle_row_kernels()
    assert packed.fused_kernels and not packed.fp8_prefill
    assert "W4A8 kernels run neither expert biases" in packed.describe()
    for t in (1, 7, 100):
        x, weights, ids = _inputs_small(t, e, h)
        want = exact(x.float(), weights, ids.long())
        tolerance = max(1e-2, 1.5 * _rel(dense(x, weights, ids.long()), want))
        got = packed(x, weights, ids)
        assert _rel(got, want) < tolerance, (t, _rel(got, want), tolerance)
        routed = packed.routed_outputs(x, weights, ids).sum(dim=1)
        assert _rel(routed, want) < tolerance, (t, _rel(routed, want), tolerance)


def _inputs_small(t: int, e: int, h: int):
    g = torch.Generator(device=DEV).manual_seed(t + 50)
    x = torch.randn(t, h, generator=g, device=DEV).to(torch.bfloat16)
    weights, ids = M.moe_topk_routing_ref(torch.randn(t, e, generator=g, device=DEV), 2, True)
    return x, weights, ids
