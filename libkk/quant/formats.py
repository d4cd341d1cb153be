"""Reference quantizers for the block-scaled weight formats: E2M1, NVFP4, MXFP4, FP8 block.

These are plain torch, written for exactness rather than speed: they define the bytes a checkpoint
holds and the values a kernel must reproduce. Every step is a correctly rounded (or exact) fp32
operation, so the same input gives the same bytes on any device.

E2M1 (FP4): 1 sign, 2 exponent bits (bias 1), 1 mantissa bit, no Inf/NaN. Codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are the same with the sign bit set. Two codes per byte, the
even element in the low nibble.

NVFP4 (ModelOpt): blocks of 16 along K, value = e2m1 * weight_scale[block] (E4M3) * weight_scale_2.
MXFP4 (OCP Microscaling v1.0): blocks of 32 along K, value = e2m1 * 2^(scale - 127), 0xFF is NaN.
FP8 block: e4m3 weights, one fp32 scale per 128 x 128 tile, value = e4m3 * scale[tile].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
FP8_BLOCK = 128
E8M0_NAN = 0xFF

# Index = code. The sign bit is bit 3, so code 8 is -0.0.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Midpoints between neighbouring magnitudes (codes c and c+1). A magnitude exactly on a midpoint
# goes to the even code (mantissa bit 0), so the comparison is strict above an even code and
# inclusive above an odd one.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# E8M0 byte -> fp32 scale. Every 2^(b-127) for b in 0..254 is exact in fp32 (2^-127 as a subnormal).
_E8M0_VALUES = torch.tensor(
    [math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], dtype=torch.float32
)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# --------------------------------------------------------------------------------------------------
# E2M1 codes and packing


def _check_codes(codes: torch.Tensor, name: str) -> None:
    if codes.dtype != torch.uint8:
        raise ValueError(f"{name} must be uint8 E2M1 codes, got dtype {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(
            f"{name} holds a value above 15 ({int(codes.max())}); E2M1 codes are 0..15"
        )


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Values of E2M1 codes (uint8, 0..15, one per element) as fp32, same shape."""
    _check_codes(codes, "codes")
    return E2M1_VALUES.to(codes.device)[codes.long()]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round floats to E2M1 codes (uint8, same shape).

    Rounding: to the nearest representable magnitude; a tie goes to the code whose mantissa bit is 0
    ("ties to even", as the OCP MX spec converts): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4. Magnitudes above 6 (including inf) saturate to 6. The sign is kept
    even when the magnitude rounds to zero, so -0.1 -> code 8 (-0); -0.0 itself also gives code 8
    (ModelOpt writes code 0 there, the same value). NaN has no E2M1 encoding and raises ValueError.
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a floating tensor, got dtype {x.dtype}")
    if torch.isnan(x).any():
        raise ValueError("x holds NaN, which E2M1 cannot encode")
    # NOTE: fp64 stays fp64 so a value just off a midpoint is not rounded onto it first.
    mag = x.abs() if x.dtype == torch.float64 else x.float().abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        above = mag > mid if i % 2 == 0 else mag >= mid
        code += above.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] (uint8, 0..15) into bytes [..., K/2]; element 2i in the low nibble."""
    _check_codes(codes, "codes")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"last dim of codes must be even to pack two per byte, got {codes.shape}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/2] (uint8) into codes [..., K]; the low nibble is the even element."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got dtype {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dim")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(
        -2
    )  # [..., K/2, 2] -> [..., K]


# --------------------------------------------------------------------------------------------------
# Shared checks


def _check_weight(w: torch.Tensor, block: int, fmt: str) -> None:
    if w.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{fmt}: weight must be float32/float16/bfloat16/float64, got {w.dtype}")
    if w.ndim != 2:
        raise ValueError(f"{fmt}: weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if block and w.shape[1] % block:
        raise ValueError(f"{fmt}: K = {w.shape[1]} must be a multiple of the block size {block}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{fmt}: weight holds Inf or NaN")


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


# --------------------------------------------------------------------------------------------------
# NVFP4


@dataclass(frozen=True)
class NVFP4Weight:
    """An NVFP4 weight under the names ModelOpt writes to the checkpoint."""

    weight: torch.Tensor  # uint8 [N, K/2], packed E2M1
    weight_scale: torch.Tensor  # float8_e4m3fn [N, K/16], per-block scale
    weight_scale_2: torch.Tensor  # fp32 [], per-tensor global scale
    input_scale: torch.Tensor | None = None  # fp32 [], activation global scale (calibrated)

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Tensors keyed as in a ModelOpt checkpoint, e.g. prefix 'mlp.down_proj.'."""
        out = {
            f"{prefix}weight": self.weight,
            f"{prefix}weight_scale": self.weight_scale,
            f"{prefix}weight_scale_2": self.weight_scale_2,
        }
        if self.input_scale is not None:
            out[f"{prefix}input_scale"] = self.input_scale
        return out


