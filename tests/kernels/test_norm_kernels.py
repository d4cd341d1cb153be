"""rms_norm, add_rms_norm, qk_norm_rope and qk_norm_rope_store_kv against their torch references:
fresh random inputs, strided rows (slices of a fused projection's output), sizes that are not
powers of two, zero, one and several tokens, NaN-poisoned caches. On CPU in Triton's interpreter
(fp32/fp16); on CUDA bf16 and FP8 caches join."""

from __future__ import annotations

import libkk.kernels.norm as norm
import pytest
import torch
from kernel_env import DEVICE, ON_CUDA, RUNS_KERNELS
from libkk.kernels import (
    FP8_DTYPE,
    add_rms_norm,
    add_rms_norm_ref,
    qk_norm_rope,
    qk_norm_rope_ref,
    qk_norm_rope_store_kv,
    qk_norm_rope_store_kv_ref,
    rms_norm,
    rms_norm_ref,
    store_kv,
)

from libkk.layers.rotary import RopeConfig, RotaryEmbedding

pytestmark = RUNS_KERNELS

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# One rounding step of the dtype apart at most (the reduction order differs).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Within a rounding step of values of size `scale` (what an input of that size may round
    by inside a reference that rounds every product)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 4096])
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_rms_norm_and_add_rms_norm_equal_the_reference(dtype, hidden, num_tokens):
    g = torch.Generator().manual_seed(hidden + num_tokens)
    # x is a column slice of a wider output (rows strided), as a fused projection's part is
    wide = torch.randn(num_tokens, hidden + 24, generator=g).to(dtype).to(DEVICE)
    x = wide[:, 8 : 8 + hidden]
    residual = (torch.randn(num_tokens, hidden, generator=g) * 4).to(dtype).to(DEVICE)
    weight = (1 + torch.randn(hidden, generator=g) / 4).to(dtype).to(DEVICE)
    _close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), dtype)
    out, summed = add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_summed = add_rms_norm_ref(x, residual, weight, 1e-6)
    _close(out, want_out, dtype)
    assert torch.equal(summed, want_summed)  # one rounding of the same sum


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "terms"), [(0, 8), (1, 8), (5, 1), (3, 2)])
def test_add_rms_norm_sums_a_terms_axis_first(dtype, num_tokens, terms):
    """x [T, K, hidden] (an MoE layer's routed expert outputs): the op sums the K terms in order
    in fp32, rounds once (what `x.sum(dim=1)` computes), then adds the residual and normalizes."""
    hidden = 100
    g = torch.Generator().manual_seed(num_tokens * 10 + terms)
    x = torch.randn(num_tokens, terms, hidden, generator=g).to(dtype).to(DEVICE)
    residual = (torch.randn(num_tokens, hidden, generator=g) * 4).to(dtype).to(DEVICE)
    weight = (1 + torch.randn(hidden, generator=g) / 4).to(dtype).to(DEVICE)
    out, summed = add_rms_norm(x, residual, weight, 1e-6)
    terms_sum = x[:, 0].float().clone()  # (a copy: fp32 x's .float() is x itself)
    for k in range(1, terms):
        terms_sum += x[:, k].float()
    want_out, want_summed = add_rms_norm(terms_sum.to(dtype), residual, weight, 1e-6)
    assert out.shape == summed.shape == residual.shape
    assert torch.equal(summed, want_summed) and torch.equal(out, want_out)
    ref_out, ref_summed = add_rms_norm_ref(x, residual, weight, 1e-6)
    _close(summed, ref_summed, dtype)
    _close(out, ref_out, dtype)


def test_add_rms_norm_rejects_a_shape_that_is_not_residuals():
    x, residual = torch.zeros(3, 2, 64, device=DEVICE), torch.zeros(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="residual's shape"):
        add_rms_norm(x, residual, torch.ones(64, device=DEVICE), 1e-6)


