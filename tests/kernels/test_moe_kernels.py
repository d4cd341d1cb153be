"""MoE ops against their torch references: routing, alignment and the fused W4A16 expert GEMMs.

Fresh random inputs per case, outputs poisoned with NaN before the op writes them, several shapes
and tile configs. On CPU the ops run in Triton's interpreter with fp32/fp16 activations (its bf16
dot is wrong); tests/gpu/test_moe_gpu.py covers bf16 at real shapes.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_env import DEVICE, ON_CUDA, RUNS_KERNELS
from libkk.kernels import moe as M
from libkk.kernels._jit import INTERPRETED
from libkk.kernels.moe import dequant

from libkk.quant.formats import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)

pytestmark = RUNS_KERNELS
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
SMALL = M.MoeTileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
WIDE = M.MoeTileConfig(block_m=32, block_n=16, block_k=64, num_warps=4, num_stages=1)


def quantize_experts(w: torch.Tensor, fmt: str, parts: int):
    """[E, N, K] float -> (packed [E, N, K/2], scale bytes [E, N, K/G], global [E, parts]); each of
    the `parts` row blocks (gate, up) is its own tensor with its own NVFP4 global scale."""
    packed, scales, glob = [], [], []
    for we in w:
        row_p, row_s, row_g = [], [], []
        for block in we.chunk(parts, dim=0):
            if fmt == "nvfp4":
                q = quantize_nvfp4(block)
                row_p.append(q.weight)
                row_s.append(q.weight_scale.view(torch.uint8))
                row_g.append(q.weight_scale_2.reshape(1))
            else:
                q = quantize_mxfp4(block)
                row_p.append(q.weight)
                row_s.append(q.scale)
                row_g.append(torch.ones(1))
        packed.append(torch.cat(row_p))
        scales.append(torch.cat(row_s))
        glob.append(torch.cat(row_g))
    return torch.stack(packed), torch.stack(scales), torch.stack(glob)


def random_layer(e: int, hidden: int, inter: int, fmt: str, seed: int, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(e, hidden, inter, generator=g) * 0.1
    parts = quantize_experts(w13, fmt, 2) + quantize_experts(w2, fmt, 1)
    return tuple(p.to(device) for p in parts)


def test_dequantize_ref_matches_quant_formats():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 32, 64, generator=g)
    for fmt in ("nvfp4", "mxfp4"):
        p, s, gl = quantize_experts(w, fmt, 2)
        got = M.dequantize_w4_ref(p, s, gl, fmt, torch.float32)
        for e in range(2):
            for half in range(2):
                rows = slice(16 * half, 16 * half + 16)
                if fmt == "nvfp4":
                    want = dequantize_nvfp4(
                        p[e, rows], s[e, rows].view(torch.float8_e4m3fn), gl[e, half].reshape(())
                    )
                else:
                    want = dequantize_mxfp4(p[e, rows], s[e, rows])
                assert torch.equal(got[e, rows], want)


@triton.jit
def _dequant_all_kernel(w_ptr, s_ptr, g_ptr, even_ptr, odd_ptr, N: tl.constexpr,
                        GROUP: tl.constexpr, IS_NVFP4: tl.constexpr, USE_PTX: tl.constexpr):  # fmt: skip
    # One [256, N] tile: row r holds packed byte r, column c scale byte c (every pair of bytes).
    r = tl.arange(0, 256)
    c = tl.arange(0, N)
    g = tl.arange(0, 512 // GROUP)
    w_ptrs = w_ptr + r[:, None] + 0 * c[None, :]
    s_ptrs = s_ptr + c[None, :] + 0 * g[:, None]
    mask = c[None, :] < N
    even, odd = dequant._w4_tile(w_ptrs, s_ptrs, tl.load(g_ptr), mask, mask, tl.float32, IS_NVFP4,
                           GROUP, USE_PTX)  # fmt: skip
    tl.store(even_ptr + r[:, None] * N + c[None, :], even)
    tl.store(odd_ptr + r[:, None] * N + c[None, :], odd)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("global_scale", [1.0, 3.7e-3])
@pytest.mark.parametrize("use_ptx", [False] if INTERPRETED else [False, True])
def test_in_kernel_dequantization_is_exact_for_every_byte(fmt, global_scale, use_ptx):
    """Every packed byte with every scale byte (NaN, subnormal and extreme scales included) gives
    bit for bit the reference's fp32 value."""
    if fmt == "mxfp4" and global_scale != 1.0:
        pytest.skip("MXFP4 has no global scale")
    codes = torch.arange(256, dtype=torch.uint8)
    even = torch.empty(256, 256, device=DEVICE)
    odd = torch.empty_like(even)
    glob = torch.tensor([global_scale], device=DEVICE)
    _dequant_all_kernel[(1,)](codes.to(DEVICE), codes.to(DEVICE), glob, even, odd, N=256,
                              GROUP=M.GROUP[fmt], IS_NVFP4=fmt == "nvfp4",
                              USE_PTX=use_ptx)  # fmt: skip
    # The reference on a [256 scales, 1, 2 * 256 / G] layout: row c has scale byte c everywhere.
    g = M.GROUP[fmt]
    weight = codes.repeat(256, 1)[None]  # [1, 256, 256]: element pair r of every row
    scale = codes[:, None].repeat(1, 512 // g)[None]  # [1, 256, 512 / G]
    want = M.dequantize_w4_ref(weight, scale, glob.cpu().reshape(1, 1), fmt, torch.float32)[0]
    want_even, want_odd = want[:, 0::2].T, want[:, 1::2].T  # [256 bytes, 256 scales]
    checked = torch.ones(256, dtype=torch.bool)
    if INTERPRETED and fmt == "nvfp4":
        # Triton's interpreter turns the e4m3 NaN bytes 0x7F / 0xFF into +-480; the GPU's fp8
        # conversion gives NaN, and this test checks them there.
        checked[[0x7F, 0xFF]] = False
    for got, ref in ((even.cpu()[:, checked], want_even[:, checked]),
                     (odd.cpu()[:, checked], want_odd[:, checked])):  # fmt: skip
        assert torch.equal(got.isnan(), ref.isnan())
        keep = ~ref.isnan()
        assert torch.equal(got[keep].view(torch.int32), ref[keep].view(torch.int32))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("shape", [(1, 8, 2), (7, 60, 4), (33, 128, 8)])
def test_routing(shape, scoring, renorm):
    t, e, k = shape
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t + e)).to(DEVICE)
    w, ids = M.moe_topk_routing(logits, k, renorm, scoring)
    wr, idr = M.moe_topk_routing_ref(logits, k, renorm, scoring)
    assert ids.dtype == torch.int32 and torch.equal(ids, idr)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(t, device=DEVICE))


