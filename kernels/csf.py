"""csf_expand: CSF-compressed scale bytes (docs/csf.md) -> the fused-MoE kernels' scale layout.

The MoE kernels read scales as uint8 [E, R, C] (R weight rows, C = K / block size), which is
exactly what the torch decoder `libkk.quant.csf.decode_csf` returns, so the expansion writes that
tensor (in place, into a preallocated buffer: it runs inside CUDA graphs, so it neither syncs with
the host nor allocates). Two launches on one stream, the second after the first:

- dense: one program per tile of rows (and per column block when rows are very wide) loads the
  rows' packed offset bytes as contiguous runs, splits each byte into its fields with shifts,
  interleaved into consecutive columns (join + reshape), adds the row's base and stores the tile.
  Loads and stores go as wide vectors and no program loops, so this pass runs at memory speed.
- scatter: one program per block of exception records writes them over the dense bytes. A record
  does not name its expert; a binary search finds it among the experts' first records
  `record_offsets[e * R / 16]` in a fixed log2(E) steps. The grid follows `records.numel()` (a
  shape: no sync); words at or past `record_offsets[-1]` are ignored, and a tensor without
  exceptions launches no scatter.

Integer-only, so it is bit-exact with the torch decoder for every input, NaN scale bytes included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libkk.errors import LibkkError

from ._jit import check_device, jit, kernel_op, next_pow2

SLAB_ROWS = 16
POSITION_BITS = 24
# NOTE: a kernel may read a global only as a tl.constexpr (Triton 3.6 rejects plain ints).
_POSITION_BITS_K = tl.constexpr(POSITION_BITS)
_POSITION_MASK_K = tl.constexpr((1 << POSITION_BITS) - 1)
# kind -> bits per packed offset (docs/csf.md)
OFFSET_BITS = {"mxfp4": 1, "nvfp4": 4}
# Output bytes per dense program: 64 per thread of 4 warps (16-byte stores), under 50 registers.
DENSE_TILE = 8192
RECORD_BLOCK = 1024  # records per scatter program


class CsfKernelError(LibkkError, ValueError):
    """A CSF tensor handed to the expansion kernel is malformed."""


@jit
def _split_fields(x, W: tl.constexpr):
    """[N, M] fields of 2W bits -> [N, 2M]: each one's low W bits, then its high W bits."""
    mask: tl.constexpr = (1 << W) - 1
    return tl.reshape(tl.join(x & mask, (x >> W) & mask), (x.shape[0], 2 * x.shape[1]))


@jit
def _csf_expand_dense_kernel(
    base_ptr,
    off_ptr,
    out_ptr,
    N: tl.constexpr,  # rows of all experts, E * R
    C: tl.constexpr,
    P: tl.constexpr,  # packed bytes per row
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # packed bytes per program and row, a power of two
):
    # Rows of all experts are one [E * R, C] matrix here; only records care about experts.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    packed = tl.load(
        off_ptr + rows.to(tl.int64)[:, None] * P + p[None, :],
        mask=rmask[:, None] & (p < P)[None, :],
        other=0,
    )  # uint8 [ROWS, BLOCK_P], contiguous runs of each row
    # Column c is field c % (8 / BITS) of byte c // (8 / BITS), least significant first: halving
    # the field width and interleaving halves keeps that order at every step.
    fields = _split_fields(packed, 4)
    if BITS <= 2:
        fields = _split_fields(fields, 2)
    if BITS == 1:
        fields = _split_fields(fields, 1)
    cols = tl.program_id(1) * (BLOCK_P * (8 // BITS)) + tl.arange(0, BLOCK_P * (8 // BITS))
    base = tl.load(base_ptr + rows, mask=rmask, other=0)
    value = base[:, None] + fields  # uint8: wraps like the torch decoder's cast
    # Padding fields (C below P * fields per byte, or below the power of two) are masked off.
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :],
        value,
        mask=rmask[:, None] & (cols < C)[None, :],
    )


@jit
def _csf_expand_scatter_kernel(
    rec_ptr,
    rec_off_ptr,
    out_ptr,
    E: tl.constexpr,
    SLABS: tl.constexpr,  # slabs per expert, R / 16
    RC: tl.constexpr,  # bytes per expert, R * C
    STEPS: tl.constexpr,  # binary search steps: 2**STEPS >= E
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = idx < tl.load(rec_off_ptr + E * SLABS)
    word = tl.load(rec_ptr + idx, mask=rmask, other=0)
    # Expert of record idx: the last e with record_offsets[e * SLABS] <= idx (empty experts share
    # their start with the next one, so the last such e is the one that holds the record).
    expert = tl.zeros((BLOCK,), tl.int32)
    for s in tl.static_range(STEPS - 1, -1, -1):
        probe = expert + (1 << s)
        start = tl.load(rec_off_ptr + probe * SLABS, mask=probe < E, other=0)
        expert = tl.where((probe < E) & (start <= idx), probe, expert)
    pos = word & _POSITION_MASK_K
    val = (word >> _POSITION_BITS_K) & 0xFF  # arithmetic shift: mask the sign copies away
    tl.store(out_ptr + expert.to(tl.int64) * RC + pos, val.to(tl.uint8), mask=rmask)


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


@kernel_op("libkk::csf_expand", mutates_args=("out",))
def csf_expand(
    kind: str,  # "mxfp4" | "nvfp4"
    base: torch.Tensor,  # [E, R] uint8
    offsets: torch.Tensor,  # [E, R, P] uint8
    records: torch.Tensor,  # [M] int32: position | value << 24 (words past O[-1] are ignored)
    record_offsets: torch.Tensor,  # [E * R / 16 + 1] int64 O, prefix over (expert, slab)
    out: torch.Tensor,  # [E, R, C] uint8, written whole
) -> None:
    """Decodes CSF scale bytes into `out`, bit-exact with `libkk.quant.csf.decode_csf`."""
    _check(kind, base, offsets, records, record_offsets, out)
    check_device(out)
    e, r, c = out.shape
    if out.numel() == 0:
        return
    bits = OFFSET_BITS[kind]
    per_byte = 8 // bits
    p = offsets.shape[2]
    # Whole rows per program while they fit the tile; very wide rows split into column blocks.
    block_p = min(next_pow2(p), max(DENSE_TILE // per_byte, 1))
    rows = max(DENSE_TILE // (block_p * per_byte), 1)
    grid = (triton.cdiv(e * r, rows), triton.cdiv(p, block_p))
    _csf_expand_dense_kernel[grid](
        base, offsets, out, N=e * r, C=c, P=p, BITS=bits, ROWS=rows, BLOCK_P=block_p, num_warps=4
    )
    if records.numel():  # stream order puts the records over the dense bytes
        _csf_expand_scatter_kernel[(triton.cdiv(records.numel(), RECORD_BLOCK),)](
            records,
            record_offsets,
            out,
            E=e,
            SLABS=r // SLAB_ROWS,
            RC=r * c,
            STEPS=(e - 1).bit_length(),
            BLOCK=RECORD_BLOCK,
            num_warps=4,
        )


@csf_expand.register_fake
def _(kind, base, offsets, records, record_offsets, out) -> None:
    return None


def csf_expand_ref(
    kind: str,
    base: torch.Tensor,
    offsets: torch.Tensor,
    records: torch.Tensor,
    record_offsets: torch.Tensor,
    out: torch.Tensor,
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
