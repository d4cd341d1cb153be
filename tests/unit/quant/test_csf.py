"""CSF decodes every scale byte exactly, serializes losslessly and shards by 16-row slabs."""

from __future__ import annotations

import struct

import pytest
import torch

from libkk.quant.csf import (
    CSF_MAGIC,
    HEADER_BYTES,
    CSFTensor,
    csf_size_report,
    csf_slice_rows,
    decode_csf,
    encode_csf,
)

KINDS = ["mxfp4", "nvfp4"]
WIDTH = {"mxfp4": 2, "nvfp4": 16}


def _roundtrip(x: torch.Tensor, kind: str) -> CSFTensor:
    """Encode, then check decode and the serialized form both give back x exactly."""
    t = encode_csf(x, kind)
    assert torch.equal(decode_csf(t), x)
    data = t.to_bytes()
    assert len(data) == csf_size_report(t)[1]
    back = CSFTensor.from_bytes(data)
    assert torch.equal(decode_csf(back), x)
    assert back.to_bytes() == data
    return t


def _narrow(g: torch.Generator, shape: tuple[int, int, int], width: int, outliers: float):
    """Scales clustered around a per-row base with a few arbitrary outlier bytes."""
    e, r, c = shape
    base = torch.randint(100, 150, (e, r, 1), generator=g)
    x = base + torch.randint(0, width, shape, generator=g)
    wild = torch.rand(shape, generator=g) < outliers
    return torch.where(wild, torch.randint(0, 256, shape, generator=g), x).to(torch.uint8)


