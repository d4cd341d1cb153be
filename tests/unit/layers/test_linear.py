"""The CPU linear path computes the same product as F.linear for any number of rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from libkk.layers.linear import linear, takes_kernels


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


def test_cpu_tensors_never_take_kernels():
    assert not takes_kernels(torch.randn(2, 3), torch.randn(4, 3))
    with torch.inference_mode():
        assert not takes_kernels(torch.randn(2, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_take_kernels_unless_autograd_records():
    w = torch.randn(4, 3, device="cuda", requires_grad=True)
    x = torch.randn(2, 3, device="cuda")
    assert not takes_kernels(x, w, None)
    assert takes_kernels(x, None)
    with torch.no_grad():
        assert takes_kernels(x, w)
    with torch.inference_mode():
        assert takes_kernels(torch.randn(2, 3, device="cuda"), torch.randn(4, 3, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layers_train_through_the_torch_reference():
    """Where autograd records (a draft model in training), the CUDA layers take torch's
    arithmetic, whose backward exists; libkk's kernels have none."""
    from libkk.layers.norm import RMSNorm
    from libkk.models.llama import LlamaMLP

    torch.manual_seed(0)
    with torch.device("cuda"):
        mlp, norm = LlamaMLP(32, 64), RMSNorm(32)
        for p in mlp.parameters():
            p.data.normal_(0, 0.2)
            p.requires_grad_(True)
        x = torch.randn(5, 32, requires_grad=True)
    out, _ = norm(mlp(x), x)
    out.square().sum().backward()
    assert x.grad is not None and x.grad.isfinite().all()
    assert all(p.grad is not None for p in mlp.parameters())
    with torch.no_grad():  # the kernels, without autograd: the same forward
        kernel_out, _ = norm(mlp(x), x)
    torch.testing.assert_close(kernel_out, out.detach(), rtol=1e-4, atol=1e-4)
