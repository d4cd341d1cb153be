"""csf_expand (Triton) against the torch CSF decoder: bit-exact on every kind of input.

Random, constant, all-exception (every byte outside its row's window), NaN-byte (0xFF in MXFP4,
0x7F/0xFF in NVFP4), mixed-row, narrow (C below a byte's worth of fields), real-width (C = 48,
128) and wide (column-blocked) tensors, records spread over several scatter blocks and experts,
and tensors without records; the output buffer starts poisoned, so a byte the kernel skips shows
up as a mismatch.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, RUNS_KERNELS
from libkk.kernels.csf import (
    RECORD_BLOCK,
    CsfKernelError,
    csf_expand,
    csf_expand_ref,
)

from libkk.quant.csf import CSFTensor, decode_csf, encode_csf

pytestmark = RUNS_KERNELS


def _scattered(g: torch.Generator, shape: tuple[int, int, int]) -> torch.Tensor:
    """Bytes near 120 (mostly inside an MXFP4 window) with every 97th byte random, NaNs among them."""
    x = 118 + torch.randint(0, 3, shape, generator=g)
    flat = x.view(-1)
    flat[::97] = torch.randint(0, 256, flat[::97].shape, generator=g)
    flat[5::211] = 0xFF
    flat[7::307] = 0x7F
    return x


def _mixed_rows(g: torch.Generator, shape: tuple[int, int, int]) -> torch.Tensor:
    """Each row constant, near, spread or all NaN, at random."""
    e, r, c = shape
    choices = torch.stack(
        [
            torch.full(shape, 77),
            200 + torch.randint(0, 16, shape, generator=g),
            torch.randint(0, 256, shape, generator=g),
            torch.full(shape, 0xFF),
        ]
    )  # [4, E, R, C]
    pick = torch.randint(0, 4, (1, e, r, 1), generator=g).expand(1, e, r, c)
    return choices.gather(0, pick)[0]


def _cases(seed: int) -> dict[str, tuple[torch.Tensor, str]]:
    g = torch.Generator().manual_seed(seed)
    near = 120 + torch.randint(0, 3, (2, 32, 8), generator=g)  # mostly inside a 2-wide window
    spread = torch.randint(0, 256, (3, 16, 12), generator=g)
    allx = torch.zeros(1, 16, 6, dtype=torch.int64)
    allx[..., 0::2] = 3
    allx[..., 1::2] = 200  # with W=16 at most half the row fits; the rest are exceptions
    nan = torch.full((2, 16, 5), 0xFF, dtype=torch.int64)
    nan[0, :, 2] = 0x7F
    cases = {
        "random-near": near,
        "random-spread": spread,
        "constant": torch.full((2, 16, 7), 131),
        "constant-48": torch.full((1, 48, 33), 56),
        "all-exception": allx,
        "nan": nan,
        "mixed-rows": _mixed_rows(g, (4, 32, 20)),
        "c48": _scattered(g, (3, 48, 48)),  # NVFP4 w2 of Qwen3-30B-A3B: C not a power of two
        "c128": _scattered(g, (2, 32, 128)),  # NVFP4 w13
        "c24": _scattered(g, (2, 32, 24)),  # MXFP4 w2
        "narrow-3": _scattered(g, (2, 16, 3)),  # fewer columns than MXFP4 fields per byte
        "narrow-1": torch.randint(0, 256, (3, 16, 1), generator=g),
        "wide": _scattered(g, (1, 16, 8200)),  # more than one dense column block per row
    }
    return {
        f"{kind[:2]}-{name}": (x, kind) for name, x in cases.items() for kind in ("mxfp4", "nvfp4")
    }


def _planes(t: CSFTensor) -> list[torch.Tensor]:
    return [x.to(DEVICE) for x in (t.base, t.offsets, t.records, t.record_offsets)]


def _expand(t: CSFTensor, records: torch.Tensor | None = None) -> torch.Tensor:
    """csf_expand into a poisoned buffer followed by guard bytes, which must stay untouched."""
    base, offsets, recs, record_offsets = _planes(t)
    if records is not None:
        recs = records.to(DEVICE)
    n = t.shape[0] * t.shape[1] * t.shape[2]
    storage = torch.full((n + 64,), 0xA5, dtype=torch.uint8, device=DEVICE)
    out = storage[:n].view(t.shape)
    csf_expand(t.kind, base, offsets, recs, record_offsets, out)
    assert bool((storage[n:] == 0xA5).all()), "wrote past the end of out"
    return out.cpu()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(_cases(0)))
def test_csf_expand_bit_exact(case: str, seed: int):
    scales, kind = _cases(seed)[case]
    scales = scales.to(torch.uint8)
    t = encode_csf(scales, kind)
    want = decode_csf(t)
    assert torch.equal(want, scales)  # the torch codec itself round-trips
    if "all-exception" in case or "spread" in case:
        assert t.num_exceptions > 0
    assert torch.equal(_expand(t), want)
    ref = torch.full(t.shape, 0x5A, dtype=torch.uint8, device=DEVICE)
    csf_expand_ref(kind, *_planes(t), ref)
    assert torch.equal(ref.cpu(), want)


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_csf_expand_records_over_blocks_and_empty_experts(kind: str):
    # Several scatter blocks of records, from experts 0, 2 and 5 only: the expert search must
    # skip the empty ones (their record start equals the next expert's).
    g = torch.Generator().manual_seed(3)
    scales = torch.full((6, 32, 40), 90)
    for e in (0, 2, 5):
        scales[e] = torch.randint(0, 256, (32, 40), generator=g)
    scales = scales.to(torch.uint8)
    t = encode_csf(scales, kind)
    per_expert = t.record_offsets[:: 32 // 16]
    assert t.num_exceptions > 2 * RECORD_BLOCK
    assert (per_expert[1:] == per_expert[:-1]).sum() == 3  # experts 1, 3, 4 hold no record
    assert torch.equal(_expand(t), scales)


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_csf_expand_all_records_in_one_slab(kind: str):
    # The worst slab: every row random, the rest constant; one slab holds all records.
    g = torch.Generator().manual_seed(4)
    scales = torch.full((2, 64, 48), 127)
    scales[1, 32:48] = torch.randint(0, 256, (16, 48), generator=g)
    scales = scales.to(torch.uint8)
    t = encode_csf(scales, kind)
    per_slab = t.record_offsets[1:] - t.record_offsets[:-1]
    assert int(per_slab.max()) == t.num_exceptions > 256
    assert torch.equal(_expand(t), scales)


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_csf_expand_without_records(kind: str):
    # No records: an empty tensor, or words past the record offsets' end (which end at 0 here,
    # so the word, which would write 0x77 at position 5, must be ignored).
    scales = (100 + torch.arange(2 * 16 * 9) % 2).reshape(2, 16, 9).to(torch.uint8)
    t = encode_csf(scales, kind)
    assert t.num_exceptions == 0
    assert torch.equal(_expand(t), scales)
    stray = torch.tensor([5 | 0x77 << 24], dtype=torch.int32)
    assert torch.equal(_expand(t, stray), scales)


def test_csf_expand_rejects_bad_inputs():
    t = encode_csf(torch.zeros(1, 16, 4, dtype=torch.uint8), "nvfp4")
    out = torch.zeros(1, 16, 4, dtype=torch.uint8)
    with pytest.raises(CsfKernelError, match="kind"):
        csf_expand("fp8", t.base, t.offsets, t.records, t.record_offsets, out)
    with pytest.raises(CsfKernelError, match="offsets"):
        csf_expand("mxfp4", t.base, t.offsets, t.records, t.record_offsets, out)
    with pytest.raises(CsfKernelError, match="multiple of 16"):
        bad = torch.zeros(1, 8, 4, dtype=torch.uint8)
        csf_expand("nvfp4", t.base, t.offsets, t.records, t.record_offsets, bad)
