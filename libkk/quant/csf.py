"""CSF: lossless compression of MoE block-scale bytes.

Each row of a scale tensor [E, R, C] is stored as one base byte plus a small offset per scale
inside the window [base, base + W) (MXFP4: W = 2, 1 bit; NVFP4: W = 16, 4 bits), and every byte
outside that window as an exception record `position | value << 24`. Rows are grouped in 16-row
slabs so a checkpoint splits at any tensor-parallel degree whose per-rank rows are a multiple of 16.
The on-disk format is specified in docs/csf.md. Encoding runs at conversion or load time; decoding
is integer-only and bit-exact for every input byte pattern.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from libkk.errors import CorruptCheckpointError

CSF_VERSION = 1
CSF_MAGIC = b"KCSF"
SLAB_ROWS = 16
POSITION_BITS = 24
MAX_POSITIONS = 1 << POSITION_BITS  # R * C must not exceed this (positions are 0..R*C-1)

# kind -> (kind code on disk, window width W, offset bits per scale)
_KINDS: dict[str, tuple[int, int, int]] = {"mxfp4": (0, 2, 1), "nvfp4": (1, 16, 4)}
_KIND_BY_CODE = {code: name for name, (code, _, _) in _KINDS.items()}

# little-endian: magic, version, kind, slab_rows, E, R, C, reserved, M
_HEADER = struct.Struct("<4sHBBIIII Q")
HEADER_BYTES = _HEADER.size  # 32
_ALIGN = 8

# Rows per histogram chunk in the encoder: bounds the [rows, 256] histogram and the flat bin index.
_HIST_ELEMS = 1 << 22


class CorruptCSFError(CorruptCheckpointError, ValueError):
    """A CSF blob that cannot be decoded: bad magic, unknown version or kind, truncated, or
    records that disagree with the header. Also a ValueError, as this module's other input
    errors are."""


@dataclass(frozen=True, eq=False)
class CSFTensor:
    """A compressed scale tensor; all tensors live on the CPU and are contiguous."""

    version: int
    kind: str
    shape: tuple[int, int, int]  # (E, R, C) of the decoded scales
    base: torch.Tensor  # uint8 [E, R]
    offsets: torch.Tensor  # uint8 [E, R, P], P = packed_row_bytes(kind, C)
    records: torch.Tensor  # int32 [M]: position | value << 24, bit pattern of a uint32
    record_offsets: torch.Tensor  # int64 [E * R / 16 + 1], prefix over (expert, slab)

    @property
    def num_exceptions(self) -> int:
        return int(self.records.numel())

    def to_bytes(self) -> bytes:
        e, r, c = self.shape
        p = packed_row_bytes(self.kind, c)
        s = r // SLAB_ROWS
        # [E, S, 16 + 16 * P]: each slab is its 16 base bytes then its 16 packed rows
        slabs = torch.cat(
            [self.base.reshape(e, s, SLAB_ROWS), self.offsets.reshape(e, s, SLAB_ROWS * p)], dim=2
        )
        code = _KINDS[self.kind][0]
        header = _HEADER.pack(
            CSF_MAGIC, self.version, code, SLAB_ROWS, e, r, c, 0, self.num_exceptions
        )
        plane = slabs.contiguous().numpy().tobytes()
        parts = [header, plane, b"\0" * _pad(HEADER_BYTES + len(plane))]
        parts.append(self.record_offsets.numpy().astype("<u8").tobytes())
        parts.append(self.records.numpy().view(np.uint32).astype("<u4").tobytes())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, name: str | None = None) -> CSFTensor:
        """Decodes and validates a blob; CorruptCSFError (naming the tensor `name`, if given)
        when it is not a well-formed CSF blob."""
        try:
            return cls._from_bytes(bytes(data))
        except ValueError as e:
            where = f"tensor {name!r}: " if name else ""
            raise CorruptCSFError(f"{where}{e}") from None

    @classmethod
    def _from_bytes(cls, data: bytes) -> CSFTensor:
        if len(data) < HEADER_BYTES:
            raise ValueError(
                f"CSF: {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header"
            )
        magic, version, code, slab_rows, e, r, c, reserved, m = _HEADER.unpack_from(data, 0)
        if magic != CSF_MAGIC:
            raise ValueError(f"CSF: bad magic {magic!r}, expected {CSF_MAGIC!r}")
        if version != CSF_VERSION:
            raise ValueError(
                f"CSF: unsupported version {version} (this reader knows {CSF_VERSION})"
            )
        if code not in _KIND_BY_CODE:
            raise ValueError(f"CSF: unknown kind code {code}")
        if slab_rows != SLAB_ROWS or reserved != 0:
            raise ValueError(f"CSF: slab_rows={slab_rows}, reserved={reserved}; expected 16 and 0")
        kind = _KIND_BY_CODE[code]
        _check_shape(e, r, c)
        p = packed_row_bytes(kind, c)
        s = r // SLAB_ROWS
        plane_bytes = e * s * SLAB_ROWS * (1 + p)
        off_start = HEADER_BYTES + plane_bytes + _pad(HEADER_BYTES + plane_bytes)
        rec_start = off_start + 8 * (e * s + 1)
        total = rec_start + 4 * m
        if len(data) != total:
            raise ValueError(f"CSF: {len(data)} bytes, header describes {total}")

        plane = np.frombuffer(data, np.uint8, plane_bytes, HEADER_BYTES)
        slabs = torch.from_numpy(plane.copy()).reshape(e, s, SLAB_ROWS * (1 + p))
        base = slabs[:, :, :SLAB_ROWS].reshape(e, r).contiguous()  # [E, R]
        offsets = slabs[:, :, SLAB_ROWS:].reshape(e, r, p).contiguous()  # [E, R, P]
        prefix = np.frombuffer(data, "<u8", e * s + 1, off_start)
        if int(prefix.max()) > m:
            raise ValueError("CSF: a record offset exceeds the record count")
        words = np.frombuffer(data, "<u4", m, rec_start)
        t = cls(
            CSF_VERSION,
            kind,
            (e, r, c),
            base,
            offsets,
            torch.from_numpy(words.astype(np.uint32).view(np.int32).copy()),
            torch.from_numpy(prefix.astype(np.int64)),
        )
        _validate(t)
        return t


def packed_row_bytes(kind: str, cols: int) -> int:
    """Bytes of one row's packed offsets: rows are byte-aligned so every slab stands alone."""
    bits = _KINDS[kind][2]
    return (cols * bits + 7) // 8


