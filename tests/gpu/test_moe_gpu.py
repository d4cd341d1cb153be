"""Quantized MoE on CUDA at real shapes (Qwen3-30B-A3B: 128 experts, top-8, hidden 2048,
moe_intermediate 768) in bf16: routing, align, fused W4A16 GEMMs vs torch references; CSF expansion
bit-exact; CUDA graph capture of the fused path and of CSF prefetch; a tiny Qwen3-MoE model whose
greedy tokens with packed experts equal the dequantized-weights reference. FP8-activation (W4A8)
prefill kernels vs their reference, and the layer's choice by step type eagerly, under
torch.compile and inside a graph capture (needs compute capability >= 8.9).

Run: python -m pytest -q -m gpu tests/gpu/test_moe_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: before importing triton, so CPU runs keep tests/kernels' interpreter switch working.
    pytest.skip("needs CUDA (run `pytest -m gpu` on the GPU machine)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # PagedKV

from libkk.kernels import moe as M  # noqa: E402
from libkk.kernels.csf import csf_expand  # noqa: E402
from paged_helpers import PagedKV  # noqa: E402
from torch import nn  # noqa: E402

from libkk.layers.forward_context import set_forward_context  # noqa: E402
from libkk.layers.moe import SparseMoeBlock  # noqa: E402
from libkk.layers.quant_moe import (  # noqa: E402
    FP8_SCALE_PER_INPUT_SCALE,
    MoeOptions,
    QuantFusedMoE,
    finalize_moe_layers,
    fp8_activations_unsupported,
    moe_options,
    prefill_only_step,
)
from libkk.models.loader import load_model  # noqa: E402
from libkk.quant.csf import decode_csf, encode_csf  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


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


@pytest.fixture(scope="module", params=["nvfp4", "mxfp4"])
def layer(request):
    fmt = request.param
    return (fmt, *random_packed(E, 2 * INTER, HIDDEN, fmt, 2, 1),
            *random_packed(E, HIDDEN, INTER, fmt, 1, 2))  # fmt: skip


def _inputs(t: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=g, device=DEV).to(torch.bfloat16)
    logits = torch.randn(t, E, generator=g, device=DEV)
    weights, ids = M.moe_topk_routing_ref(logits, TOP_K, True)
    return x, weights, ids


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_routing_real_shape(t, scoring):
    logits = torch.randn(t, E, device=DEV, dtype=torch.bfloat16)
    w, ids = M.moe_topk_routing(logits, TOP_K, True, scoring)
    wr, idr = M.moe_topk_routing_ref(logits, TOP_K, True, scoring)
    # bf16 logits tie often; compare the chosen probabilities, and ids where they are unique
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    probs = torch.softmax(logits.float(), -1) if scoring == "softmax" else logits.float().sigmoid()
    picked = probs.gather(1, ids.long())
    torch.testing.assert_close(picked, probs.gather(1, idr.long()), rtol=0, atol=0)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("t", [1, 4, 64, 4096])
def test_align_real_shape(t, block_m):
    _, _, ids = _inputs(t, seed=t)
    got = M.moe_align_block_size(ids, E, block_m)
    want = M.moe_align_block_size_ref(ids, E, block_m)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("t", [1, 4, 64, 256])
def test_gemm_ops_bf16(layer, t):
    fmt, w13, s13, g13, w2, s2, g2 = layer
    x, weights, ids = _inputs(t, seed=t + 10)
    cfg = M.DECODE_CONFIG if t <= 64 else M.PREFILL_CONFIG  # the sorted path's ops
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    align = M.moe_align_block_size(ids, E, cfg.block_m)
    inter = torch.full((t * TOP_K, INTER), float("nan"), dtype=torch.bfloat16, device=DEV)
    M.moe_w4a16_gate_up(x, w13, s13, g13, *align, inter, TOP_K, fmt, *tiles)
    inter_ref = torch.full_like(inter, float("nan"))
    M.moe_w4a16_gate_up_ref(x, w13, s13, g13, *align, inter_ref, TOP_K, fmt, *tiles)
    assert not inter.isnan().any()
    scale = inter_ref.float().abs().max().item()
    torch.testing.assert_close(inter, inter_ref, rtol=2e-2, atol=1e-2 * scale)

    y = torch.full((t * TOP_K, HIDDEN), float("nan"), dtype=torch.bfloat16, device=DEV)
    M.moe_w4a16_down(inter_ref, w2, s2, g2, weights, *align, y, fmt, *tiles)
    y_ref = torch.full_like(y, float("nan"))
    M.moe_w4a16_down_ref(inter_ref, w2, s2, g2, weights, *align, y_ref, fmt, *tiles)
    assert not y.isnan().any()
    scale = y_ref.float().abs().max().item()
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("t", [1, 16, 300, 4096])
def test_fused_moe_bf16(layer, t):
    fmt, *weights_ = layer
    x, weights, ids = _inputs(t, seed=t + 20)
    out = M.fused_moe_w4a16(x, *weights_, weights, ids, fmt)
    want = M.fused_moe_w4a16_ref(x, *weights_, weights, ids, fmt)
    err = (out.float() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_fused_moe_in_cuda_graph(layer):
    fmt, *weights_ = layer
    t = 8
    x, weights, ids = _inputs(t, seed=1)
    static = [x.clone(), weights.clone(), ids.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        M.fused_moe_w4a16(*static[:1], *weights_, *static[1:], fmt)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.fused_moe_w4a16(static[0], *weights_, static[1], static[2], fmt)
    for seed in (2, 3):
        x, weights, ids = _inputs(t, seed=seed)
        for buf, new in zip(static, (x, weights, ids), strict=True):
            buf.copy_(new)
        graph.replay()
        want = M.fused_moe_w4a16(x, *weights_, weights, ids, fmt)
        assert torch.equal(out, want)


@pytest.mark.parametrize(
    "kind,shape", [("nvfp4", (E, 2 * INTER, HIDDEN // 16)), ("mxfp4", (E, HIDDEN, INTER // 32))]
)
def test_csf_expand_real_shape(kind, shape):
    g = torch.Generator().manual_seed(0)
    scales = (118 + torch.randint(0, 3, shape, generator=g)).to(torch.uint8)
    scales.view(-1)[::997] = torch.randint(0, 256, scales.view(-1)[::997].shape, generator=g).to(
        torch.uint8
    )  # scattered exceptions, NaN bytes among them
    scales.view(-1)[5] = 0xFF
    t = encode_csf(scales, kind)
    out = torch.full(shape, 0xA5, dtype=torch.uint8, device=DEV)
    args = [x.to(DEV) for x in (t.base, t.offsets, t.records, t.record_offsets)]
    csf_expand(kind, *args, out)
    assert torch.equal(out.cpu(), decode_csf(t))


class _Layer(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = nn.Linear(64, 64, bias=False)  # stands in for attention
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _summed(self.mlp(self.self_attn(x)))


def _summed(out: torch.Tensor) -> torch.Tensor:
    """A MoE block's output summed over its top-k terms where it leaves them to the next norm."""
    return out.sum(dim=-2) if out.dim() == 3 else out


