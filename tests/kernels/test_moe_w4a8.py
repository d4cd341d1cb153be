"""FP8-activation (W4A8) prefill path of packed 4-bit MoE layers.

The torch reference against an independent float64 computation; the Triton kernels against the
reference in Triton's interpreter (its fp8 `tl.dot` on e4m3 operands is exact; only its own
fp32 -> fp8 cast rounds wrongly, which the kernels do not use); the layer's gating by row type and
by calibration, and its start-up lines. tests/gpu/test_moe_gpu.py runs the kernels at real shapes.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from kernel_env import DEVICE, ON_CUDA, RUNS_KERNELS
from libkk.kernels import moe as M
from libkk.kernels._jit import jit
from libkk.kernels.moe import dequant, w4a8
from torch import nn

import libkk.layers.quant_moe as Q
from libkk.layers.forward_context import null_prefill_metadata, set_forward_context
from libkk.quant.checkpoint import quantize_tensor
from libkk.quant.formats import e2m1_to_float, e8m0_to_float, unpack_e2m1

TINY = M.W4A8TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
WIDE = M.W4A8TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)


def random_experts(e: int, hidden: int, inter: int, fmt: str, seed: int, device=DEVICE):
    """(w13, s13, g13, w2, s2, g2): random weights quantized per (expert, projection)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for shape, projections in (((inter, hidden), 2), ((hidden, inter), 1)):
        packed, scales, glob = [], [], []
        for _ in range(e):
            p, s, gl = [], [], []
            for _ in range(projections):
                q = quantize_tensor("w.weight", torch.randn(*shape, generator=g) * 0.1, fmt)
                p.append(q["w.weight"])
                s.append(q["w.weight_scale"].view(torch.uint8))
                gl.append(q.get("w.weight_scale_2", torch.ones(())).reshape(1).float())
            packed.append(torch.cat(p))
            scales.append(torch.cat(s))
            glob.append(torch.cat(gl))
        parts += [torch.stack(packed), torch.stack(scales), torch.stack(glob)]
    return tuple(t.to(device) for t in parts)


def routing(t: int, e: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, top_k, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


def weights_float64(packed, scales, glob, fmt: str) -> torch.Tensor:
    """[E, N, K] float64 from the format definitions (libkk.quant.formats), not the kernels' code."""
    e, n, half = packed.shape
    values = e2m1_to_float(unpack_e2m1(packed.cpu())).double().reshape(e, n, -1, M.GROUP[fmt])
    if fmt == "nvfp4":
        step = scales.cpu().view(torch.float8_e4m3fn).double()
        step = step * glob.cpu().double().repeat_interleave(n // glob.shape[1], dim=1)[..., None]
    else:
        step = e8m0_to_float(scales.cpu()).double()
    return (values * step[..., None]).reshape(e, n, 2 * half)


def e4m3_float64(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()


def moe_float64(x, layer, x_scale, a_scale, weights, ids, fmt, quantize=True) -> torch.Tensor:
    """One token and one routed expert at a time, in float64; activations through e4m3 unless
    `quantize` is False (the same computation without FP8 activations)."""
    w13, s13, g13, w2, s2, g2 = layer
    w13_d, w2_d = weights_float64(w13, s13, g13, fmt), weights_float64(w2, s2, g2, fmt)
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        xq = e4m3_float64(xt, x_scale) * x_scale if quantize else xt
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13_d[e] @ xq
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            aq = e4m3_float64(act, a_scale) * a_scale if quantize else act
            out[t] += float(weights[t, k]) * (w2_d[e] @ aq)
    return out


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reference_vs_float64(fmt):
    e, hidden, inter, t, top_k = 4, 64, 32, 7, 2
    layer = random_experts(e, hidden, inter, fmt, seed=3, device="cpu")
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(4))
    x[0, :5] *= 40.0  # past the calibrated range: clamped to +-448 steps
    weights, ids = routing(t, e, top_k, seed=5)
    x_scale, a_scale = 3.0 / 448, 0.05 / 448
    got = M.fused_moe_w4a8_ref(x, *layer, torch.tensor([x_scale]), torch.tensor([a_scale]),
                               weights, ids, fmt)  # fmt: skip
    want = moe_float64(x, layer, x_scale, a_scale, weights, ids, fmt)
    unquantized = moe_float64(x, layer, x_scale, a_scale, weights, ids, fmt, quantize=False)
    err = (got.double() - want).abs().max().item()
    size = want.abs().max().item()
    # fp32 vs float64 rounding, plus the odd intermediate rounded to the neighbouring e4m3 value
    assert err <= 2e-3 * size
    # ... while FP8 activations themselves move the output by far more than that
    assert (unquantized - want).abs().max().item() > 10 * max(err, 1e-6 * size)


@RUNS_KERNELS
def test_fp32_to_e4m3_rounding_matches_torch():
    """The epilogue's integer RNE conversion against torch on every e4m3 value, every midpoint
    between neighbours (ties to even), random values at several magnitudes and out-of-range ones."""

    @jit
    def convert(v_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, w4a8._fp32_to_e4m3_bits(tl.load(v_ptr + i)).to(tl.uint8))

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)]
    ordered = codes.unique()
    mids = (ordered[:-1] + ordered[1:]) / 2
    g = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(512, generator=g) * s for s in (1e-3, 0.03, 1.0, 60.0)])
    edge = torch.tensor([449.0, 464.0, 1e6, -1e6, 2.0**-10, -(2.0**-11), 2.0**-9 * 1.5])
    v = torch.cat([codes, mids, -mids, rand, edge])
    n = 1 << (v.numel() - 1).bit_length()
    v = torch.cat([v, torch.zeros(n - v.numel())]).to(DEVICE)
    out = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    convert[(1,)](v, out, n)
    want = v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out, want)