def quantize_nvfp4(w: torch.Tensor) -> NVFP4Weight:
    """Quantize w [N, K] (K a multiple of 16) to NVFP4, the ModelOpt weight calibration.

    All arithmetic in fp32:
      weight_scale_2 = amax(|w|) / (6 * 448)                 (1.0 when w is all zero)
      weight_scale   = e4m3_rne(amax(|block|) / 6 / weight_scale_2), clamped to [0, 448]
      codes          = float_to_e2m1(w / (float(weight_scale) * weight_scale_2))
    The largest block thus gets scale 448 and its amax lands on 6. As in ModelOpt, an all-zero block
    gets scale 1.0 (byte 0x38). A nonzero block so small that its scale rounds to e4m3 zero stores
    code 0 everywhere and dequantizes to zeros. Values that land above 6 after the e4m3 rounding of
    the scale saturate.
    """
    _check_weight(w, NVFP4_BLOCK, "NVFP4")
    n, k = w.shape
    blocks = w.float().reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)  # [N, K/16, 16]
    amax = blocks.abs().amax()
    # NOTE: an all-zero tensor has no natural global scale; any positive one dequantizes to zeros.
    global_scale = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.ones((), dtype=torch.float32)
    block_amax = blocks.abs().amax(dim=-1)  # [N, K/16]
    block_scale = (block_amax / E2M1_MAX / global_scale).clamp(0.0, E4M3_MAX)
    block_scale = torch.where(block_amax > 0, block_scale, torch.ones_like(block_scale))
    weight_scale = block_scale.to(torch.float8_e4m3fn)  # [N, K/16]
    step = weight_scale.float() * global_scale  # [N, K/16]
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    scaled = torch.where((step > 0)[..., None], blocks / safe_step[..., None], 0.0)
    codes = float_to_e2m1(scaled).reshape(n, k)  # [N, K]
    return NVFP4Weight(
        weight=pack_e2m1(codes),
        weight_scale=weight_scale,
        weight_scale_2=global_scale.reshape(()).to(torch.float32),
    )


def dequantize_nvfp4(
    weight: torch.Tensor | NVFP4Weight,
    weight_scale: torch.Tensor | None = None,
    weight_scale_2: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize NVFP4 to [N, K]: e2m1 * float(weight_scale) * weight_scale_2, formed in fp32.

    Takes an NVFP4Weight or its three checkpoint tensors. A NaN scale byte gives NaN values.
    """
    if isinstance(weight, NVFP4Weight):
        weight, weight_scale, weight_scale_2 = (
            weight.weight,
            weight.weight_scale,
            weight.weight_scale_2,
        )
    if weight_scale is None or weight_scale_2 is None:
        raise ValueError("NVFP4: weight_scale and weight_scale_2 are required")
    if weight.ndim != 2:
        raise ValueError(f"NVFP4: weight must be 2-D [N, K/2], got shape {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    _check_tensor(weight, "NVFP4 weight", torch.uint8, (n, k // 2))
    if k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4: K = {k} must be a multiple of {NVFP4_BLOCK}")
    _check_tensor(weight_scale, "NVFP4 weight_scale", torch.float8_e4m3fn, (n, k // NVFP4_BLOCK))
    if weight_scale_2.dtype != torch.float32 or weight_scale_2.numel() != 1:
        raise ValueError(
            f"NVFP4 weight_scale_2 must be one fp32 value, got {weight_scale_2.dtype} "
            f"of shape {tuple(weight_scale_2.shape)}"
        )
    values = e2m1_to_float(unpack_e2m1(weight)).reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    step = weight_scale.float() * weight_scale_2.reshape(())  # [N, K/16]
    return (values * step[..., None]).reshape(n, k).to(dtype)


# --------------------------------------------------------------------------------------------------
# MXFP4


@dataclass(frozen=True)
class MXFP4Weight:
    """An MXFP4 weight: packed E2M1 codes and one E8M0 scale byte per 32 elements."""

    weight: torch.Tensor  # uint8 [N, K/2], packed E2M1
    scale: torch.Tensor  # uint8 [N, K/32], E8M0: 2^(b - 127), 0xFF = NaN


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) as fp32 powers of two, same shape; 0xFF is NaN."""
    if scale.dtype != torch.uint8:
        raise ValueError(f"E8M0 scale must be uint8, got dtype {scale.dtype}")
    return _E8M0_VALUES.to(scale.device)[scale.long()]


def quantize_mxfp4(w: torch.Tensor) -> MXFP4Weight:
    """Quantize w [N, K] (K a multiple of 32) to MXFP4 with the OCP reference scale.

    Per block: e = floor(log2(amax(|block|))) - 2 (2 is E2M1's largest exponent), stored as the byte
    clamp(e + 127, 0, 254); codes = float_to_e2m1(w / 2^(byte - 127)). So amax / scale lies in
    [4, 8), and elements above 6 * scale saturate to 6 -- the spec's choice, not an error. An
    all-zero block gets byte 0 (the smallest scale, 2^-127) and code 0 everywhere.
    """
    _check_weight(w, MXFP4_BLOCK, "MXFP4")
    n, k = w.shape
    blocks = w.float().reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)  # [N, K/32, 32]
    block_amax = blocks.abs().amax(dim=-1)  # [N, K/32]
    # NOTE: frexp gives amax = m * 2^ex with m in [0.5, 1), so floor(log2(amax)) = ex - 1 exactly,
    # with no log2 rounding near powers of two.
    _, ex = torch.frexp(block_amax)
    biased = (ex.long() - 1 - 2 + 127).clamp(0, 254)
    biased = torch.where(block_amax > 0, biased, torch.zeros_like(biased))
    scale = biased.to(torch.uint8)  # [N, K/32]
    codes = float_to_e2m1(blocks / e8m0_to_float(scale)[..., None]).reshape(n, k)  # [N, K]
    return MXFP4Weight(weight=pack_e2m1(codes), scale=scale)


