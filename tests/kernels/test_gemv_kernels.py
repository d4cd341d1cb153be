"""linear and gate_up_silu (the one-token GEMV, the few-token skinny kernel) against their torch
references: every block configuration (plain, wide outputs, split K for tall K and for narrow
outputs), one token, a few, and the F.linear fallback for more, strided token rows, bias, sizes
that are not multiples of the blocks. On CPU in Triton's interpreter (fp32/fp16); on CUDA bf16
joins."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, ON_CUDA, RUNS_KERNELS
from libkk.kernels import gate_up_silu, gate_up_silu_ref, linear, linear_ref
from libkk.kernels.gemv import (
    SKINNY_MAX_TOKENS,
    GemvConfig,
    SkinnyConfig,
    gemv,
    gemv_config,
    gemv_fits,
    skinny,
    skinny_config,
    skinny_fits,
)
from libkk.kernels.split_join import arrival_counts

pytestmark = RUNS_KERNELS

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# (out, in): a plain grid with a partial row block, a short K, a router-sized output, a split tall
# K, a split narrow output, and on CUDA a wide output (2,049 programs: 12 s each in the
# interpreter) and the 8B o_proj (the narrow output's branch, split 4 ways).
SHAPES = [(301, 1100), (37, 200), (24, 1100), (8, 8200), (40, 4096)] + (
    [(16388, 64), (4096, 4096)] if ON_CUDA else []
)


def _inputs(rows, n, k, dtype, seed, bias):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, k + 16, generator=g).to(dtype).to(DEVICE)
    x = wide[:, 8 : 8 + k]  # rows strided, as a slice of a wider activation is
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, weight, b


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    # fp32 sums in another order; the result rounds to the dtype once
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_shapes_cover_every_block_configuration():
    configs = {gemv_config(n, k) for n, k in SHAPES}
    assert {c.splits > 1 for c in configs} == {True, False}
    assert len(configs) == len(SHAPES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_the_reference(dtype, n, k, bias):
    x, weight, b = _inputs(1, n, k, dtype, n + k, bias)
    assert gemv_fits(x, weight)
    _close(linear(x, weight, b), linear_ref(x, weight, b), dtype)


@pytest.mark.parametrize("n,k", [(8, 8200), (40, 4096)])
def test_split_k_is_joined_by_the_last_program(n, k):
    """The split sums, joined in the kernel, equal the one-program sums up to fp32 association;
    a second call gives the same bytes and every arrival count is back at zero."""
    x, weight, b = _inputs(1, n, k, torch.float32, 7, bias=True)
    cfg = gemv_config(n, k)
    assert cfg.splits > 1
    first = linear(x, weight, b)
    assert torch.equal(linear(x, weight, b), first)
    assert not arrival_counts(x.device, 1).any()
    _close(first, gemv(x, weight, b, silu_mul=False, cfg=cfg._replace(splits=1)), torch.float32)


@pytest.mark.parametrize("k", [256, 600, 1100])
def test_split_k_with_one_step_or_none_per_split(k):
    """Splits of one K step (each program's only step is the one it loads before the PDL wait),
    and splits that start past K (600 over four 256-wide splits: the last has no columns)."""
    x, weight, b = _inputs(1, 12, k, torch.float32, k, bias=True)
    cfg = GemvConfig(block_n=4, block_k=256, unroll=1, splits=4, num_warps=4)
    _close(gemv(x, weight, b, silu_mul=False, cfg=cfg), linear_ref(x, weight, b), torch.float32)


def test_split_k_refuses_unrolled_steps():
    x, weight, _ = _inputs(1, 12, 1024, torch.float32, 3, bias=False)
    with pytest.raises(ValueError, match="unroll 1"):
        gemv(x, weight, None, silu_mul=False, cfg=GemvConfig(4, 256, 2, 2, 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,bias", [(1, False), (1, True), (3, False), (6, True)])
def test_gate_up_silu_equals_the_reference(dtype, rows, bias):
    n, k = 2 * 45, 300
    x, weight, b = _inputs(rows, n, k, dtype, rows, bias)
    got = gate_up_silu(x, weight, b)
    _close(got, gate_up_silu_ref(x, weight, b), dtype)
    assert got.shape == (rows, n // 2)


# (tokens, out, in): one row block split four ways (K = 2,100 is not a multiple of a split), a
# partial row block unsplit, 16 and 32 tokens (M_PAD 16 and 32) over split K.
SKINNY_CASES = [(2, 40, 2100), (5, 301, 300), (16, 24, 1100), (32, 70, 1030)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,n,k", SKINNY_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_skinny_kernel_equals_the_reference(dtype, tokens, n, k, bias):
    x, weight, b = _inputs(tokens, n, k, dtype, tokens + n + k, bias)
    assert not gemv_fits(x, weight) and skinny_fits(x, weight)
    _close(skinny(x, weight, b, silu_mul=False), linear_ref(x, weight, b), dtype)
    w2 = torch.cat([weight, weight.flip(0)])  # gate rows, then up rows
    b2 = None if b is None else torch.cat([b, b.flip(0)])
    _close(skinny(x, w2, b2, silu_mul=True), gate_up_silu_ref(x, w2, b2), dtype)


@pytest.mark.parametrize("route", [False, True])
def test_linear_routes_a_few_tokens_where_told(monkeypatch, route):
    """With ROUTE_SKINNY the ops take the skinny kernel for 2 to 32 tokens, without it cuBLAS
    (F.linear); both equal the references."""
    from libkk.kernels import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "ROUTE_SKINNY", route)
    calls = []
    real = gemv_module.skinny
    monkeypatch.setattr(gemv_module, "skinny", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, weight, b = _inputs(4, 40, 300, torch.float32, 9, bias=True)
    _close(linear(x, weight, b), linear_ref(x, weight, b), torch.float32)
    _close(gate_up_silu(x, weight, b), gate_up_silu_ref(x, weight, b), torch.float32)
    assert len(calls) == (2 if route else 0)


def test_the_skinny_cases_split_and_do_not():
    assert {skinny_config(n, k, t).splits > 1 for t, n, k in SKINNY_CASES} == {True, False}


def test_skinny_split_k_is_joined_by_the_last_program():
    """As the GEMV's: the same bytes on a second call, the counts back at zero, the one-program
    sums up to fp32 association; splits past K (1,030 columns over eight 128-wide splits)."""
    x, weight, b = _inputs(7, 70, 1030, torch.float32, 11, bias=True)
    cfg = SkinnyConfig(block_n=64, block_k=128, splits=8, num_warps=4, num_stages=2)
    first = skinny(x, weight, b, silu_mul=False, cfg=cfg)
    assert torch.equal(skinny(x, weight, b, silu_mul=False, cfg=cfg), first)
    assert not arrival_counts(x.device, 2).any()
    _close(first, skinny(x, weight, b, silu_mul=False, cfg=cfg._replace(splits=1)), torch.float32)
    _close(first, linear_ref(x, weight, b), torch.float32)


def test_more_tokens_than_the_skinny_kernel_takes_are_exact_f_linear():
    x, weight, b = _inputs(SKINNY_MAX_TOKENS + 1, 20, 64, torch.float32, 5, bias=True)
    assert not gemv_fits(x, weight) and not skinny_fits(x, weight)
    assert torch.equal(linear(x, weight, b), linear_ref(x, weight, b))


def test_mixed_dtypes_and_no_tokens_take_f_linear():
    x, weight, _ = _inputs(1, 20, 64, torch.float32, 6, bias=False)
    assert not gemv_fits(x.half(), weight)
    assert linear(x[:0], weight).shape == (0, 20)
    torch.testing.assert_close(linear(x.half(), weight.half()).float(), x @ weight.t(),
                               rtol=2e-3, atol=2e-3)  # fmt: skip
