"""csf_expand: CSF-compressed scale bytes (docs/csf.md) -> the fused-MoE kernels' scale layout.

The MoE kernels read scales as uint8 [E, R, C] (R weight rows, C = K / block size), which is
exactly what the torch decoder `libkk.quant.csf.decode_csf` returns, so the expansion writes that
tensor (in place, into a preallocated buffer: it runs inside CUDA graphs). One program per
(expert, 16-row slab): it writes base + offset for the slab's 16 x C bytes, then, after a barrier,
the slab's exception records over them. Integer-only, so it is bit-exact with the torch decoder
for every input, NaN scale bytes included.
"""

from __future__ import annotations

import torch
import triton.language as tl

from libkk.errors import LibkkError

from ._jit import check_device, jit, next_pow2

SLAB_ROWS = 16
POSITION_BITS = 24
# NOTE: a kernel may read a global only as a tl.constexpr (Triton 3.6 rejects plain ints).
_POSITION_BITS_K = tl.constexpr(POSITION_BITS)
_POSITION_MASK_K = tl.constexpr((1 << POSITION_BITS) - 1)
# kind -> bits per packed offset (docs/csf.md)
OFFSET_BITS = {"mxfp4": 1, "nvfp4": 4}
RECORD_BLOCK = 256


class CsfKernelError(LibkkError, ValueError):
    """A CSF tensor handed to the expansion kernel is malformed."""