def dequantize_mxfp4(
    weight: torch.Tensor | MXFP4Weight,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize MXFP4 to [N, K]: e2m1 * 2^(scale - 127); a 0xFF scale makes its block NaN."""
    if isinstance(weight, MXFP4Weight):
        weight, scale = weight.weight, weight.scale
    if scale is None:
        raise ValueError("MXFP4: scale is required")
    if weight.ndim != 2:
        raise ValueError(f"MXFP4: weight must be 2-D [N, K/2], got shape {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    _check_tensor(weight, "MXFP4 weight", torch.uint8, (n, k // 2))
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4: K = {k} must be a multiple of {MXFP4_BLOCK}")
    _check_tensor(scale, "MXFP4 scale", torch.uint8, (n, k // MXFP4_BLOCK))
    values = e2m1_to_float(unpack_e2m1(weight)).reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    return (values * e8m0_to_float(scale)[..., None]).reshape(n, k).to(dtype)


# --------------------------------------------------------------------------------------------------
# FP8 block


def _block_grid(n: int, k: int, block: int) -> tuple[int, int]:
    return -(-n // block), -(-k // block)


def quantize_fp8_block(
    w: torch.Tensor, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w [N, K] to e4m3 with one fp32 scale per block x block tile.

    Returns (weight float8_e4m3fn [N, K], scale fp32 [ceil(N/block), ceil(K/block)]). Per tile,
    scale = amax(|tile|) / 448 and weight = e4m3_rne(w / scale), so the tile's amax maps to 448.
    Edge tiles cover only the rows and columns that exist. An all-zero tile gets scale 0 and
    weights 0.
    """
    if block <= 0:
        raise ValueError(f"FP8 block: block must be positive, got {block}")
    _check_weight(w, 0, "FP8 block")
    n, k = w.shape
    bn, bk = _block_grid(n, k, block)
    # Zero padding does not change a tile's amax and is cut away again below.
    padded = torch.zeros(bn * block, bk * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.reshape(bn, block, bk, block)  # [bn, block, bk, block]
    scale = tiles.abs().amax(dim=(1, 3)) / E4M3_MAX  # [bn, bk]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None, :, None]
    # NOTE: the clamp keeps a quotient that fp32 rounding nudged past 448 from casting to NaN.
    q = (tiles / safe).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    weight = q.reshape(bn * block, bk * block)[:n, :k].contiguous()  # [N, K]
    return weight, scale


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize e4m3 weight [N, K] with fp32 tile scales [ceil(N/block), ceil(K/block)]."""
    if block <= 0:
        raise ValueError(f"FP8 block: block must be positive, got {block}")
    if weight.ndim != 2:
        raise ValueError(f"FP8 block: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_tensor(weight, "FP8 block weight", torch.float8_e4m3fn, (n, k))
    _check_tensor(scale, "FP8 block scale", torch.float32, _block_grid(n, k, block))
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:n, :k]  # [N, K]
    return (weight.float() * full).to(dtype)
