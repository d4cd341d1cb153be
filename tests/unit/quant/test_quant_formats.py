"""The reference quantizers hit the exact bytes of each format and stay within its rounding step."""

from __future__ import annotations

import math

import pytest
import torch

from libkk.quant.formats import (
    E2M1_VALUES,
    MXFP4Weight,
    NVFP4Weight,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_to_float,
    e8m0_to_float,
    float_to_e2m1,
    pack_e2m1,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_e2m1,
)

TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including the sign of zero (fp32 compared by bit pattern)."""
    return a.shape == b.shape and torch.equal(
        a.float().view(torch.int32), b.float().view(torch.int32)
    )


# --------------------------------------------------------------------------------------------------
# E2M1


def test_every_e2m1_code_has_its_table_value():
    values = e2m1_to_float(torch.arange(16, dtype=torch.uint8))
    assert _bits_equal(values, torch.tensor(TABLE))
    assert torch.signbit(values[8]) and not torch.signbit(values[0])


def test_float_to_e2m1_inverts_the_table_including_negative_zero():
    assert torch.equal(float_to_e2m1(torch.tensor(TABLE)), torch.arange(16, dtype=torch.uint8))


@pytest.mark.parametrize(
    ("x", "code"),
    [
        (0.2, 0),
        (0.25, 0),  # tie 0 | 0.5 -> even code 0
        (0.26, 1),
        (0.75, 2),  # tie 0.5 | 1 -> code 2
        (1.25, 2),  # tie 1 | 1.5 -> code 2
        (1.75, 4),  # tie 1.5 | 2 -> code 4
        (2.5, 4),  # tie 2 | 3 -> code 4
        (3.5, 6),  # tie 3 | 4 -> code 6
        (4.9, 6),
        (5.0, 6),  # tie 4 | 6 -> code 6
        (5.01, 7),
        (6.5, 7),  # saturates
        (1e30, 7),
        (math.inf, 7),
        (-math.inf, 15),
        (-0.1, 8),  # keeps the sign: -0
        (-0.75, 10),
        (-5.0, 14),
    ],
)
def test_float_to_e2m1_rounds_ties_to_even_and_saturates(x, code):
    assert float_to_e2m1(torch.tensor([x])).item() == code
    assert float_to_e2m1(torch.tensor([x], dtype=torch.float64)).item() == code


def test_float_to_e2m1_is_nearest_value():
    x = torch.linspace(-7.0, 7.0, 4001)
    got = e2m1_to_float(float_to_e2m1(x))
    best = (x[:, None] - E2M1_VALUES[None, :]).abs().min(dim=1).values
    inside = x.abs() <= 6
    assert torch.equal((x - got).abs()[inside], best[inside])
    assert torch.equal(got[~inside], 6.0 * torch.sign(x[~inside]))


def test_float_to_e2m1_rejects_nan_and_integers():
    with pytest.raises(ValueError, match="NaN"):
        float_to_e2m1(torch.tensor([1.0, math.nan]))
    with pytest.raises(ValueError, match="floating"):
        float_to_e2m1(torch.tensor([1, 2]))


def test_pack_puts_the_even_element_in_the_low_nibble():
    packed = pack_e2m1(torch.tensor([0x1, 0x2, 0xF, 0x0], dtype=torch.uint8))
    assert packed.tolist() == [0x21, 0x0F]
    assert unpack_e2m1(torch.tensor([0xAB], dtype=torch.uint8)).tolist() == [0xB, 0xA]


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (3, 5, 64), generator=_gen(0), dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_e2m1(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_e2m1(unpack_e2m1(every_byte)), every_byte)


def test_pack_and_codes_errors():
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_e2m1(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="above 15"):
        pack_e2m1(torch.tensor([0, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_e2m1(torch.zeros(4, dtype=torch.int8))
    with pytest.raises(ValueError, match="uint8"):
        e2m1_to_float(torch.zeros(4, dtype=torch.int64))


# --------------------------------------------------------------------------------------------------
# NVFP4


def test_nvfp4_known_values():
    w = torch.zeros(1, 48)
    # Block 0 holds the tensor amax 1344 = 6 * 448 * 0.5: global 0.5, block scale 448, step 224.
    w[0, :4] = torch.tensor([1344.0, -672.0, 112.0, 0.0])
    # Block 1 has amax 6: block scale 6 / 6 / 0.5 = 2, step 1, so values are their own E2M1 values.
    w[0, 16:20] = torch.tensor([6.0, -0.5, 1.5, 4.0])
    # Block 2 is all zero: scale 1.0, as ModelOpt writes it.
    q = quantize_nvfp4(w)
    assert q.weight_scale_2.dtype == torch.float32 and q.weight_scale_2.shape == ()
    assert q.weight_scale_2.item() == 0.5
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (1, 3)
    assert q.weight_scale.float().tolist() == [[448.0, 2.0, 1.0]]
    codes = unpack_e2m1(q.weight)
    assert codes[0, :4].tolist() == [7, 13, 1, 0]
    assert codes[0, 16:20].tolist() == [7, 9, 3, 6]
    assert codes[0, 32:].eq(0).all()
    assert torch.equal(dequantize_nvfp4(q), w)


def test_nvfp4_round_trip_is_exact_on_the_grid():
    n, k = 8, 64
    g = _gen(1)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[:, ::16] = 7  # every block reaches 6 * its scale
    # Positive finite E4M3 bytes (0x7F is NaN), and one block at the top scale 448 (0x7E).
    scale_bytes = torch.randint(0x01, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)
    scale_bytes[0, 0] = 0x7E
    scales = scale_bytes.view(torch.float8_e4m3fn)
    g2 = torch.tensor(2.0**-5)
    w = (e2m1_to_float(codes).reshape(n, k // 16, 16) * (scales.float() * g2)[..., None]).reshape(
        n, k
    )
    q = quantize_nvfp4(w)
    assert q.weight_scale_2.item() == g2.item()
    assert torch.equal(q.weight_scale.view(torch.uint8), scale_bytes)
    assert torch.equal(q.weight, pack_e2m1(codes))
    assert _bits_equal(dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2), w)


def test_nvfp4_error_is_bounded_by_the_block_step():
    g = _gen(2)
    # Rows of different magnitude so block scales spread over the E4M3 range.
    w = torch.randn(32, 256, generator=g) * torch.logspace(-1, 1, 32)[:, None]
    q = quantize_nvfp4(w)
    err = (dequantize_nvfp4(q) - w).abs().reshape(32, 16, 16)
    step = (q.weight_scale.float() * q.weight_scale_2)[..., None]  # [N, K/16, 1]
    # Half the widest E2M1 gap (2) is one step; saturation past 6 costs less than that.
    assert (err <= step).all()
    block_amax = w.abs().reshape(32, 16, 16).amax(dim=-1)
    # The E4M3 scale is within 2^-4 of amax / 6, so per block max error <= amax / 6 * 17 / 16.
    assert (err.amax(dim=-1) <= block_amax / 6 * (17 / 16) * (1 + 1e-6)).all()


def test_nvfp4_all_zero_tensor_and_bf16_input():
    q = quantize_nvfp4(torch.zeros(2, 32, dtype=torch.bfloat16))
    assert q.weight_scale_2.item() == 1.0
    assert q.weight.eq(0).all() and q.weight_scale.float().eq(1).all()
    assert dequantize_nvfp4(q, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert dequantize_nvfp4(q).eq(0).all()


def test_nvfp4_block_whose_scale_underflows_e4m3_dequantizes_to_zero():
    w = torch.zeros(1, 32)
    w[0, 0] = 2688.0  # global 1.0
    w[0, 16] = 1e-4  # block scale 1.7e-5 is below half the smallest e4m3 subnormal (2^-9)
    q = quantize_nvfp4(w)
    assert q.weight_scale.float().tolist() == [[448.0, 0.0]]
    assert unpack_e2m1(q.weight)[0, 16:].eq(0).all()
    assert dequantize_nvfp4(q)[0, 16:].eq(0).all()


def test_nvfp4_state_dict_uses_modelopt_names():
    q = quantize_nvfp4(torch.randn(4, 32, generator=_gen(3)))
    assert list(q.state_dict("mlp.down_proj.")) == [
        "mlp.down_proj.weight",
        "mlp.down_proj.weight_scale",
        "mlp.down_proj.weight_scale_2",
    ]
    with_input = NVFP4Weight(
        weight=q.weight,
        weight_scale=q.weight_scale,
        weight_scale_2=q.weight_scale_2,
        input_scale=torch.tensor(0.25),
    )
    assert "input_scale" in with_input.state_dict()


def test_nvfp4_errors():
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(torch.randn(32))
    with pytest.raises(ValueError, match="float32"):
        quantize_nvfp4(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="Inf or NaN"):
        quantize_nvfp4(torch.full((4, 32), math.inf))
    q = quantize_nvfp4(torch.randn(4, 32, generator=_gen(4)))
    with pytest.raises(ValueError, match="weight_scale must be torch.float8_e4m3fn"):
        dequantize_nvfp4(q.weight, q.weight_scale.float(), q.weight_scale_2)
    with pytest.raises(ValueError, match="shape"):
        dequantize_nvfp4(q.weight, q.weight_scale[:, :1], q.weight_scale_2)
    with pytest.raises(ValueError, match="one fp32 value"):
        dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2.double())
    with pytest.raises(ValueError, match="uint8"):
        dequantize_nvfp4(q.weight.int(), q.weight_scale, q.weight_scale_2)


# --------------------------------------------------------------------------------------------------
# MXFP4


def test_e8m0_values():
    got = e8m0_to_float(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(got[6].item())


@pytest.mark.parametrize(
    ("amax", "byte"),
    [
        (6.0, 127),  # floor(log2 6) - 2 = 0
        (7.0, 127),  # 7 saturates to 6
        (8.0, 128),
        (4.0, 127),
        (3.9999998, 126),  # just under a power of two: one binade lower, then saturates
        (0.75, 124),
        (0.0, 0),  # zero block
        (2.0**-140, 0),  # below the E8M0 range: clamped
        (2.0**127, 252),
    ],
)
def test_mxfp4_reference_scale(amax, byte):
    w = torch.zeros(1, 32)
    w[0, 5] = -amax
    q = quantize_mxfp4(w)
    assert q.scale.dtype == torch.uint8 and q.scale.shape == (1, 1)
    assert q.scale.item() == byte


def test_mxfp4_known_values():
    w = torch.zeros(2, 64)
    w[0, :5] = torch.tensor([6.0, -3.0, 0.5, 7.0, -0.25])  # scale 1: 7 -> 6, -0.25 ties to -0
    w[1, 32:35] = torch.tensor([8.0, 5.0, -1.0])  # scale 2: values / 2 = 4, 2.5 -> 2, -0.5
    q = quantize_mxfp4(w)
    assert q.scale.tolist() == [[127, 0], [0, 128]]
    codes = unpack_e2m1(q.weight)
    assert codes[0, :5].tolist() == [7, 13, 1, 7, 8]
    assert codes[1, 32:35].tolist() == [6, 4, 9]
    d = dequantize_mxfp4(q)
    assert d[0, :5].tolist() == [6.0, -3.0, 0.5, 6.0, -0.0]
    assert d[1, 32:35].tolist() == [8.0, 4.0, -1.0]


def test_mxfp4_round_trip_is_exact_on_the_grid():
    n, k = 6, 128
    g = _gen(5)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[:, ::32] = 15  # every block reaches -6 * its scale
    scale = torch.randint(90, 160, (n, k // 32), generator=g, dtype=torch.uint8)
    w = (e2m1_to_float(codes).reshape(n, k // 32, 32) * e8m0_to_float(scale)[..., None]).reshape(
        n, k
    )
    q = quantize_mxfp4(w)
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.weight, pack_e2m1(codes))
    assert _bits_equal(dequantize_mxfp4(q.weight, q.scale), w)


def test_mxfp4_error_is_bounded_by_the_block_step():
    w = torch.randn(16, 256, generator=_gen(6)) * torch.logspace(-3, 3, 16)[:, None]
    q = quantize_mxfp4(w)
    err = (dequantize_mxfp4(q) - w).abs().reshape(16, 8, 32)
    scale = e8m0_to_float(q.scale)[..., None]  # [N, K/32, 1]
    inside = w.abs().reshape(16, 8, 32) <= 6 * scale
    # On the grid's range the error is at most half the widest gap; saturation stays under 2 steps.
    assert (err <= scale).where(inside, err < 2 * scale).all()
    block_amax = w.abs().reshape(16, 8, 32).amax(dim=-1)
    assert (err.amax(dim=-1) < block_amax / 2).all()  # scale <= amax / 4


def test_mxfp4_nan_scale_byte_makes_its_block_nan():
    q = quantize_mxfp4(torch.randn(2, 64, generator=_gen(7)))
    scale = q.scale.clone()
    scale[1, 0] = 0xFF
    d = dequantize_mxfp4(MXFP4Weight(weight=q.weight, scale=scale))
    assert d[1, :32].isnan().all()
    assert d[0].isfinite().all() and d[1, 32:].isfinite().all()


def test_mxfp4_errors():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match="float32"):
        quantize_mxfp4(torch.ones(2, 32, dtype=torch.int64))
    q = quantize_mxfp4(torch.randn(2, 64, generator=_gen(8)))
    with pytest.raises(ValueError, match="MXFP4 scale must be torch.uint8"):
        dequantize_mxfp4(q.weight, q.scale.float())
    with pytest.raises(ValueError, match="shape"):
        dequantize_mxfp4(q.weight, q.scale[:1])
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize_mxfp4(q.weight[:, :8], q.scale[:, :1])


# --------------------------------------------------------------------------------------------------
# FP8 block


@pytest.mark.parametrize(
    ("n", "k", "block"),
    [(1, 1, 128), (128, 128, 128), (130, 300, 128), (257, 129, 128), (70, 50, 32)],
)
def test_fp8_block_ragged_shapes(n, k, block):
    w = torch.randn(n, k, generator=_gen(n * k)) * 3.0
    q, scale = quantize_fp8_block(w, block=block)
    bn, bk = -(-n // block), -(-k // block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert scale.dtype == torch.float32 and scale.shape == (bn, bk)
    for i in range(bn):
        for j in range(bk):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            assert scale[i, j].item() == pytest.approx(tile.abs().max().item() / 448, rel=1e-6)
            qt = q[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            assert qt.abs().max().item() == 448.0  # each tile's amax lands on the top value
    d = dequantize_fp8_block(q, scale, block=block)
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    # E4M3 keeps 3 mantissa bits (relative half-ulp 2^-4); subnormals have spacing 2^-9.
    bound = torch.maximum(w.abs() * 2.0**-4, full * 2.0**-10) * (1 + 1e-5)
    assert ((d - w).abs() <= bound).all()


def test_fp8_block_round_trip_is_exact_on_the_grid_and_zero_tiles():
    g = _gen(9)
    values = torch.randint(0, 256, (200, 150), generator=g, dtype=torch.uint8)
    values[(values & 0x7F) == 0x7F] = 0x10  # no NaN bytes
    values[::128, ::128] = 0x7E  # every tile holds 448
    tile_scale = torch.tensor([[2.0**-8, 4.0], [0.5, 2.0**10]])
    full = tile_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :150]
    w = values.view(torch.float8_e4m3fn).float() * full
    w[128:, 128:] = 0.0  # one all-zero tile
    q, scale = quantize_fp8_block(w)
    assert scale.tolist() == [[2.0**-8, 4.0], [0.5, 0.0]]
    expect = values.clone()
    expect[128:, 128:] = 0
    assert torch.equal(q.view(torch.uint8), expect)
    assert _bits_equal(dequantize_fp8_block(q, scale), w)


def test_fp8_block_errors():
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_block(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8_block(torch.randn(4, 4), block=0)
    q, scale = quantize_fp8_block(torch.randn(130, 10, generator=_gen(10)))
    with pytest.raises(ValueError, match="shape"):
        dequantize_fp8_block(q, scale[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8_block(q.float(), scale)
    with pytest.raises(ValueError, match="torch.float32"):
        dequantize_fp8_block(q, scale.double())