def _moe_stack(prefetch: bool, fmt: str = "nvfp4", activations: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    options = MoeOptions(fmt, prefetch, activations)
    with torch.device(DEV), moe_options(options):
        model = nn.Sequential(*[_Layer(SparseMoeBlock(64, 16, 4, 64, True)) for _ in range(3)])
    for n, layer in enumerate(model):
        experts = layer.mlp.experts
        assert isinstance(experts, QuantFusedMoE)
        nn.init.normal_(layer.self_attn.weight, std=0.1)
        nn.init.normal_(layer.mlp.gate.weight, std=0.5)
        for prefix, parts in (("w13", 2), ("w2", 1)):
            w = getattr(experts, f"{prefix}_weight")
            w, s, g = random_packed(16, w.shape[1], w.shape[2] * 2, fmt, parts, seed=n)
            getattr(experts, f"{prefix}_weight").data.copy_(w)
            getattr(experts, f"{prefix}_weight_scale").data.copy_(s)
            if fmt == "nvfp4":
                getattr(experts, f"{prefix}_weight_scale_2").data.copy_(g * 30)
        # activations in bf16; the packed weights and their fp32 scales stay as they are
        layer.self_attn.to(torch.bfloat16)
        layer.mlp.gate.to(torch.bfloat16)
    if activations == "fp8":
        _calibrate(model, torch.randn(64, 64, device=DEV, dtype=torch.bfloat16))
    finalize_moe_layers(model, options)
    return model.requires_grad_(False)  # inference: the custom ops have no backward


def _calibrate(model: nn.Module, x: torch.Tensor) -> None:
    """Input scales as a calibration would store them: amax / 448 of each experts' input and of
    SiLU(gate) * up over every expert (a superset of the routed ones), in the checkpoint's
    convention."""
    seen = {}

    def record(module, args):  # returns None: the inputs pass on unchanged
        seen.setdefault(id(module), args[0].float())

    hooks = [layer.mlp.experts.register_forward_pre_hook(record) for layer in model]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    for layer in model:
        m = layer.mlp.experts
        xin = seen[id(m)]
        w13 = M.dequantize_w4_ref(m.w13_weight, m.w13_weight_scale, m.w13_weight_scale_2,
                                  m.weight_format, torch.float32)  # fmt: skip
        h = torch.einsum("tk,enk->etn", xin, w13)
        gate, up = h.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        factor = 448 * FP8_SCALE_PER_INPUT_SCALE[m.weight_format]
        m.w13_input_scale.data.fill_(xin.abs().max().item() / factor)
        m.w2_input_scale.data.copy_(act.abs().amax(dim=(1, 2))[:, None] / factor)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_csf_prefetch_equals_plain_and_replays_in_graph(fmt):
    plain = _moe_stack(False, fmt)
    fetched = _moe_stack(True, fmt)
    assert all(m.experts._prefetch is not None for m in [x.mlp for x in fetched])
    assert fetched[0].mlp.experts.w13_weight_scale.numel() == 0  # scales live compressed only
    x = torch.randn(5, 64, device=DEV, dtype=torch.bfloat16)
    want = plain(x)
    assert torch.equal(fetched(x), want)
    assert torch.equal(fetched(x), want)  # the double buffer is reused correctly

    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fetched(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fetched(static)
    for seed in (1, 2):
        torch.manual_seed(seed)
        new = torch.randn(5, 64, device=DEV, dtype=torch.bfloat16)
        static.copy_(new)
        graph.replay()
        assert torch.equal(out, plain(new))


# --------------------------------------------------------------------------------------------------
# A tiny Qwen3-MoE model end to end


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4-csf"])
def test_tiny_model_greedy_packed_equals_dequantized(tiny_moe_dirs, fmt):
    path = tiny_moe_dirs[fmt]
    packed, _ = load_model(path, torch.float32, torch.device(DEV), progress=False)
    assert any(isinstance(m, QuantFusedMoE) for m in packed.modules())
    ref, _ = load_model(path, torch.float32, torch.device("cpu"), progress=False)
    ref = ref.to(DEV)  # dequantized experts, plain torch path
    assert not any(isinstance(m, QuantFusedMoE) for m in ref.modules())
    prompt = [5, 17, 300, 99, 42, 7, 1000]
    want = PagedKV(ref, device=DEV).greedy(prompt, 24)
    assert PagedKV(packed, device=DEV).greedy(prompt, 24) == want
    prefetched, _ = load_model(
        path, torch.float32, torch.device(DEV), progress=False, csf_prefetch=True
    )
    assert PagedKV(prefetched, device=DEV).greedy(prompt, 24) == want


def test_tiny_model_bf16_logits_as_close_as_the_dequantized_model(tiny_moe_dirs):
    """In bf16, the packed experts' logits are as close to the fp32 logits of the same weights
    as the dequantized experts' bf16 logits are: the kernels add no error beyond bf16's own
    (they form the same bf16 weights and round where the unfused path rounds).

    Measured over every token of several prompts: in this small random model a bf16 rounding
    sends a few tokens to other experts than fp32 does (2 of 9 tokens per layer, both paths),
    and which tokens flip is chance, so one token's error (or a 2-token prompt's) can differ by
    2x between two equally exact paths."""
    path = tiny_moe_dirs["nvfp4"]
    prompts = [[5, 17, 300, 99, 42, 7, 1000], [3, 4], [11, 12, 13, 14, 15, 16, 17, 18],
               [900, 800, 700, 600, 500, 400], [2, 1500, 31, 77, 123]]  # fmt: skip

    def logits(dtype: torch.dtype, load_on: str) -> list[torch.Tensor]:
        model, _ = load_model(path, dtype, torch.device(load_on), progress=False)
        # loaded on the CPU the experts are dequantized; on CUDA they stay packed
        return PagedKV(model.to(DEV), dtype=dtype, device=DEV).prefill_logits(prompts)

    exact = logits(torch.float32, "cpu")
    packed, dequantized = logits(torch.bfloat16, DEV), logits(torch.bfloat16, "cpu")

    def error(x: torch.Tensor, want: torch.Tensor) -> float:
        return ((x.float() - want).norm() / want.norm()).item()

    packed, dequantized, exact = (torch.cat(x) for x in (packed, dequantized, exact))
    assert error(packed, exact) <= 1.5 * error(dequantized, exact) + 1e-3, (
        error(packed, exact),
        error(dequantized, exact),
    )


@pytest.mark.parametrize("compile_", [False, True])
def test_session_moe_weight_format_graphs_equal_eager(tiny_moe_dirs, compile_):
    """The packed path inside the engine's CUDA graphs (decode, mixed batches, and with
    torch.compile also piecewise) gives the eager tokens.

    Static tiles in both sessions, so only graphs vs eager differs (tuned tiles in graphs:
    test_moe_tiles_gpu.py); tuning would also time every bucket's candidates twice here."""
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 300, 99], [42, 7], [1000, 3, 4, 5, 6, 7, 8, 9]]
    out = {}
    # FULL: the first step (three prompts at once) replays a mixed-batch graph.
    modes = [("NONE", False), ("FULL_DECODE_ONLY", compile_), ("FULL", compile_)]
    if compile_:  # the prefill step through the graphed pieces
        modes.append(("FULL_AND_PIECEWISE", True))
    for mode, comp in modes:
        with Session(
            str(tiny_moe_dirs["bf"]), device="cuda", dtype="float32", max_num_seqs=8,
            max_model_len=256, cudagraph_mode=mode, torch_compile=comp,
            moe_weight_format="nvfp4", tune_moe_tiles=False, progress=False,
        ) as s:  # fmt: skip
            assert any(isinstance(m, QuantFusedMoE) for m in s.engine.model.modules())
            if mode != "NONE":
                assert s.engine.runner.graphs is not None and s.engine.runner.graphs.graphs
            out[mode] = [o.token_ids for o in s.generate(prompts, params)]
    for mode, _ in modes[1:]:
        assert out[mode] == out["NONE"], mode