@RUNS_KERNELS
def test_e2m1_codes_expand_to_e4m3_values_times_2_pow_minus_6():
    @jit
    def expand(o_ptr):
        c = tl.arange(0, 16)
        tl.store(o_ptr + c, dequant._e2m1_e4m3_bits(c).to(tl.uint8))

    out = torch.empty(16, dtype=torch.uint8, device=DEVICE)
    expand[(1,)](out)
    got = out.view(torch.float8_e4m3fn).float().cpu()
    assert torch.equal(got * 64, e2m1_to_float(torch.arange(16, dtype=torch.uint8)))


def _ulp_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 values apart two e4m3 tensors are (same-sign values: byte distance)."""
    return (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()


@RUNS_KERNELS
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape,cfg",
    [((1, 4, 2, 64, 32), TINY), ((9, 8, 2, 64, 64), TINY), ((21, 8, 4, 96, 32), WIDE)],
    ids=["t1", "t9", "t21-wide"],
)
def test_w4a8_ops_vs_reference(shape, cfg, dtype, fmt):
    t, e, top_k, hidden, inter = shape
    layer = random_experts(e, hidden, inter, fmt, seed=t + e)
    w13, s13, g13, w2, s2, g2 = layer
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(t)).to(DEVICE, dtype)
    weights, ids = (r.to(DEVICE) for r in routing(t, e, top_k, seed=t + 1))
    x_scale = (x.float().abs().amax() / 448).reshape(1)
    a_scale = torch.tensor([0.04 / 448], device=DEVICE)
    tiles = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    align = M.moe_align_block_size(ids, e, cfg.block_m)

    # gate_up: every pair row written, e4m3 codes equal to the reference's but for the odd value
    # whose fp32 sum, formed in another order, fell on the other side of a rounding boundary
    xq = M.quantize_fp8_per_tensor(x, x_scale)
    act = torch.full((t * top_k, inter), 0x7F, dtype=torch.uint8, device=DEVICE)  # NaN bytes
    act = act.view(torch.float8_e4m3fn)
    M.moe_w4a8_gate_up(xq, w13, s13, g13, x_scale, a_scale, *align, act, top_k, fmt, *tiles)
    w13_d = M.dequantize_w4_ref(w13, s13, g13, fmt, torch.float32)
    flat = ids.reshape(-1).long()
    h = torch.einsum("pk,pnk->pn", xq[torch.arange(t * top_k) // top_k].float(), w13_d[flat])
    h = h * x_scale
    gate, up = h[:, :inter], h[:, inter:]
    act_ref = M.quantize_fp8_per_tensor(gate / (1.0 + torch.exp(-gate)) * up, a_scale)
    assert not act.float().isnan().any()
    steps = _ulp_steps(act, act_ref)
    assert int(steps.max()) <= 1 and (steps > 0).float().mean() < 0.02

    # down: the reference's own intermediate in, fp32 until one rounding to the output dtype
    y = torch.full((t * top_k, hidden), float("nan"), dtype=dtype, device=DEVICE)
    M.moe_w4a8_down(act_ref, w2, s2, g2, a_scale, weights, *align, y, fmt, *tiles)
    w2_d = M.dequantize_w4_ref(w2, s2, g2, fmt, torch.float32)
    y_ref = torch.einsum("pk,pnk->pn", act_ref.float(), w2_d[flat]) * a_scale
    y_ref = y_ref * weights.reshape(-1, 1)
    assert not y.isnan().any()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype] * y_ref.abs().max().item()
    torch.testing.assert_close(y.float(), y_ref, rtol=0, atol=tol)

    out = M.fused_moe_w4a8(x, *layer, x_scale, a_scale, weights, ids, fmt, cfg)
    want = M.fused_moe_w4a8_ref(x, *layer, x_scale, a_scale, weights, ids, fmt)
    assert out.dtype == dtype
    size = want.abs().max().item()
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2 * size)


def test_w4a8_rejects_bad_inputs():
    layer = random_experts(2, 64, 32, "nvfp4", seed=0, device="cpu")
    w13, s13, g13, w2, s2, g2 = layer
    xq = torch.zeros(1, 64).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    align = M.moe_align_block_size_ref(torch.zeros(1, 1, dtype=torch.int32), 2, 16)
    out = torch.zeros(1, 32).to(torch.float8_e4m3fn)
    with pytest.raises(M.MoeKernelError, match="xq must be float8_e4m3fn"):
        M.moe_w4a8_gate_up(xq.float(), w13, s13, g13, one, one, *align, out, 1, "nvfp4", 16, 32,
                           4, 1)  # fmt: skip
    with pytest.raises(M.MoeKernelError, match="x_scale must be one fp32 value"):
        M.moe_w4a8_gate_up(xq, w13, s13, g13, torch.ones(2), one, *align, out, 1, "nvfp4", 16,
                           32, 4, 1)  # fmt: skip
    with pytest.raises(M.MoeKernelError, match="multiple of 32"):
        M.moe_w4a8_gate_up(xq[:, :48], w13[:, :, :24], s13[:, :, :3], g13, one, one, *align,
                           out, 1, "nvfp4", 16, 32, 4, 1)  # fmt: skip
    with pytest.raises(M.MoeKernelError, match="one fp32 value"):
        M.quantize_fp8_per_tensor(torch.zeros(2, 4), torch.ones(1, dtype=torch.float64))


# --------------------------------------------------------------------------------------------------
# The layer: which rows run what


def packed_layer(fmt: str, requested: bool, calibrated: bool) -> Q.QuantFusedMoE:
    e, hidden, inter = 4, 64, 32
    opts = Q.MoeOptions(fmt, False, "fp8" if requested else None)
    layer = Q.QuantFusedMoE(e, hidden, inter, fmt, opts)
    w13, s13, g13, w2, s2, g2 = random_experts(e, hidden, inter, fmt, seed=9, device="cpu")
    for name, value in (("w13_weight", w13), ("w13_weight_scale", s13), ("w2_weight", w2),
                        ("w2_weight_scale", s2)):  # fmt: skip
        getattr(layer, name).data.copy_(value)
    layer.w13_weight_scale_2.data.copy_(g13)
    layer.w2_weight_scale_2.data.copy_(g2)
    if calibrated:  # input scales as a checkpoint stores them (ModelOpt convention for NVFP4)
        layer.w13_input_scale.data.copy_(torch.tensor([[0.4, 0.5]] * e) / 448)
        layer.w2_input_scale.data.copy_(torch.tensor([[0.01], [0.02], [0.015], [0.01]]) / 448)
    return layer


def test_fp8_support_by_device(monkeypatch):
    assert "CUDA GPU" in Q.fp8_activations_unsupported(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert "8.9 (this GPU: 8.0)" in Q.fp8_activations_unsupported(torch.device("cuda"))
    for cap in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert Q.fp8_activations_unsupported(torch.device("cuda")) is None


@pytest.mark.parametrize(
    "requested,calibrated,why",
    [(False, True, "FP8 activations not requested"),
     (True, False, "FP8 activations requested but the layer has no calibrated input scales"),
     (True, True, "FP8 activations need a CUDA GPU (the layer is on cpu)")],
)  # fmt: skip
def test_describe_names_why_prefill_stays_w4a16(requested, calibrated, why, monkeypatch):
    monkeypatch.setattr(Q, "fused_w4a16_unsupported", lambda device: None)
    layer = packed_layer("nvfp4", requested, calibrated)
    layer.settle_row_kernels()
    assert not layer.fp8_prefill
    w4 = "W4A16 (NVFP4 weights, bf16/fp16 activations)"
    assert layer.describe() == f"decode/verify rows: {w4}; prefill rows: {w4}; {why}"


def test_layer_without_fused_kernels_says_so(monkeypatch):
    """A GPU without the hardware fp8 conversion (or the CPU) runs the torch path for all rows."""
    why = "the fused kernels need compute capability >= 8.9 (this GPU: 8.0)"
    monkeypatch.setattr(Q, "fused_w4a16_unsupported", lambda device: why)
    monkeypatch.setattr(Q, "fp8_activations_unsupported", lambda device: None)
    layer = packed_layer("nvfp4", True, True)
    layer.settle_row_kernels()
    assert not layer.fused_kernels and not layer.fp8_prefill
    assert layer.describe() == f"all rows: NVFP4 experts dequantized in torch ({why})"


def test_fused_kernels_need_hardware_fp8_conversion(monkeypatch):
    monkeypatch.setattr(Q, "INTERPRETED", False)
    assert "CUDA GPU" in Q.fused_w4a16_unsupported(torch.device("cpu"))
    for cap, ok in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert (Q.fused_w4a16_unsupported(torch.device("cuda")) is None) == ok


def test_one_uncalibrated_expert_keeps_prefill_w4a16(monkeypatch):
    monkeypatch.setattr(Q, "fused_w4a16_unsupported", lambda device: None)
    monkeypatch.setattr(Q, "fp8_activations_unsupported", lambda device: None)
    layer = packed_layer("mxfp4", True, True)
    layer.w2_input_scale.data[2] = 0.0
    layer.settle_row_kernels()
    assert not layer.fp8_prefill and "no calibrated input scales" in layer.describe()


def test_fp8_scales_follow_the_checkpoint_convention():
    for fmt, factor in (("nvfp4", 6.0), ("mxfp4", 1.0)):
        layer = packed_layer(fmt, True, True)
        x_scale, a_scale = layer.fp8_scales()
        assert x_scale.shape == a_scale.shape == (1,)
        assert x_scale.item() == pytest.approx(factor * 0.5 / 448)
        assert a_scale.item() == pytest.approx(factor * 0.02 / 448)


@RUNS_KERNELS
@pytest.mark.skipif(ON_CUDA, reason="CPU interpreter test; GPU: tests/gpu/test_moe_gpu.py")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_rows_run_by_step_type(fmt, monkeypatch):
    """Enabled layer: a declared prefill-only step runs W4A8; any other step (decode or
    verification rows, or a step nobody declared) runs exactly the W4A16 kernels, directly and
    through the opaque op torch.compile traces."""
    monkeypatch.setattr(Q, "fp8_activations_unsupported", lambda device: None)
    layer = packed_layer(fmt, True, True)
    layer.settle_row_kernels()
    assert layer.fp8_prefill
    assert "prefill rows: W4A8" in layer.describe()
    t = 6
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(t, 4, 2, seed=2)
    parts = (layer.w13_weight, layer.w13_weight_scale, layer.w13_weight_scale_2, layer.w2_weight,
             layer.w2_weight_scale, layer.w2_weight_scale_2)  # fmt: skip
    w4a16 = M.fused_moe_w4a16(x, *parts, weights, ids, fmt)
    w4a8 = M.fused_moe_w4a8_ref(x, *parts, *layer.fp8_scales(), weights, ids, fmt)
    size = w4a8.abs().max().item()
    assert (w4a8 - w4a16).abs().max().item() > 1e-3 * size  # the two paths are told apart

    op = torch.ops.libkk.packed_moe_by_row_type

    def through_op(*args):  # as a compiled forward calls it: the layer found by its index
        with set_forward_context(null_prefill_metadata(t, 16, x.device), layer):
            return op(*args, layer.layer_key)

    for run in (layer, through_op):
        assert torch.equal(run(x, weights, ids), w4a16)
        with Q.prefill_only_step():
            got = run(x, weights, ids)
        torch.testing.assert_close(got, w4a8, rtol=0, atol=2e-2 * size)
        assert torch.equal(run(x, weights, ids), w4a16)  # the declaration ends with its block

    layer.w13_input_scale.data.zero_()  # scales gone: the layer no longer qualifies
    layer.settle_row_kernels()
    with Q.prefill_only_step():
        assert torch.equal(layer(x, weights, ids), w4a16)


def test_start_up_lines(monkeypatch):
    class Block(nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.experts = experts

    model = nn.ModuleDict(
        {
            "a": Block(packed_layer("nvfp4", True, True)),
            "b": Block(packed_layer("nvfp4", True, False)),
        }
    )
    monkeypatch.setattr(Q, "fused_w4a16_unsupported", lambda device: None)
    monkeypatch.setattr(Q, "fp8_activations_unsupported", lambda device: None)
    lines = Q.finalize_moe_layers(model, Q.MoeOptions("nvfp4", False, "fp8"))
    assert lines == [
        "MoE a.experts: decode/verify rows: W4A16 (NVFP4 weights, bf16/fp16 activations); "
        "prefill rows: W4A8 (NVFP4 weights, FP8 e4m3 activations with per-tensor input scales) "
        "in steps declared prefill-only, outside CUDA graphs; W4A16 (NVFP4 weights, bf16/fp16 "
        "activations) otherwise",
        "MoE b.experts: decode/verify rows: W4A16 (NVFP4 weights, bf16/fp16 activations); "
        "prefill rows: W4A16 (NVFP4 weights, bf16/fp16 activations); FP8 activations requested "
        "but the layer has no calibrated input scales",
    ]
    assert model["a"].experts.fp8_prefill and not model["b"].experts.fp8_prefill


def test_checkpoint_input_scales_reach_the_layer():
    """ModelOpt `input_scale` tensors of every expert projection load into the layer's input
    scales (the calibration the FP8 path needs)."""
    e, hidden, inter = 2, 64, 32
    layer = Q.QuantFusedMoE(e, hidden, inter, "nvfp4", Q.MoeOptions("nvfp4", False, "fp8"))
    params = dict(layer.named_parameters(prefix="m.experts"))
    expert_weights = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                      "down_proj": ("w2_weight", 0)}  # fmt: skip
    value = 0.25
    for x in range(e):
        for proj in expert_weights:
            value += 0.25
            name = f"m.experts.{x}.{proj}.input_scale"
            target, shard = Q.map_expert_part_name(name, expert_weights)
            p = params[target]
            p.weight_loader(p, torch.tensor(value), name, shard)
    assert layer.w13_input_scale.tolist() == [[0.5, 0.75], [1.25, 1.5]]
    assert layer.w2_input_scale.tolist() == [[1.0], [1.75]]
    assert layer.input_scales_calibrated()
    assert layer.prefill_fp8_blocker() == "FP8 activations need a CUDA GPU (the layer is on cpu)"