def test_routing_rejects_bad_inputs():
    with pytest.raises(M.MoeKernelError, match="top_k"):
        M.moe_topk_routing(torch.zeros(2, 4, device=DEVICE), 5, True)
    with pytest.raises(M.MoeKernelError, match="scoring"):
        M.moe_topk_routing(torch.zeros(2, 4, device=DEVICE), 2, True, "relu")


@pytest.mark.parametrize("block_m", [16, 32])
# (200, 8, 6) and (300, 128, 8) take the grid-wide path (more than ALIGN_SINGLE_MAX_PAIRS pairs)
@pytest.mark.parametrize(
    "shape", [(1, 8, 2), (5, 4, 4), (40, 16, 4), (200, 8, 6), (300, 128, 8), (700, 60, 2)]
)
def test_align(shape, block_m):
    t, e, k = shape
    assert (t * k > M.ALIGN_SINGLE_MAX_PAIRS) == (t in (200, 300, 700))
    g = torch.Generator().manual_seed(t * 7 + e)
    # Only the first max(k, e // 2) experts are picked, so some experts get no pair at all.
    used = max(k, e // 2)
    ids = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(t)])
    ids = ids.to(torch.int32).to(DEVICE)
    sorted_ids, expert_ids, npad = M.moe_align_block_size(ids, e, block_m)
    ref = M.moe_align_block_size_ref(ids, e, block_m)
    assert torch.equal(sorted_ids, ref[0]) and torch.equal(expert_ids, ref[1])
    assert torch.equal(npad, ref[2])
    # Independent checks: every pair once, padding is the sentinel, blocks hold one expert.
    n = t * k
    s = sorted_ids.cpu()
    real = s[s < n]
    assert torch.equal(real.sort().values, torch.arange(n, dtype=torch.int32))
    assert bool((s[s >= n] == n).all())
    assert int(npad) % block_m == 0 and bool((s[int(npad) :] == n).all())
    flat = ids.reshape(-1).cpu().long()
    blocks = expert_ids.cpu().long()
    for slot in range(int(npad)):
        if s[slot] < n:
            assert flat[s[slot]] == blocks[slot // block_m]
    assert bool((blocks[int(npad) // block_m :] == -1).all())
    assert bool((blocks[: int(npad) // block_m] >= 0).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,cfg",
    [((1, 4, 2, 64, 32), SMALL), ((6, 8, 2, 64, 64), SMALL), ((21, 8, 4, 128, 32), WIDE)],
    ids=["decode1", "t6", "t21-wide"],
)
def test_gemm_ops_vs_reference(shape, cfg, dtype, fmt):
    t, e, k, hidden, inter = shape
    w13, s13, g13, w2, s2, g2 = random_layer(e, hidden, inter, fmt, seed=t + e)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(t, e, generator=gen).to(DEVICE)
    weights, ids = M.moe_topk_routing_ref(logits, k, True)
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    align = M.moe_align_block_size(ids, e, cfg.block_m)

    inter_out = torch.full((t * k, inter), float("nan"), dtype=dtype, device=DEVICE)
    M.moe_w4a16_gate_up(x, w13, s13, g13, *align, inter_out, k, fmt, *tiles)
    inter_ref = torch.full_like(inter_out, float("nan"))
    M.moe_w4a16_gate_up_ref(x, w13, s13, g13, *align, inter_ref, k, fmt, *tiles)
    assert not inter_out.isnan().any()
    torch.testing.assert_close(inter_out, inter_ref, rtol=TOL[dtype], atol=TOL[dtype])

    y = torch.full((t * k, hidden), float("nan"), dtype=dtype, device=DEVICE)
    M.moe_w4a16_down(inter_ref, w2, s2, g2, weights, *align, y, fmt, *tiles)
    y_ref = torch.full_like(y, float("nan"))
    M.moe_w4a16_down_ref(inter_ref, w2, s2, g2, weights, *align, y_ref, fmt, *tiles)
    assert not y.isnan().any()
    torch.testing.assert_close(y, y_ref, rtol=TOL[dtype], atol=TOL[dtype])

    out = M.fused_moe_w4a16(x, w13, s13, g13, w2, s2, g2, weights, ids, fmt, cfg)
    want = M.fused_moe_w4a16_ref(x, w13, s13, g13, w2, s2, g2, weights, ids, fmt)
    scale = want.abs().max().item()
    torch.testing.assert_close(out, want, rtol=TOL[dtype], atol=TOL[dtype] * scale)


PAIRS = M.MoeTileConfig(block_m=M.PAIR_MAJOR, block_n=16, block_k=64, num_warps=4, num_stages=1)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,block_k",
    [((1, 8, 4, 128, 64), 64), ((3, 8, 2, 64, 96), 64), ((6, 4, 4, 128, 32), 32)],
    ids=["decode1", "t3-uneven-k", "t6-shared-experts"],
)
def test_pair_major_path_vs_reference(shape, block_k, dtype, fmt):
    """block_m = PAIR_MAJOR: per-pair products, the top-k sum in the down kernel; equal to the
    reference (t3: the down reduction of 96 is not a multiple of block_k; t6: four experts for six
    tokens, so pairs share experts)."""
    t, e, k, hidden, inter = shape
    w13, s13, g13, w2, s2, g2 = random_layer(e, hidden, inter, fmt, seed=3 * t + e)
    gen = torch.Generator().manual_seed(t + 100)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = M.moe_topk_routing_ref(torch.randn(t, e, generator=gen).to(DEVICE), k, True)
    cfg = M.MoeTileConfig(M.PAIR_MAJOR, 16, block_k, 4, 1)
    out = M.fused_moe_w4a16(x, w13, s13, g13, w2, s2, g2, weights, ids, fmt, cfg)
    want = M.fused_moe_w4a16_ref(x, w13, s13, g13, w2, s2, g2, weights, ids, fmt)
    assert out.shape == (t, hidden) and out.dtype == dtype
    scale = want.abs().max().item()
    torch.testing.assert_close(out, want, rtol=TOL[dtype], atol=TOL[dtype] * scale)
    # The sorted path computes the same thing.
    sorted_out = M.fused_moe_w4a16(x, w13, s13, g13, w2, s2, g2, weights, ids, fmt, SMALL)
    torch.testing.assert_close(out, sorted_out, rtol=TOL[dtype], atol=TOL[dtype] * scale)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize(
    "dtype", [torch.float16] + ([torch.bfloat16] if ON_CUDA else []), ids=lambda d: str(d)[6:]
)
def test_packed_experts_add_no_error_beyond_the_activation_dtype(fmt, tokens, dtype):
    """Held against the fp32 products of the same weights, both paths' 16-bit outputs are no
    further off than the 16-bit dequantized reference's (which rounds each weight to the dtype and
    computes in it): the kernels form each weight exactly and round where the reference rounds."""
    e, k, hidden, inter = 8, 4, 128, 64
    w13, s13, g13, w2, s2, g2 = random_layer(e, hidden, inter, fmt, seed=11 + tokens)
    gen = torch.Generator().manual_seed(tokens + 3)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = M.moe_topk_routing_ref(torch.randn(tokens, e, generator=gen).to(DEVICE), k, True)
    args = (w13, s13, g13, w2, s2, g2, weights, ids, fmt)
    exact = M.fused_moe_w4a16_ref(x.float(), *args)

    def error(out: torch.Tensor) -> float:
        return ((out.float() - exact).norm() / exact.norm()).item()

    bound = 1.05 * error(M.fused_moe_w4a16_ref(x, *args))
    for cfg in (M.MoeTileConfig(M.PAIR_MAJOR, 16, 64, 4, 1), M.MoeTileConfig(16, 32, 64, 4, 1)):
        assert error(M.fused_moe_w4a16(x, *args, cfg)) <= bound, cfg


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("shape", [(1, 8, 4, 128, 64), (3, 8, 2, 96, 64)], ids=["t1", "t3-96"])
def test_pair_major_gate_up_split_along_k(shape, splits):
    """gate_up's K in 2 or 4 programs per tile, joined by the tile's last arrival: the one-program
    result up to fp32 association, the same bytes on a second call (the arrival counts are back
    at zero), and a hidden size of 96 leaves the last split partly past K."""
    t, e, k, hidden, inter = shape
    fmt, dtype = "nvfp4", torch.float32
    w13, s13, g13, w2, s2, g2 = random_layer(e, hidden, inter, fmt, seed=5 * t + splits)
    gen = torch.Generator().manual_seed(t + 7)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = M.moe_topk_routing_ref(torch.randn(t, e, generator=gen).to(DEVICE), k, True)
    args = (x, w13, s13, g13, w2, s2, g2, weights, ids, fmt)
    one = M.MoeTileConfig(M.PAIR_MAJOR, 16, 32, 4, 1)
    split = M.MoeTileConfig(M.PAIR_MAJOR, 16, 32, 4, 1, split_k=splits)
    M.check_tile_config("w4a16", split)
    want = M.fused_moe_w4a16_routed(*args, one)
    got = M.fused_moe_w4a16_routed(*args, split)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    assert torch.equal(M.fused_moe_w4a16_routed(*args, split), got)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_pair_major_down_kernel_takes_a_tile_of_its_own(fmt):
    """A pair-major config's down_* fields set the down kernel's rows, K step and warps apart
    from gate_up's (gate_up in one 128-long step here, down in 32-long ones): the shared tile's
    result up to fp32 association."""
    t, e, k, hidden, inter = 2, 8, 4, 128, 96
    w13, s13, g13, w2, s2, g2 = random_layer(e, hidden, inter, fmt, seed=17)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(t, hidden, generator=gen).to(DEVICE, torch.float32)
    weights, ids = M.moe_topk_routing_ref(torch.randn(t, e, generator=gen).to(DEVICE), k, True)
    args = (x, w13, s13, g13, w2, s2, g2, weights, ids, fmt)
    shared = M.MoeTileConfig(M.PAIR_MAJOR, 16, 32, 4, 1)
    own = M.MoeTileConfig(M.PAIR_MAJOR, 4, 128, 1, 1, down_block_n=32, down_block_k=32,
                          down_num_warps=2)  # fmt: skip
    M.check_tile_config("w4a16", own)
    assert own.down_tile() == (32, 32, 2) and shared.down_tile() == (16, 32, 4)
    want = M.fused_moe_w4a16_routed(*args, shared)
    got = M.fused_moe_w4a16_routed(*args, own)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    ref = M.fused_moe_w4a16_ref(*args)
    torch.testing.assert_close(got.sum(dim=1), ref, rtol=1e-4, atol=1e-4 * scale)


def test_split_k_is_a_pair_major_power_of_two():
    with pytest.raises(M.MoeKernelError, match="split_k"):
        M.check_tile_config("w4a16", M.MoeTileConfig(M.PAIR_MAJOR, 16, 64, 4, 1, split_k=3))
    with pytest.raises(M.MoeKernelError, match="split_k"):
        M.check_tile_config("w4a16", M.MoeTileConfig(16, 32, 64, 4, 1, split_k=2))


def test_tile_configs_accept_pair_major_for_w4a16_only():
    M.check_tile_config("w4a16", PAIRS)
    with pytest.raises(M.MoeKernelError, match="block_m"):
        M.check_tile_config("w4a16", M.MoeTileConfig(8, 16, 64, 4, 1))
    w4a8 = M.W4A8TileConfig(block_m=M.PAIR_MAJOR, block_n=32, num_warps=4, num_stages=2)
    with pytest.raises(M.MoeKernelError, match="block_m"):
        M.check_tile_config("w4a8", w4a8)


def test_gemm_rejects_bad_inputs():
    w13, s13, g13, w2, s2, g2 = random_layer(2, 64, 32, "nvfp4", seed=0)
    x = torch.zeros(1, 64, device=DEVICE)
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    wts = torch.ones(1, 1, device=DEVICE)
    with pytest.raises(M.MoeKernelError, match="format"):
        M.fused_moe_w4a16(x, w13, s13, g13, w2, s2, g2, wts, ids, "int4", SMALL)
    with pytest.raises(M.MoeKernelError, match="w13 scales"):
        M.fused_moe_w4a16(x, w13, s13[:, :, :2], g13, w2, s2, g2, wts, ids, "nvfp4", SMALL)
    with pytest.raises(M.MoeKernelError, match="w13 must be"):
        M.fused_moe_w4a16(x[:, :32], w13, s13, g13, w2, s2, g2, wts, ids, "nvfp4", SMALL)
