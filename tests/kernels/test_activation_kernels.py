"""silu_and_mul against its torch reference: zero, one and several rows, a half-width that is not
a multiple of the kernel's block, leading dimensions, rows strided as a slice of a wider output.
On CUDA the op equals the reference bit for bit (eager torch's arithmetic); under Triton's
interpreter exp and the division are numpy's, so a rounding step apart."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, ON_CUDA, RUNS_KERNELS
from libkk.kernels import silu_and_mul, silu_and_mul_ref

pytestmark = RUNS_KERNELS

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3}


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if ON_CUDA:
        assert torch.equal(got, want)
    else:
        tol = TOLERANCE[want.dtype]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 1500])
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_silu_and_mul_equals_the_reference(dtype, d, rows):
    g = torch.Generator().manual_seed(d + rows)
    x = (torch.randn(rows, 2 * d, generator=g) * 4).to(dtype).to(DEVICE)
    _check(silu_and_mul(x), silu_and_mul_ref(x))


def test_silu_and_mul_takes_leading_dims_and_strided_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=g).to(DEVICE)
    _check(silu_and_mul(x), silu_and_mul_ref(x))
    wide = torch.randn(5, 64, generator=g).to(DEVICE)
    part = wide[:, 8:48]  # a fused projection's slice: rows 64 apart
    _check(silu_and_mul(part), silu_and_mul_ref(part))


def test_silu_and_mul_saturates_like_the_reference():
    """Large negative gates (exp overflows to inf: silu -> -0) and large positive ones."""
    x = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0, 2.0, 2.0, 2.0, 2.0, 2.0]]).to(DEVICE)
    _check(silu_and_mul(x), silu_and_mul_ref(x))


def test_silu_and_mul_rejects_an_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 5, device=DEVICE))