def test_rms_norm_keeps_leading_dims_and_promotes_to_the_weight_dtype():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 32, generator=g).to(torch.float16).to(DEVICE)
    weight = torch.randn(32, generator=g).to(DEVICE)  # fp32
    got = rms_norm(x, weight, 1e-5)
    assert got.shape == (3, 4, 32) and got.dtype == torch.float32
    _close(got, rms_norm_ref(x, weight, 1e-5), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
# (q heads, kv heads, head_dim): small layouts, an odd one, and Qwen3-8B's
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 3, 24), (32, 8, 128)])
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
def test_qk_norm_rope_equals_the_reference(dtype, heads, num_tokens, norm):
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(num_heads * 100 + num_tokens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    qkv = (qkv * 3).to(dtype).to(DEVICE)
    q = qkv[:, : num_heads * head_dim]  # strided rows, as the fused projection's parts
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    q_weight = (1 + torch.randn(head_dim, generator=g) / 4).to(dtype).to(DEVICE)
    k_weight = (1 + torch.randn(head_dim, generator=g) / 4).to(dtype).to(DEVICE)
    with torch.device(DEVICE):
        rope = RotaryEmbedding(head_dim, 512, RopeConfig(theta=10000.0))
    positions = torch.randint(0, 512, (num_tokens,), generator=g).to(DEVICE)
    weights = (q_weight, k_weight) if norm else (None, None)
    args = (*weights, rope.cos_sin_cache, positions, 1e-6)
    got_q, got_k = qk_norm_rope(q, k, *args)
    want_q, want_k = qk_norm_rope_ref(q, k, *args)
    # Without the norm the rotation's products are as large as the inputs; the reference rounds
    # each of them, the kernel only the result.
    scale = 1.0 if norm or not num_tokens else 2 * float(qkv.abs().max())
    _close(got_q, want_q, dtype, scale)
    _close(got_k, want_k, dtype, scale)


def test_qk_norm_rope_reference_is_the_model_path():
    """The reference equals q/k RMSNorm modules, then RotaryEmbedding (the Llama rotary path)."""
    from libkk.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(5)
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 32
    q = torch.randn(num_tokens, num_heads * head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(num_tokens, num_kv_heads * head_dim, generator=g).to(torch.bfloat16)
    q_norm, k_norm = RMSNorm(head_dim).to(torch.bfloat16), RMSNorm(head_dim).to(torch.bfloat16)
    with torch.no_grad():
        q_norm.weight.normal_(1, 0.2, generator=g)
        k_norm.weight.normal_(1, 0.2, generator=g)
    rope = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0))
    positions = torch.tensor([0, 3, 9, 63, 17])
    want_q, want_k = rope(
        positions,
        q_norm(q.view(num_tokens, num_heads, head_dim)).view(num_tokens, -1),
        k_norm(k.view(num_tokens, num_kv_heads, head_dim)).view(num_tokens, -1),
    )
    got_q, got_k = qk_norm_rope_ref(
        q, k, q_norm.weight, k_norm.weight, rope.cos_sin_cache, positions, q_norm.eps
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_qk_norm_rope_reference_without_norms_is_the_rotary_module():
    """Without weights the reference is RotaryEmbedding's rotation, bit for bit (the path of
    every family without q/k norms), YaRN's scaled table included."""
    g = torch.Generator().manual_seed(6)
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 32
    q = torch.randn(num_tokens, num_heads * head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(num_tokens, num_kv_heads * head_dim, generator=g).to(torch.bfloat16)
    yarn = RopeConfig(
        rope_type="yarn", theta=150000.0, factor=32.0, original_max_position_embeddings=4096
    )
    rope = RotaryEmbedding(head_dim, 64, yarn)
    positions = torch.tensor([0, 3, 9, 63, 17])
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = qk_norm_rope_ref(q, k, None, None, rope.cos_sin_cache, positions, 0.0)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_qk_norm_rope_takes_both_norm_weights_or_neither():
    q, k = torch.zeros(1, 64), torch.zeros(1, 32)
    table, positions = torch.zeros(8, 32), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="together"):
        qk_norm_rope_ref(q, k, torch.ones(32), None, table, positions, 1e-6)
    with pytest.raises(ValueError, match="head_dim 32"):
        qk_norm_rope_ref(q, k, torch.ones(16), torch.ones(16), table, positions, 1e-6)


def _qk_case(
    g: torch.Generator,
    num_tokens: int,
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    norm: bool = True,
):
    """q, k, v (column slices of one fused projection's output) and the remaining arguments of
    qk_norm_rope: weights (None without `norm`), the rope table, positions, eps."""
    num_heads, num_kv_heads, head_dim = heads
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    qkv = (qkv * 3).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1)
    q_weight = (1 + torch.randn(head_dim, generator=g) / 4).to(dtype).to(DEVICE)
    k_weight = (1 + torch.randn(head_dim, generator=g) / 4).to(dtype).to(DEVICE)
    with torch.device(DEVICE):
        rope = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0))
    positions = torch.randint(0, 64, (num_tokens,), generator=g).to(DEVICE)
    weights = (q_weight, k_weight) if norm else (None, None)
    return q, k, v, (*weights, rope.cos_sin_cache, positions, 1e-6)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(d, d) for d in DTYPES] + ([(torch.bfloat16, FP8_DTYPE)] if ON_CUDA else []),
)
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 3, 24), (32, 8, 128)])
@pytest.mark.parametrize("num_tokens", [0, 7])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
def test_qk_norm_rope_store_kv_equals_the_two_ops(dtype, cache_dtype, heads, num_tokens, norm):
    """The fused op writes qk_norm_rope's q into q_out and leaves the cache exactly as store_kv of
    qk_norm_rope's k (and v) does; padded rows (the null block, -1) write nothing."""
    num_heads, num_kv_heads, head_dim = heads
    page, num_blocks = 4, 6
    g = torch.Generator().manual_seed(num_heads + num_tokens)
    q, k, v, args = _qk_case(g, num_tokens, heads, dtype, norm)
    real = torch.randperm((num_blocks - 1) * page, generator=g)[: max(num_tokens - 2, 0)] + page
    slots = torch.cat([real, torch.tensor([2, -1])])[:num_tokens].to(DEVICE)
    shape = (2, num_blocks, page, num_kv_heads, head_dim)
    poisoned = torch.full(shape, float("nan")).to(cache_dtype).to(DEVICE)
    k_scale = torch.tensor([0.05], device=DEVICE)  # FP8 only: large keys saturate
    v_scale = torch.tensor([2.0], device=DEVICE)

    want = poisoned.clone()
    want_q, want_k = qk_norm_rope(q, k, *args)
    rows = (num_tokens, num_kv_heads, head_dim)
    store_kv(want_k.view(rows), v.view(rows), want, slots, k_scale, v_scale)
    got = poisoned.clone()
    got_q = torch.full_like(want_q, float("nan"))
    qk_norm_rope_store_kv(q, k, v, *args, got, slots, k_scale, v_scale, got_q)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got[:, 0].float().isnan().all()  # the null block: padded rows wrote nothing

    ref = poisoned.clone()
    ref_q = torch.empty_like(want_q)
    qk_norm_rope_store_kv_ref(q, k, v, *args, ref, slots, k_scale, v_scale, ref_q)
    scale = 1.0 if norm or not num_tokens else 2 * float(torch.cat([q, k], 1).abs().max())
    _close(got_q, ref_q, dtype, scale)
    if cache_dtype != FP8_DTYPE:  # FP8's one-code steps are far coarser than the dtype's
        written = ~ref.isnan()
        assert torch.equal(written, ~got.isnan())
        _close(got[written], ref[written], dtype, scale)