def _quantizer_scales(g: torch.Generator, kind: str) -> torch.Tensor:
    """Scale bytes the real recipes produce for Gaussian weights with per-row magnitudes."""
    e, r, k = 4, 256, 2048
    w = torch.randn(e, r, k, generator=g) * (torch.rand(e, r, 1, generator=g) * 0.05 + 0.01)
    if kind == "mxfp4":
        # OCP MX: shared E8M0 exponent = floor(log2(block amax)) - emax(FP4) over 32 values.
        amax = w.reshape(e, r, k // 32, 32).abs().amax(-1)
        return (torch.floor(torch.log2(amax)) - 2 + 127).clamp(0, 254).to(torch.uint8)
    # NVFP4: E4M3 scale of each 16-value block's amax / 6, under a per-tensor global scale.
    amax = w.reshape(e, r, k // 16, 16).abs().amax(-1)
    global_scale = w.abs().amax() / (6 * 448)
    return (amax / 6 / global_scale).to(torch.float8_e4m3fn).view(torch.uint8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(6))
def test_random_bytes_roundtrip(kind, seed):
    g = torch.Generator().manual_seed(seed)
    e, r, c = [int(v) for v in torch.randint(1, 5, (3,), generator=g)]
    shape = (e, 16 * r, int(torch.randint(1, 70, (1,), generator=g)))
    _roundtrip(torch.randint(0, 256, shape, dtype=torch.uint8, generator=g), kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_realistic_scales_roundtrip(kind, seed):
    g = torch.Generator().manual_seed(100 + seed)
    x = _narrow(g, (3, 64, 96), WIDTH[kind], outliers=0.01)
    t = _roundtrip(x, kind)
    # Most bytes sit inside the chosen window; only the outliers (and a few near them) escape.
    assert t.num_exceptions < 0.03 * x.numel()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [0, 1, 127, 239, 240, 241, 254, 255])
def test_constant_tensor_has_no_exceptions(kind, value):
    x = torch.full((2, 32, 17), value, dtype=torch.uint8)
    t = _roundtrip(x, kind)
    assert t.num_exceptions == 0
    # The window starts on the byte itself unless that would run past 255; then the lowest
    # window that still holds it.
    w = WIDTH[kind]
    assert bool((t.base == (value if value <= 256 - w else value - w + 1)).all())


@pytest.mark.parametrize("kind", KINDS)
def test_all_exceptions(kind):
    # Every byte of a row is at least W apart from every other: one byte fits a window, the rest
    # are exceptions, and decode must rely almost entirely on the exception stream.
    w = WIDTH[kind]
    c = 256 // w
    row = torch.arange(c) * w  # [C]
    x = row.expand(2, 16, c).clone()
    x = torch.roll(x, shifts=3, dims=2).to(torch.uint8)
    t = _roundtrip(x, kind)
    assert t.num_exceptions == x.numel() - 2 * 16


@pytest.mark.parametrize("kind", KINDS)
def test_nan_bytes(kind):
    # 0xFF is NaN in E8M0 (and in E4M3 with the sign bit); it must survive like any other byte.
    g = torch.Generator().manual_seed(7)
    x = _narrow(g, (2, 32, 40), WIDTH[kind], outliers=0.0)
    x[:, ::3, ::5] = 0xFF
    x[1, 16:32] = 0xFF
    x[0, 0, :] = torch.tensor([0xFF, 0x7F, 0x80, 0x00] * 10, dtype=torch.uint8)
    _roundtrip(x, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_worst_case_alternating(kind):
    # Two values just outside one window alternate, so half of every row must be exceptions.
    w = WIDTH[kind]
    c = 64
    lo, hi = 100, 100 + w
    x = torch.tensor([lo, hi] * (c // 2), dtype=torch.uint8).expand(3, 16, c).contiguous()
    t = _roundtrip(x, kind)
    assert t.num_exceptions == x.numel() // 2
    alt = torch.tensor([0, 255] * (c // 2), dtype=torch.uint8).expand(1, 32, c).contiguous()
    _roundtrip(alt, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 16, 1), (1, 16, 7), (5, 16, 1), (1, 48, 1), (1, 16, 300)])
def test_edge_shapes(kind, shape):
    g = torch.Generator().manual_seed(sum(shape))
    _roundtrip(torch.randint(0, 256, shape, dtype=torch.uint8, generator=g), kind)
    _roundtrip(_narrow(g, shape, WIDTH[kind], outliers=0.05), kind)


def test_nvfp4_base_never_carries():
    # Bytes near 255 would tempt a base above 240; the window must end at 255, not wrap past it.
    g = torch.Generator().manual_seed(3)
    x = torch.randint(241, 256, (2, 32, 50), dtype=torch.uint8, generator=g)
    x[0, :16] = 255
    x[1, :16] = torch.randint(250, 256, (16, 50), dtype=torch.uint8, generator=g)
    t = _roundtrip(x, "nvfp4")
    assert int(t.base.max()) <= 240
    assert t.num_exceptions == 0
    m = _roundtrip(torch.full((1, 16, 9), 255, dtype=torch.uint8), "mxfp4")
    assert int(m.base.max()) <= 254 and m.num_exceptions == 0


@pytest.mark.parametrize("kind", KINDS)
def test_records_sorted_unique_and_prefix_consistent(kind):
    g = torch.Generator().manual_seed(11)
    e, r, c = 3, 64, 33
    x = _narrow(g, (e, r, c), WIDTH[kind], outliers=0.2)
    t = encode_csf(x, kind)
    words = t.records.to(torch.int64) & 0xFFFFFFFF
    pos = words & 0xFFFFFF
    prefix = t.record_offsets
    assert prefix.shape == (e * r // 16 + 1,) and int(prefix[0]) == 0
    assert int(prefix[-1]) == t.num_exceptions
    for ex in range(e):
        for slab in range(r // 16):
            lo, hi = int(prefix[ex * (r // 16) + slab]), int(prefix[ex * (r // 16) + slab + 1])
            p = pos[lo:hi]
            assert bool((p[1:] > p[:-1]).all())
            assert bool(((p // c) // 16 == slab).all())
            rows, cols = p // c, p % c
            assert torch.equal((words[lo:hi] >> 24).to(torch.uint8), x[ex, rows, cols])


@pytest.mark.parametrize("kind", KINDS)
def test_serialized_layout(kind):
    x = torch.full((2, 32, 10), 120, dtype=torch.uint8)
    x[1, 17, 3] = 7
    t = encode_csf(x, kind)
    data = t.to_bytes()
    magic, version, code, slab_rows, e, r, c, reserved, m = struct.unpack_from("<4sHBBIIIIQ", data)
    assert (magic, version, code, slab_rows) == (CSF_MAGIC, 1, KINDS.index(kind), 16)
    assert (e, r, c, reserved, m) == (2, 32, 10, 0, 1)
    # First slab: 16 base bytes, then 16 rows of zero offsets.
    assert data[HEADER_BYTES : HEADER_BYTES + 16] == bytes([120]) * 16
    # The single record is expert 1, row 17, col 3, value 7, little-endian in the last 4 bytes.
    assert struct.unpack("<I", data[-4:])[0] == (17 * 10 + 3) | (7 << 24)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_bit_order(kind):
    # Offsets are packed least-significant field first: column j sits at bit (j % per_byte) * bits.
    x = torch.full((1, 16, 8), 50, dtype=torch.uint8)
    x[0, 0, 1] = 51
    if kind == "nvfp4":
        x[0, 0, 2] = 50 + 9
        x[0, 0, 3] = 50 + 15  # pins the window to start at 50
    t = encode_csf(x, kind)
    assert int(t.base[0, 0]) == 50
    expected = [0b10] if kind == "mxfp4" else [0x10, 0xF9, 0x00, 0x00]
    assert t.offsets[0, 0].tolist() == expected


def test_from_bytes_rejects_corruption():
    x = _narrow(torch.Generator().manual_seed(5), (2, 32, 12), 2, outliers=0.1)
    data = encode_csf(x, "mxfp4").to_bytes()
    with pytest.raises(ValueError, match="magic"):
        CSFTensor.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="version"):
        CSFTensor.from_bytes(data[:4] + struct.pack("<H", 2) + data[6:])
    with pytest.raises(ValueError, match="bytes"):
        CSFTensor.from_bytes(data[:-1])
    # A record whose position jumps out of its slab region is refused before it can scribble.
    bad = bytearray(data)
    bad[-4:] = struct.pack("<I", (31 * 12 + 11 + 1) | (9 << 24))
    with pytest.raises(ValueError):
        CSFTensor.from_bytes(bytes(bad))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slice_by_slabs_matches_decoded_rows(kind, tp):
    g = torch.Generator().manual_seed(tp)
    x = _narrow(g, (3, 128, 24), WIDTH[kind], outliers=0.05)
    t = encode_csf(x, kind)
    per = 128 // tp
    for rank in range(tp):
        shard = csf_slice_rows(t, rank * per, (rank + 1) * per)
        assert torch.equal(decode_csf(shard), x[:, rank * per : (rank + 1) * per])
        # A shard is a complete CSF tensor: it serializes and re-encodes identically.
        back = CSFTensor.from_bytes(shard.to_bytes())
        assert back.to_bytes() == encode_csf(x[:, rank * per : (rank + 1) * per], kind).to_bytes()
    mid = csf_slice_rows(t, 48, 96)
    assert torch.equal(decode_csf(mid), x[:, 48:96])


def test_slice_rejects_partial_slabs():
    t = encode_csf(torch.zeros(1, 64, 4, dtype=torch.uint8), "mxfp4")
    for start, stop in [(8, 32), (0, 40), (16, 16), (32, 16), (0, 80)]:
        with pytest.raises(ValueError):
            csf_slice_rows(t, start, stop)


@pytest.mark.parametrize("kind", KINDS)
def test_size_report_compresses_realistic_scales(kind):
    g = torch.Generator().manual_seed(0)
    x = _quantizer_scales(g, kind)
    t = _roundtrip(x, kind)
    raw, compressed = csf_size_report(t)
    assert raw == x.numel()
    # MXFP4 ~5.3x, NVFP4 ~1.9x on these inputs; assert with margin.
    assert raw / compressed > (4.0 if kind == "mxfp4" else 1.6)
    synth = _roundtrip(_narrow(g, (4, 256, 128), WIDTH[kind], outliers=0.01), kind)
    raw, compressed = csf_size_report(synth)
    assert raw / compressed > (4.0 if kind == "mxfp4" else 1.6)


def test_input_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        encode_csf(torch.zeros(1, 24, 4, dtype=torch.uint8), "mxfp4")
    with pytest.raises(ValueError, match="2\\*\\*24"):
        encode_csf(torch.zeros(1, 16, (1 << 20) + 1, dtype=torch.uint8), "nvfp4")
    with pytest.raises(TypeError, match="uint8"):
        encode_csf(torch.zeros(1, 16, 4, dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="kind"):
        encode_csf(torch.zeros(1, 16, 4, dtype=torch.uint8), "fp8")
    with pytest.raises(ValueError, match="E, R, C"):
        encode_csf(torch.zeros(16, 4, dtype=torch.uint8), "mxfp4")
    with pytest.raises(ValueError, match="positive"):
        encode_csf(torch.zeros(1, 16, 0, dtype=torch.uint8), "mxfp4")
    # Exactly 2**24 positions is the largest tensor that fits.
    t = encode_csf(torch.zeros(1, 16, 1 << 20, dtype=torch.uint8), "mxfp4")
    assert t.shape == (1, 16, 1 << 20)
