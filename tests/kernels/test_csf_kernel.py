"""csf_expand (Triton) against the torch CSF decoder: bit-exact on every kind of input.

Random, constant, all-exception (every byte outside its row's window), NaN-byte (0xFF in MXFP4,
0x7F/0xFF in NVFP4) and mixed-row tensors; the output buffer starts poisoned, so a byte the kernel
skips shows up as a mismatch.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, RUNS_KERNELS
from libkk.kernels.csf import CsfKernelError, csf_expand, csf_expand_ref, max_records_per_slab

from libkk.quant.csf import decode_csf, encode_csf

pytestmark = RUNS_KERNELS


def _cases(seed: int) -> dict[str, tuple[torch.Tensor, str]]:
    g = torch.Generator().manual_seed(seed)
    near = 120 + torch.randint(0, 3, (2, 32, 8), generator=g)  # mostly inside a 2-wide window
    spread = torch.randint(0, 256, (3, 16, 12), generator=g)
    allx = torch.zeros(1, 16, 6, dtype=torch.int64)
    allx[..., 0::2] = 3
    allx[..., 1::2] = 200  # with W=16 at most half the row fits; the rest are exceptions
    nan = torch.full((2, 16, 5), 0xFF, dtype=torch.int64)
    nan[0, :, 2] = 0x7F
    return {
        "mx-random-near": (near, "mxfp4"),
        "nv-random-near": (near, "nvfp4"),
        "mx-random-spread": (spread, "mxfp4"),
        "nv-random-spread": (spread, "nvfp4"),
        "mx-constant": (torch.full((2, 16, 7), 131), "mxfp4"),
        "nv-constant": (torch.full((1, 48, 33), 56), "nvfp4"),
        "mx-all-exception": (allx, "mxfp4"),
        "nv-all-exception": (allx, "nvfp4"),
        "mx-nan": (nan, "mxfp4"),
        "nv-nan": (nan, "nvfp4"),
    }


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(_cases(0)))
def test_csf_expand_bit_exact(case: str, seed: int):
    scales, kind = _cases(seed)[case]
    scales = scales.to(torch.uint8)
    t = encode_csf(scales, kind)
    want = decode_csf(t)
    assert torch.equal(want, scales)  # the torch codec itself round-trips
    if "all-exception" in case:
        assert t.num_exceptions > 0
    args = [x.to(DEVICE) for x in (t.base, t.offsets, t.records, t.record_offsets)]
    out = torch.full(t.shape, 0xA5, dtype=torch.uint8, device=DEVICE)  # poison
    csf_expand(kind, *args, out, max_records_per_slab(t.record_offsets))
    assert torch.equal(out.cpu(), want)
    ref = torch.full(t.shape, 0x5A, dtype=torch.uint8, device=DEVICE)
    csf_expand_ref(kind, *args, ref)
    assert torch.equal(ref.cpu(), want)


def test_csf_expand_many_records_per_slab():
    # More records in one slab than one record block holds: the record loop must take several.
    g = torch.Generator().manual_seed(3)
    scales = torch.randint(0, 256, (1, 32, 40), generator=g).to(torch.uint8)
    t = encode_csf(scales, "mxfp4")
    assert max_records_per_slab(t.record_offsets) > 256
    out = torch.zeros(t.shape, dtype=torch.uint8, device=DEVICE)
    args = [x.to(DEVICE) for x in (t.base, t.offsets, t.records, t.record_offsets)]
    csf_expand("mxfp4", *args, out, max_records_per_slab(t.record_offsets))
    assert torch.equal(out.cpu(), scales)


def test_csf_expand_rejects_bad_inputs():
    t = encode_csf(torch.zeros(1, 16, 4, dtype=torch.uint8), "nvfp4")
    out = torch.zeros(1, 16, 4, dtype=torch.uint8)
    with pytest.raises(CsfKernelError, match="kind"):
        csf_expand("fp8", t.base, t.offsets, t.records, t.record_offsets, out, 0)
    with pytest.raises(CsfKernelError, match="offsets"):
        csf_expand("mxfp4", t.base, t.offsets, t.records, t.record_offsets, out, 0)
    with pytest.raises(CsfKernelError, match="multiple of 16"):
        bad = torch.zeros(1, 8, 4, dtype=torch.uint8)
        csf_expand("nvfp4", t.base, t.offsets, t.records, t.record_offsets, bad, 0)