def encode_csf(scales: torch.Tensor, kind: str) -> CSFTensor:
    """Compress scale bytes [E, R, C] (uint8, R a multiple of 16, R * C <= 2**24)."""
    if kind not in _KINDS:
        raise ValueError(f"CSF: kind must be one of {sorted(_KINDS)}, got {kind!r}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(f"CSF: scales must be a torch.uint8 tensor, got {got}")
    if scales.dim() != 3:
        raise ValueError(f"CSF: scales must be [E, R, C], got shape {tuple(scales.shape)}")
    e, r, c = scales.shape
    _check_shape(e, r, c)
    _, width, _ = _KINDS[kind]
    x = scales.detach().to("cpu").contiguous()  # [E, R, C]

    base = _choose_base(x.reshape(e * r, c), width).reshape(e, r)  # uint8 [E, R]
    diff = x.to(torch.int32) - base.to(torch.int32).unsqueeze(-1)  # [E, R, C]
    inside = (diff >= 0) & (diff < width)
    offsets = _pack(torch.where(inside, diff, 0), kind)  # uint8 [E, R, P]

    # nonzero() walks row-major, so records come out sorted by (expert, row, col) already.
    ex, er, ec = torch.nonzero(~inside, as_tuple=True)
    value = x[ex, er, ec].to(torch.int64)
    word = er * c + ec + (value << POSITION_BITS)  # uint32 value in an int64
    records = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)

    s = r // SLAB_ROWS
    counts = torch.bincount(ex * s + er // SLAB_ROWS, minlength=e * s)  # [E * S]
    record_offsets = torch.zeros(e * s + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=record_offsets[1:])
    return CSFTensor(CSF_VERSION, kind, (e, r, c), base, offsets, records, record_offsets)


def decode_csf(t: CSFTensor) -> torch.Tensor:
    """Expand to the exact scale bytes, uint8 [E, R, C]."""
    e, r, c = t.shape
    _, width, _ = _KINDS[t.kind]
    off = _unpack(t.offsets, t.kind, c)  # int32 [E, R, C]
    out = (t.base.to(torch.int32).unsqueeze(-1) + off).to(torch.uint8)  # [E, R, C]
    if t.num_exceptions:
        words = t.records.to(torch.int64) & 0xFFFFFFFF
        pos = words & (MAX_POSITIONS - 1)
        value = (words >> POSITION_BITS).to(torch.uint8)
        expert = _record_experts(t)
        out.view(e, r * c)[expert, pos] = value
    return out


def csf_slice_rows(t: CSFTensor, start: int, stop: int) -> CSFTensor:
    """Rows [start, stop) of every expert, taken as whole 16-row slabs (a tensor-parallel shard)."""
    e, r, c = t.shape
    if start % SLAB_ROWS or stop % SLAB_ROWS:
        raise ValueError(
            f"CSF: row slice [{start}, {stop}) must start and stop on a {SLAB_ROWS}-row slab "
            f"boundary; per-rank rows must be a multiple of {SLAB_ROWS}"
        )
    if not 0 <= start < stop <= r:
        raise ValueError(f"CSF: row slice [{start}, {stop}) is empty or outside 0..{r}")
    s = r // SLAB_ROWS
    s0, s1 = start // SLAB_ROWS, stop // SLAB_ROWS
    counts = t.record_offsets[1:] - t.record_offsets[:-1]  # [E * S]
    slab_of_record = torch.repeat_interleave(torch.arange(e * s), counts) % s  # [M]
    keep = (slab_of_record >= s0) & (slab_of_record < s1)
    # Dropping whole leading rows moves every position down by start * C; the value byte is intact.
    records = (t.records[keep].to(torch.int64) - start * c).to(torch.int32)
    kept = counts.reshape(e, s)[:, s0:s1].reshape(-1)
    record_offsets = torch.zeros(kept.numel() + 1, dtype=torch.int64)
    torch.cumsum(kept, 0, out=record_offsets[1:])
    return CSFTensor(
        t.version,
        t.kind,
        (e, stop - start, c),
        t.base[:, start:stop].contiguous(),
        t.offsets[:, start:stop].contiguous(),
        records,
        record_offsets,
    )


def csf_size_report(t: CSFTensor) -> tuple[int, int]:
    """(raw scale bytes, bytes of `t.to_bytes()`)."""
    e, r, c = t.shape
    plane = e * r * (1 + packed_row_bytes(t.kind, c))
    compressed = HEADER_BYTES + plane + _pad(HEADER_BYTES + plane)
    compressed += 8 * (e * (r // SLAB_ROWS) + 1) + 4 * t.num_exceptions
    return e * r * c, compressed


def _check_shape(e: int, r: int, c: int) -> None:
    if e < 1 or r < 1 or c < 1:
        raise ValueError(f"CSF: every dimension must be positive, got [E={e}, R={r}, C={c}]")
    if r % SLAB_ROWS:
        raise ValueError(f"CSF: rows R={r} must be a multiple of {SLAB_ROWS} (whole slabs)")
    if r * c > MAX_POSITIONS:
        raise ValueError(
            f"CSF: R*C = {r}*{c} = {r * c} exceeds 2**{POSITION_BITS}; "
            "exception positions are 24-bit row*C + col within one expert"
        )


def _pad(n: int) -> int:
    return -n % _ALIGN


def _choose_base(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Per row, a base b in 0..256-W whose window [b, b+W) holds the most bytes."""
    n, c = rows.shape  # uint8 [N, C]
    base = torch.empty(n, dtype=torch.uint8)
    chunk = max(1, _HIST_ELEMS // max(c, 256))
    for lo in range(0, n, chunk):
        block = rows[lo : lo + chunk].to(torch.int64)  # [n_chunk, C]
        k = block.shape[0]
        bins = block + 256 * torch.arange(k).unsqueeze(1)
        hist = torch.bincount(bins.reshape(-1), minlength=256 * k).reshape(k, 256)
        cum = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # [k, 257], cum[:, i] = #bytes < i
        covered = cum[:, width:] - cum[:, :-width]  # [k, 257 - W]: bytes in [b, b + W)
        # Among windows that cover equally many bytes, prefer one that starts on a present byte
        # (a constant row gets offset 0), then the lowest: argmax returns the first maximum.
        score = 2 * covered + (hist[:, : 257 - width] > 0)
        base[lo : lo + k] = score.argmax(1).to(torch.uint8)
    return base


def _pack(off: torch.Tensor, kind: str) -> torch.Tensor:
    """int32 [E, R, C] offsets in 0..W-1 -> uint8 [E, R, P], least significant bits first."""
    e, r, c = off.shape
    bits = _KINDS[kind][2]
    per_byte = 8 // bits
    p = packed_row_bytes(kind, c)
    padded = torch.nn.functional.pad(off, (0, p * per_byte - c))  # [E, R, P * per_byte]
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits  # [per_byte]
    return (padded.reshape(e, r, p, per_byte) << shifts).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, kind: str, c: int) -> torch.Tensor:
    """uint8 [E, R, P] -> int32 [E, R, C]; inverse of `_pack`."""
    e, r, p = packed.shape
    bits = _KINDS[kind][2]
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits  # [per_byte]
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(e, r, p * per_byte)[..., :c]


def _record_experts(t: CSFTensor) -> torch.Tensor:
    """The expert of each record, int64 [M], from the (expert, slab) prefix offsets."""
    e, r, _ = t.shape
    counts = t.record_offsets[1:] - t.record_offsets[:-1]  # [E * S]
    return torch.repeat_interleave(torch.arange(e * (r // SLAB_ROWS)), counts) // (r // SLAB_ROWS)


def _validate(t: CSFTensor) -> None:
    """Reject a tensor whose records could write outside their slab or disagree with the prefix."""
    e, r, c = t.shape
    s = r // SLAB_ROWS
    prefix = t.record_offsets
    m = t.num_exceptions
    if prefix.numel() != e * s + 1 or prefix[0].item() != 0 or prefix[-1].item() != m:
        raise ValueError("CSF: record offsets must start at 0 and end at the record count")
    counts = prefix[1:] - prefix[:-1]
    if bool((counts < 0).any()):
        raise ValueError("CSF: record offsets must be non-decreasing")
    if m == 0:
        return
    pos = t.records.to(torch.int64) & (MAX_POSITIONS - 1)
    slab = torch.repeat_interleave(torch.arange(e * s), counts)  # [M], expert * S + slab
    if bool((pos >= r * c).any()) or bool((pos // c // SLAB_ROWS != slab % s).any()):
        raise ValueError("CSF: an exception position lies outside its (expert, slab) region")
    # Positions strictly increase inside each expert: sorted and unique.
    key = (slab // s) * MAX_POSITIONS + pos
    if bool((key[1:] <= key[:-1]).any()):
        raise ValueError("CSF: exception records must be sorted and unique per expert")