@pytest.mark.parametrize("dtype", DTYPES)
# (q heads, kv heads, head_dim): GQA groups of 3 and 5, and q heads filling 2.5 blocks of 8
@pytest.mark.parametrize("heads", [(6, 2, 16), (5, 1, 32), (20, 4, 16)])
def test_qk_norm_rope_blocks_of_heads_mask_the_heads_past_the_last(dtype, heads, monkeypatch):
    """A program normalizes and rotates a block of one token's heads. Whatever the block size
    (and whether or not it divides the head counts), both ops give the bits of one head a
    program, the references' values, and the fused op the two ops' q and cache."""
    num_heads, num_kv_heads, head_dim = heads
    num_tokens, page, num_blocks = 6, 4, 6
    g = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    q, k, v, args = _qk_case(g, num_tokens, heads, dtype)
    real = torch.randperm((num_blocks - 1) * page, generator=g)[: num_tokens - 2] + page
    slots = torch.cat([real[:2], torch.tensor([-1, 2]), real[2:]]).to(DEVICE)  # padded rows
    poisoned = torch.full((2, num_blocks, page, num_kv_heads, head_dim), float("nan"))
    poisoned = poisoned.to(dtype).to(DEVICE)
    scales = torch.tensor([0.05], device=DEVICE), torch.tensor([2.0], device=DEVICE)

    def run() -> list[torch.Tensor]:
        got_q, got_k = qk_norm_rope(q, k, *args)
        cache, fused_q = poisoned.clone(), torch.full_like(got_q, float("nan"))
        qk_norm_rope_store_kv(q, k, v, *args, cache, slots, *scales, fused_q)
        return [t.view(torch.uint8) for t in (got_q, got_k, fused_q, cache)]

    monkeypatch.setattr(norm, "_heads_per_program", lambda num_heads: 1)
    one_head = run()
    for block in [2, 4, 16]:  # and 8, the launcher's choice here, below
        monkeypatch.setattr(norm, "_heads_per_program", lambda num_heads, block=block: block)
        assert all(map(torch.equal, run(), one_head)), f"{block} heads a program"
    monkeypatch.undo()  # the launcher's own choice
    got = run()
    assert all(map(torch.equal, got, one_head))
    got_q, got_k, fused_q, cache = (t.view(dtype) for t in got)
    want_q, want_k = qk_norm_rope_ref(q, k, *args)
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    assert torch.equal(fused_q, got_q)
    rows = (num_tokens, num_kv_heads, head_dim)
    want = poisoned.clone()
    store_kv(got_k.view(rows), v.view(rows), want, slots, *scales)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert cache[:, 0].float().isnan().all()  # the null block: padded rows wrote nothing
