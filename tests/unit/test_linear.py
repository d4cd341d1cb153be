"""The CPU linear path computes the same product as F.linear for any number of rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from libkk.layers.linear import linear


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    out = linear(x, w, b)
    assert out.shape == (rows, 160) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_other_ranks_fall_back():
    x = torch.randn(2, 3, 8)
    w = torch.randn(5, 8)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
