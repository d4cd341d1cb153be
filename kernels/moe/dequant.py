"""In-kernel decoding of packed 4-bit weights (E2M1 codes with E4M3 / E8M0 block scales)."""

from __future__ import annotations

import triton.language as tl

from .._jit import INTERPRETED, jit

# --------------------------------------------------------------------------------------------------
# In-kernel dequantization


@jit
def _scale_value(byte, IS_NVFP4: tl.constexpr):
    """A scale byte (int32) -> fp32: E4M3 (NVFP4) or E8M0 (MXFP4), NaN patterns included."""
    nan = tl.full(byte.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    if IS_NVFP4:
        e = (byte >> 3) & 15
        m = byte & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        mag = tl.where((e == 15) & (m == 7), nan, mag)
        return tl.where((byte & 0x80) != 0, -mag, mag)
    else:
        # 2^(b - 127): the exponent field is b itself; b = 0 is the subnormal 2^-127
        val = tl.where(byte == 0, 1 << 22, byte << 23).to(tl.float32, bitcast=True)
        return tl.where(byte == 255, nan, val)


@jit
def _e2m1_e4m3_bits(nibbles):
    """E2M1 codes in the low 4 bits (integers) -> e4m3 bytes holding each value * 2^-6.

    Moving the sign to bit 7 and the two exponent bits and the mantissa bit to bits 4..2 makes an
    e4m3 byte whose value is the E2M1 value times 2^-6 (E2M1's subnormal 0.5 lands on e4m3's
    subnormal 2^-7), so the hardware fp8 conversion replaces a decode of selects and shifts; the
    callers fold the 2^6 into their scales."""
    return ((nibbles << 2) & 0x1C) | ((nibbles << 4) & 0x80)


@jit
def _e2m1_as_e4m3(nibbles):
    return _e2m1_e4m3_bits(nibbles).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@jit
def _e2m1_pairs_as_f16(packed):
    """Packed E2M1 bytes (uint8) -> (low nibble, high nibble) values * 2^-6 as float16, four bytes
    per 32-bit register: the nibbles move into e4m3 bytes with whole-word bit operations and the
    hardware converts two e4m3 bytes per instruction (~1.4 instructions per weight, where byte-wise
    Triton code spends ~8 on unpacking and repacking bytes)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, u, lo, hi;
        .reg .b16 l0, l1, h0, h1;
        shl.b32 t, $4, 2;
        and.b32 t, t, 0x1C1C1C1C;
        shl.b32 u, $4, 4;
        and.b32 u, u, 0x80808080;
        or.b32 lo, t, u;
        shr.b32 t, $4, 2;
        and.b32 t, t, 0x1C1C1C1C;
        and.b32 u, $4, 0x80808080;
        or.b32 hi, t, u;
        mov.b32 {l0, l1}, lo;
        mov.b32 {h0, h1}, hi;
        cvt.rn.f16x2.e4m3x2 $0, l0;
        cvt.rn.f16x2.e4m3x2 $1, l1;
        cvt.rn.f16x2.e4m3x2 $2, h0;
        cvt.rn.f16x2.e4m3x2 $3, h1;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


def _ptx_decode(block_n: int, block_k: int, num_warps: int) -> bool:
    """Whether a W4 tile of these sizes decodes through `_e2m1_pairs_as_f16`: on CUDA, with at
    least the four packed bytes per thread that one call takes."""
    return not INTERPRETED and block_n * block_k // 2 >= 4 * 32 * num_warps


@jit
def _w4_tile(
    w_ptrs,  # [BK/2, BN] pointers to packed bytes
    s_ptrs,  # [BK/G, BN] pointers to the scale bytes of the tile's groups
    gscale,  # fp32 scalar (1.0 for MXFP4)
    wmask,
    smask,
    DT: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    GROUP: tl.constexpr,
    USE_PTX: tl.constexpr,  # the inline-PTX nibble decode (CUDA; the interpreter runs no PTX)
):
    """(even, odd) weight tiles [BK/2, BN] in DT, each e2m1 * (scale * global) rounded once from
    fp32, as the reference dequantization computes it."""
    packed = tl.load(w_ptrs, mask=wmask, other=0)
    sbyte = tl.load(s_ptrs, mask=smask, other=0)
    if IS_NVFP4:
        # (scale * global) * 2^6 is exact, so each product below rounds like e2m1 * (scale*global)
        step = sbyte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (gscale * 64.0)
    else:
        step = _scale_value(sbyte.to(tl.int32), IS_NVFP4)  # 2^(b-127) may be near fp32's limit
    NG: tl.constexpr = step.shape[0]
    BN: tl.constexpr = step.shape[1]
    step = tl.reshape(
        tl.broadcast_to(step[:, None, :], [NG, GROUP // 2, BN]), [NG * GROUP // 2, BN]
    )
    if USE_PTX:
        lo, hi = _e2m1_pairs_as_f16(packed)
    else:
        lo = _e2m1_as_e4m3(packed)
        hi = _e2m1_as_e4m3(packed >> 4)
    if IS_NVFP4:
        even = (lo.to(tl.float32) * step).to(DT)
        odd = (hi.to(tl.float32) * step).to(DT)
    else:
        even = ((lo.to(tl.float32) * 64.0) * step).to(DT)
        odd = ((hi.to(tl.float32) * 64.0) * step).to(DT)
    return even, odd