# --------------------------------------------------------------------------------------------------
# FP8 activations (W4A8) for prefill rows

needs_fp8 = pytest.mark.skipif(
    fp8_activations_unsupported(torch.device(DEV)) is not None,
    reason="FP8-activation kernels need compute capability >= 8.9",
)


def _fp8_scales(layer, x, ids):
    """Per-tensor scales from this batch (amax / 448 of x and of the W4A16 intermediate)."""
    fmt, w13, s13, g13, *_ = layer
    t = x.shape[0]
    x_scale = (x.float().abs().amax() / 448).reshape(1)
    cfg = M.DECODE_CONFIG if t <= 64 else M.PREFILL_CONFIG  # the sorted path's ops
    align = M.moe_align_block_size(ids, E, cfg.block_m)
    inter = torch.empty(t * TOP_K, INTER, dtype=torch.bfloat16, device=DEV)
    M.moe_w4a16_gate_up(x, w13, s13, g13, *align, inter, TOP_K, fmt, cfg.block_m, cfg.block_n,
                        cfg.block_k, cfg.num_warps, cfg.num_stages)  # fmt: skip
    return x_scale, (inter.float().abs().amax() / 448).reshape(1)


@needs_fp8
@pytest.mark.parametrize("t", [64, 512, 4096])
def test_fused_moe_w4a8_real_shape(layer, t):
    fmt, *weights_ = layer
    x, weights, ids = _inputs(t, seed=t + 30)
    x_scale, a_scale = _fp8_scales(layer, x, ids)
    out = M.fused_moe_w4a8(x, *weights_, x_scale, a_scale, weights, ids, fmt)
    want = M.fused_moe_w4a8_ref(x, *weights_, x_scale, a_scale, weights, ids, fmt)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    err = (out.float() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, f"W4A8 vs its reference: relative error {err:.2e}"
    exact = M.fused_moe_w4a16_ref(x, *weights_, weights, ids, fmt)
    err16 = (out.float() - exact.float()).norm() / exact.float().norm()
    assert err16 < 0.1, f"W4A8 vs W4A16: relative error {err16:.2e}"


@needs_fp8
def test_w4a8_gate_up_codes_real_shape(layer):
    fmt, w13, s13, g13, *_ = layer
    t = 256
    x, _, ids = _inputs(t, seed=40)
    x_scale, a_scale = _fp8_scales(layer, x, ids)
    cfg = M.W4A8_PREFILL_CONFIG
    tiles = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    align = M.moe_align_block_size(ids, E, cfg.block_m)
    xq = M.quantize_fp8_per_tensor(x, x_scale)
    act = torch.full((t * TOP_K, INTER), 0x7F, dtype=torch.uint8, device=DEV)
    act = act.view(torch.float8_e4m3fn)
    M.moe_w4a8_gate_up(xq, w13, s13, g13, x_scale, a_scale, *align, act, TOP_K, fmt, *tiles)
    flat = ids.reshape(-1).long()
    h = torch.empty(t * TOP_K, 2 * INTER, device=DEV)
    magnitude = torch.empty_like(h)  # sum of |x_q * w|: the scale of a dot's rounding error
    for e in flat.unique().tolist():
        pairs = torch.nonzero(flat == e).flatten()
        w = M.dequantize_w4_ref(w13[e : e + 1], s13[e : e + 1], g13[e : e + 1], fmt,
                                torch.float32)[0]  # fmt: skip
        h[pairs] = xq[pairs // TOP_K].float() @ w.T * x_scale
        magnitude[pairs] = xq[pairs // TOP_K].float().abs() @ w.abs().T * x_scale
    gate, up = h.chunk(2, dim=-1)
    want = M.quantize_fp8_per_tensor(gate / (1.0 + torch.exp(-gate)) * up, a_scale)
    assert not act.float().isnan().any()
    off = act.float() != want.float()
    assert off.float().mean() < 0.02  # summation order moves the odd value across a boundary
    # One e4m3 step apart (1/8 of the value for normals, 2^-9 for subnormals), plus what a
    # rounding error of the dots can move a code: fp8 tensor cores add the products of one dot
    # with fewer than fp32's mantissa bits, so near-cancelling dots differ from fp32 by up to
    # about 2^-13 of the products' magnitude (2^-11 allowed), carried through silu(gate) * up.
    mag_gate, mag_up = magnitude.chunk(2, dim=-1)
    slack = (1.1 * up.abs() * mag_gate + gate.abs() * mag_up) * 2.0**-11 / a_scale
    gap = (act.float() - want.float()).abs()
    near = gap <= want.float().abs() / 8 + 2.0**-9 + slack
    worst = (gap - want.float().abs() / 8 - slack).max().item()
    assert bool(near[off].all()), f"{int((~near).sum())} codes more than a step off (worst {worst})"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_fp8
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_layer_runs_fp8_only_in_declared_prefill_steps(fmt):
    """Eager, compiled and graph-captured: W4A8 only in a declared prefill-only step that is not
    being captured; every other step gives exactly the W4A16 output."""
    # The first MoE block alone (a residual would hide the experts' share of the output).
    fp8 = _moe_stack(False, fmt, "fp8")[0]
    plain = _moe_stack(False, fmt)[0]
    assert fp8.mlp.experts.fp8_prefill and not plain.mlp.experts.fp8_prefill
    assert "prefill rows: W4A8" in fp8.mlp.experts.describe()
    x = plain.self_attn(torch.randn(40, 64, device=DEV, dtype=torch.bfloat16)).detach()
    fp8, plain = fp8.mlp, plain.mlp
    exact = _summed(plain(x))
    assert torch.equal(fp8(x), exact)  # decode/verify or undeclared rows
    with prefill_only_step():
        fast = fp8(x)
    err = _rel(fast, exact)
    assert 1e-3 < err < 0.1, f"W4A8 vs W4A16 relative error {err:.2e}"

    # Compiled: the choice is made per call inside the opaque op, not frozen at trace time
    # (Inductor may round the glue ops differently: close, not equal).
    compiled = torch.compile(fp8)
    # The opaque op finds its layer through the forward context, as in a model's step.
    with torch.inference_mode(), set_forward_context(None, fp8):  # (the op has no backward)
        assert _rel(compiled(x), exact) < 1e-4
        with prefill_only_step():
            assert _rel(compiled(x), fast) < 1e-4
        assert _rel(compiled(x), exact) < 1e-4

    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fp8(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with prefill_only_step(), torch.cuda.graph(graph):  # a capture always takes W4A16
        out = fp8(static)
    graph.replay()
    assert torch.equal(out, exact)