@jit
def _csf_expand_kernel(
    base_ptr,
    off_ptr,
    rec_ptr,
    rec_off_ptr,
    out_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    P: tl.constexpr,  # packed bytes per row
    C_PAD: tl.constexpr,
    BITS: tl.constexpr,
    SLAB: tl.constexpr,
    MAX_REC: tl.constexpr,  # power of two >= the most records any slab holds
    REC_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # expert * (R / SLAB) + slab
    slabs: tl.constexpr = R // SLAB
    expert = pid // slabs
    slab = pid % slabs
    rows = slab * SLAB + tl.arange(0, SLAB)  # [SLAB] row within the expert
    cols = tl.arange(0, C_PAD)
    cmask = cols < C
    base = tl.load(base_ptr + expert * R + rows).to(tl.int32)  # [SLAB]
    bit = cols * BITS
    byte_ptrs = off_ptr + (expert * R + rows)[:, None] * P + (bit // 8)[None, :]
    packed = tl.load(byte_ptrs, mask=cmask[None, :], other=0).to(tl.int32)  # [SLAB, C_PAD]
    field = (packed >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
    value = (base[:, None] + field) & 0xFF
    out_base = out_ptr + expert * (R * C)
    tl.store(out_base + rows[:, None] * C + cols[None, :], value.to(tl.uint8), mask=cmask[None, :])
    # Exceptions overwrite bytes other threads of this program just wrote.
    tl.debug_barrier()
    start = tl.load(rec_off_ptr + pid)
    end = tl.load(rec_off_ptr + pid + 1)
    for i in range(0, MAX_REC, REC_BLOCK):
        idx = start + i + tl.arange(0, REC_BLOCK)
        rmask = idx < end
        word = tl.load(rec_ptr + idx, mask=rmask, other=0)
        pos = word & _POSITION_MASK_K
        val = (word >> _POSITION_BITS_K) & 0xFF  # arithmetic shift: mask the sign copies away
        tl.store(out_base + pos, val.to(tl.uint8), mask=rmask)


def _check(
    kind: str,
    base: torch.Tensor,
    offsets: torch.Tensor,
    records: torch.Tensor,
    record_offsets: torch.Tensor,
    out: torch.Tensor,
) -> None:
    if kind not in OFFSET_BITS:
        raise CsfKernelError(f"CSF kind must be one of {sorted(OFFSET_BITS)}, got {kind!r}")
    if out.dtype != torch.uint8 or out.dim() != 3 or not out.is_contiguous():
        raise CsfKernelError(f"out must be contiguous uint8 [E, R, C], got {out.dtype} {out.shape}")
    e, r, c = out.shape
    if r % SLAB_ROWS:
        raise CsfKernelError(f"rows R={r} must be a multiple of {SLAB_ROWS}")
    p = (c * OFFSET_BITS[kind] + 7) // 8
    want = {"base": (e, r), "offsets": (e, r, p)}
    for name, t in (("base", base), ("offsets", offsets)):
        if t.dtype != torch.uint8 or tuple(t.shape) != want[name] or not t.is_contiguous():
            raise CsfKernelError(
                f"{name} must be contiguous uint8 {want[name]}, got {t.dtype} {tuple(t.shape)}"
            )
    if records.dtype != torch.int32 or records.dim() != 1:
        raise CsfKernelError(f"records must be int32 [M], got {records.dtype} {records.shape}")
    if record_offsets.dtype != torch.int64 or record_offsets.shape != (e * r // SLAB_ROWS + 1,):
        raise CsfKernelError(
            f"record_offsets must be int64 [{e * r // SLAB_ROWS + 1}], got "
            f"{record_offsets.dtype} {tuple(record_offsets.shape)}"
        )


@torch.library.custom_op("libkk::csf_expand", mutates_args=("out",))
def csf_expand(
    kind: str,  # "mxfp4" | "nvfp4"
    base: torch.Tensor,  # [E, R] uint8
    offsets: torch.Tensor,  # [E, R, P] uint8
    records: torch.Tensor,  # [M] int32: position | value << 24
    record_offsets: torch.Tensor,  # [E * R / 16 + 1] int64, prefix over (expert, slab)
    out: torch.Tensor,  # [E, R, C] uint8, written whole
    max_records_per_slab: int,  # the most records of any (expert, slab): sizes the record loop
) -> None:
    """Decodes CSF scale bytes into `out`, bit-exact with `libkk.quant.csf.decode_csf`."""
    _check(kind, base, offsets, records, record_offsets, out)
    check_device(out)
    e, r, c = out.shape
    if out.numel() == 0:
        return
    max_rec = next_pow2(max(max_records_per_slab, 1))
    _csf_expand_kernel[(e * r // SLAB_ROWS,)](
        base,
        offsets,
        records if records.numel() else record_offsets.new_zeros(1, dtype=torch.int32),
        record_offsets,
        out,
        R=r,
        C=c,
        P=offsets.shape[2],
        C_PAD=next_pow2(c),
        BITS=OFFSET_BITS[kind],
        SLAB=SLAB_ROWS,
        MAX_REC=max(max_rec, RECORD_BLOCK),
        REC_BLOCK=RECORD_BLOCK,
        num_warps=4,
    )


@csf_expand.register_fake
def _(kind, base, offsets, records, record_offsets, out, max_records_per_slab) -> None:
    return None


def csf_expand_ref(
    kind: str,
    base: torch.Tensor,
    offsets: torch.Tensor,
    records: torch.Tensor,
    record_offsets: torch.Tensor,
    out: torch.Tensor,
    max_records_per_slab: int = 0,
) -> None:
    """Torch reference of `csf_expand` (the same steps as the docs/csf.md decoder)."""
    _check(kind, base, offsets, records, record_offsets, out)
    e, r, c = out.shape
    bits = OFFSET_BITS[kind]
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32, device=out.device) * bits
    fields = (offsets.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    off = fields.reshape(e, r, -1)[..., :c]
    out.copy_((base.to(torch.int32).unsqueeze(-1) + off).to(torch.uint8))
    if records.numel():
        s = r // SLAB_ROWS
        counts = (record_offsets[1:] - record_offsets[:-1]).cpu()
        expert = torch.repeat_interleave(torch.arange(e * s), counts) // s
        words = records.to(torch.int64) & 0xFFFFFFFF
        pos = words & ((1 << POSITION_BITS) - 1)
        out.view(e, r * c)[expert.to(out.device), pos] = (words >> POSITION_BITS).to(torch.uint8)


def max_records_per_slab(record_offsets: torch.Tensor) -> int:
    """The `max_records_per_slab` argument for a tensor's record offsets (read once, at load)."""
    if record_offsets.numel() < 2:
        return 0
    return int((record_offsets[1:] - record_offsets[:-1]).max())
