"""The W4A16 MoE kernels with expert biases and the clamped SwiGLU (gpt-oss) against their torch
references: the sorted and pair-major paths, both formats, 1 to 40 tokens; the references against
the dense `fused_moe_ref` on the dequantized weights; the activation epilogue's roundings.

On CPU the ops run in Triton's interpreter with fp32/fp16 activations (its bf16 dot is wrong);
tests/gpu/test_moe_options_gpu.py covers bf16 at the gpt-oss-20b shape.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_env import DEVICE, RUNS_KERNELS
from libkk.kernels import moe as M
from libkk.kernels.moe import common
from test_moe_kernels import random_layer

from libkk.layers.moe import fused_moe_ref

pytestmark = RUNS_KERNELS
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
# A limit the projections cross (they are ~N(0, 1) here), so both clamps act; and gpt-oss's own.
TIGHT = M.ExpertActivation("clamped_swiglu", alpha=1.702, limit=0.5)
GPT_OSS = M.ExpertActivation("clamped_swiglu", alpha=1.702, limit=7.0)

SORTED = M.MoeTileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
SORTED_WIDE = M.MoeTileConfig(block_m=32, block_n=16, block_k=64, num_warps=4, num_stages=1)
PAIRS = M.MoeTileConfig(block_m=M.PAIR_MAJOR, block_n=16, block_k=64, num_warps=4, num_stages=1)
# gate_up's K in two programs, the down kernel on a tile of its own
PAIRS_SPLIT = M.MoeTileConfig(M.PAIR_MAJOR, 4, 32, 1, 1, split_k=2, down_block_n=32,
                              down_block_k=32, down_num_warps=2)  # fmt: skip


def _biases(e: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    b13 = torch.randn(e, 2 * inter, generator=g) * 0.5
    b2 = torch.randn(e, hidden, generator=g) * 0.5
    return b13.to(DEVICE, dtype), b2.to(DEVICE, dtype)


def _problem(t: int, e: int, k: int, hidden: int, inter: int, fmt: str, dtype, seed: int):
    weights_ = random_layer(e, hidden, inter, fmt, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = M.moe_topk_routing_ref(torch.randn(t, e, generator=gen).to(DEVICE), k, True)
    return x, weights_, weights, ids


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any()
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype] * scale)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "t,cfg",
    [(1, PAIRS_SPLIT), (3, PAIRS), (12, PAIRS), (1, SORTED), (17, SORTED), (40, SORTED_WIDE)],
    ids=["t1-pairs-split", "t3-pairs", "t12-pairs", "t1-sorted", "t17-sorted", "t40-sorted"],
)
def test_fused_with_biases_and_clamped_swiglu_vs_reference(t, cfg, dtype, fmt):
    e, k, hidden, inter = 8, 4, 64, 64
    x, layer, weights, ids = _problem(t, e, k, hidden, inter, fmt, dtype, seed=t)
    b13, b2 = _biases(e, hidden, inter, dtype, seed=t + 5)
    opts = dict(w13_bias=b13, w2_bias=b2, activation=TIGHT)
    out = M.fused_moe_w4a16(x, *layer, weights, ids, fmt, cfg, **opts)
    want = M.fused_moe_w4a16_ref(x, *layer, weights, ids, fmt, **opts)
    assert out.shape == (t, hidden) and out.dtype == dtype
    _close(out, want, dtype)
    # The routed terms (what add_rms_norm sums) are the reference's per-pair outputs.
    routed = M.fused_moe_w4a16_routed(x, *layer, weights, ids, fmt, cfg, **opts)
    _close(routed.sum(dim=1), want, dtype)
    # The options matter here: the SiLU layer without biases is far from this one.
    plain = M.fused_moe_w4a16_ref(x, *layer, weights, ids, fmt)
    assert (plain - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize(
    "opts",
    [
        {"w13_bias": True},
        {"w2_bias": True},
        {"activation": GPT_OSS},
        {"activation": TIGHT},
        {"w13_bias": True, "w2_bias": True, "activation": GPT_OSS},
    ],
    ids=["gate-up-bias", "down-bias", "gpt-oss-act", "tight-act", "gpt-oss"],
)
@pytest.mark.parametrize("cfg", [SORTED, PAIRS], ids=["sorted", "pairs"])
def test_each_option_alone_vs_reference(opts, cfg):
    """Each option on its own (one bias without the other, the activation without biases)."""
    t, e, k, hidden, inter, fmt, dtype = 5, 4, 2, 64, 32, "mxfp4", torch.float32
    x, layer, weights, ids = _problem(t, e, k, hidden, inter, fmt, dtype, seed=40)
    b13, b2 = _biases(e, hidden, inter, dtype, seed=41)
    kw = {"activation": opts.get("activation", M.SILU)}
    if opts.get("w13_bias"):
        kw["w13_bias"] = b13
    if opts.get("w2_bias"):
        kw["w2_bias"] = b2
    out = M.fused_moe_w4a16(x, *layer, weights, ids, fmt, cfg, **kw)
    want = M.fused_moe_w4a16_ref(x, *layer, weights, ids, fmt, **kw)
    _close(out, want, dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gemm_ops_with_options_vs_reference(fmt, dtype):
    """The sorted path's two ops alone, outputs poisoned with NaN: every pair row written."""
    t, e, k, hidden, inter = 9, 8, 2, 64, 32
    cfg = SORTED
    x, (w13, s13, g13, w2, s2, g2), weights, ids = _problem(t, e, k, hidden, inter, fmt, dtype, 7)
    b13, b2 = _biases(e, hidden, inter, dtype, seed=8)
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    align = M.moe_align_block_size(ids, e, cfg.block_m)
    act = (TIGHT.kind, TIGHT.alpha, TIGHT.limit)

    inter_out = torch.full((t * k, inter), float("nan"), dtype=dtype, device=DEVICE)
    M.moe_w4a16_gate_up(x, w13, s13, g13, *align, inter_out, k, fmt, *tiles, b13, *act)
    inter_ref = torch.full_like(inter_out, float("nan"))
    M.moe_w4a16_gate_up_ref(x, w13, s13, g13, *align, inter_ref, k, fmt, *tiles, b13, *act)
    _close(inter_out, inter_ref, dtype)
    assert (inter_ref.abs() > 0).all()

    y = torch.full((t * k, hidden), float("nan"), dtype=dtype, device=DEVICE)
    M.moe_w4a16_down(inter_ref, w2, s2, g2, weights, *align, y, fmt, *tiles, w2_bias=b2)
    y_ref = torch.full_like(y, float("nan"))
    M.moe_w4a16_down_ref(inter_ref, w2, s2, g2, weights, *align, y_ref, fmt, *tiles, w2_bias=b2)
    _close(y, y_ref, dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("act", [M.SILU, GPT_OSS, TIGHT], ids=["silu", "gpt-oss", "tight"])
def test_reference_equals_dense_reference_on_dequantized_weights(fmt, act):
    """`fused_moe_w4a16_ref` with biases and activation is the dense experts' arithmetic
    (libkk.layers.moe.fused_moe_ref) on the dequantized weights."""
    t, e, k, hidden, inter, dtype = 11, 8, 3, 64, 32, torch.float32
    x, layer, weights, ids = _problem(t, e, k, hidden, inter, fmt, dtype, seed=21)
    w13, s13, g13, w2, s2, g2 = layer
    b13, b2 = _biases(e, hidden, inter, dtype, seed=22)
    got = M.fused_moe_w4a16_ref(
        x, *layer, weights, ids, fmt, w13_bias=b13, w2_bias=b2, activation=act
    )
    w13_d = M.dequantize_w4_ref(w13, s13, g13, fmt, dtype)
    w2_d = M.dequantize_w4_ref(w2, s2, g2, fmt, dtype)
    want = fused_moe_ref(x, w13_d, w2_d, weights, ids.long(), b13, b2, act)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@triton.jit
def _gated_kernel(g_ptr, u_ptr, out_ptr, DT: tl.constexpr, ACT: tl.constexpr,
                  ALPHA: tl.constexpr, LIMIT: tl.constexpr, N: tl.constexpr):  # fmt: skip
    r = tl.arange(0, N)
    h = common._gated(tl.load(g_ptr + r), tl.load(u_ptr + r), DT, ACT, ALPHA, LIMIT)
    tl.store(out_ptr + r, h)


@pytest.mark.parametrize("act", [M.SILU, GPT_OSS, TIGHT], ids=["silu", "gpt-oss", "tight"])
def test_activation_epilogue_rounds_as_the_torch_ops(act):
    """fp32 sums -> fp16 activation: the epilogue rounds each projection and each torch op of
    `expert_activation_ref` to fp16 as the unfused model does, so it gives the reference's fp16
    values (up to an fp32 exp ulp that moves a rounding: at most one fp16 ulp, rarely)."""
    n = 4096
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(n, generator=g) * 4  # past the limit both ways
    up = torch.randn(n, generator=g) * 4
    out = torch.empty(n, dtype=torch.float16, device=DEVICE)
    consts = common.act_constexprs(act)
    _gated_kernel[(1,)](gate.to(DEVICE), up.to(DEVICE), out, DT=tl.float16, N=n, **consts)
    want = M.expert_activation_ref(gate.half(), up.half(), act)
    got = out.cpu()
    equal = (got == want).float().mean().item()
    assert equal > 0.99, equal
    ulp = torch.finfo(torch.float16).eps * want.float().abs().clamp(min=2**-14)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    if act.kind == "clamped_swiglu":  # the limit acted on both projections
        assert (gate > act.limit).any() and (up.abs() > act.limit).any()


def test_compiled_call_takes_the_options_through_the_measured_op():
    """Under torch.compile without a config the layer runs as one opaque op with flat
    arguments (biases, activation kind, alpha, limit): the eager result."""
    t, e, k, hidden, inter, fmt, dtype = 6, 8, 2, 64, 32, "nvfp4", torch.float32
    x, layer, weights, ids = _problem(t, e, k, hidden, inter, fmt, dtype, seed=31)
    b13, b2 = _biases(e, hidden, inter, dtype, seed=32)
    opts = dict(w13_bias=b13, w2_bias=b2, activation=TIGHT)

    def run(x, weights, ids):
        return M.fused_moe_w4a16(x, *layer, weights, ids, fmt, **opts)

    torch._dynamo.reset()
    got = torch.compile(run, backend="eager", fullgraph=True)(x, weights, ids)
    want = M.fused_moe_w4a16_ref(x, *layer, weights, ids, fmt, **opts)
    _close(got, want, dtype)
    direct = M.fused_moe_w4a16_measured(x, *layer, weights, ids, fmt, b13, b2, "clamped_swiglu",
                                        TIGHT.alpha, TIGHT.limit)  # fmt: skip
    _close(direct.sum(dim=1), want, dtype)


def test_options_reject_bad_inputs():
    e, hidden, inter = 2, 64, 32
    x, layer, weights, ids = _problem(1, e, 1, hidden, inter, "nvfp4", torch.float32, seed=0)
    b13, b2 = _biases(e, hidden, inter, torch.float32, seed=1)
    args = (x, *layer, weights, ids, "nvfp4")
    for cfg in (SORTED, PAIRS):
        with pytest.raises(M.MoeKernelError, match="w13_bias must be"):
            M.fused_moe_w4a16(*args, cfg, w13_bias=b13[:, :inter])
        with pytest.raises(M.MoeKernelError, match="w2_bias must be"):
            M.fused_moe_w4a16(*args, cfg, w2_bias=b2.half())
    with pytest.raises(M.MoeKernelError, match="not one of silu, clamped_swiglu"):
        M.fused_moe_w4a16_measured(*args, None, None, "gelu", 1.0, 1.0)
