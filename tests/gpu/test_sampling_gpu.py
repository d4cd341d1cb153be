"""Fused keyed Gumbel sampling on CUDA at Qwen3's vocabulary (151936): the kernel picks the same
tokens as the torch path on CUDA and on CPU, its uniforms are bit-identical, gumbel_argmax
dispatches CUDA logits to it, and it replays under CUDA graph capture.

Run: python -m pytest -q -m gpu tests/gpu/test_sampling_gpu.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: before importing triton, so CPU runs keep tests/kernels' interpreter switch working.
    pytest.skip("needs CUDA (run `pytest -m gpu` on the GPU machine)", allow_module_level=True)

from libkk.kernels import sampling as K  # noqa: E402

from libkk.sample import gumbel as G  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
VOCAB = 151_936


def inputs(rows: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, generator=g) * 3).to(dtype)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    positions = torch.randint(0, 2**32, (rows,), generator=g)
    seeds[0], positions[0] = -1, 2**32 - 1
    return logits.to(DEV), seeds.to(DEV), positions.to(DEV)


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_path(rows: int, dtype: torch.dtype):
    logits, seeds, positions = inputs(rows, seed=rows, dtype=dtype)
    got = K.gumbel_argmax(logits, seeds, positions)
    # libdevice's log / log1p are CUDA torch's: same noise bit for bit, so the same tokens.
    assert torch.equal(got, G.gumbel_argmax_ref(logits, seeds, positions))
    # CPU's log may differ in the last ulp: only a near-tie could change a token.
    cpu = G.gumbel_argmax_ref(logits.cpu(), seeds.cpu(), positions.cpu())
    assert torch.equal(got.cpu(), cpu)


def test_uniforms_bit_identical():
    _, seeds, positions = inputs(33, seed=1)
    got = K.keyed_uniform(seeds, positions, VOCAB)
    assert torch.equal(got, G.keyed_uniform(seeds, positions, VOCAB))
    assert torch.equal(got.cpu(), G.keyed_uniform(seeds.cpu(), positions.cpu(), VOCAB))


def test_gumbel_argmax_dispatches_cuda_to_the_kernel(monkeypatch):
    logits, seeds, positions = inputs(4, seed=2)
    calls = []

    def spy(*args):
        calls.append(args)
        return K.gumbel_argmax(*args)

    monkeypatch.setattr(G, "fused_gumbel_argmax", spy)
    got = G.gumbel_argmax(logits, seeds, positions)
    assert len(calls) == 1
    assert torch.equal(got, G.gumbel_argmax_ref(logits, seeds, positions))
    G.gumbel_argmax(logits.cpu(), seeds.cpu(), positions.cpu())
    assert len(calls) == 1  # CPU logits stay on the torch path


def test_cuda_graph_replay():
    logits, seeds, positions = inputs(8, seed=3)
    K.gumbel_argmax(logits, seeds, positions)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.gumbel_argmax(logits, seeds, positions)
    for seed in (4, 5):
        new_logits, new_seeds, new_positions = inputs(8, seed=seed)
        logits.copy_(new_logits)
        seeds.copy_(new_seeds)
        positions.copy_(new_positions)
        graph.replay()
        assert torch.equal(out, G.gumbel_argmax_ref(logits, seeds, positions))


def test_rejection_sampler_matches_cpu():
    from libkk.sample.rejection import rejection_sample

    g = torch.Generator().manual_seed(6)
    rows, k = 6, 3
    target = torch.randn(rows, k + 1, VOCAB, generator=g) * 2
    drafts = torch.randint(0, VOCAB, (rows, k), generator=g)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.0, 1.3, 0.9])
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    positions = torch.randint(0, 2**20, (rows,), generator=g)
    num_draft = torch.tensor([3, 3, 2, 0, 1, 3])
    args = (target, drafts, None, temps, seeds, positions, num_draft)
    cpu_out, cpu_acc = rejection_sample(*args)
    gpu_out, gpu_acc = rejection_sample(*(a.to(DEV) if a is not None else None for a in args))
    assert torch.equal(gpu_acc.cpu(), cpu_acc)
    assert torch.equal(gpu_out.cpu(), cpu_out)
