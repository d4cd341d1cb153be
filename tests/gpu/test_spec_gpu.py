"""Speculation helpers on CUDA at real vocab sizes: vocab-parallel == full-vocab, CUDA == CPU."""

from __future__ import annotations

import pytest
import torch

from libkk.sample.rejection import rejection_sample
from libkk.spec_decode.adaptive import AdaptiveVerifier, CostModel, synthetic_accept
from libkk.spec_decode.estimator import AcceptanceEstimator, draft_feature
from libkk.spec_decode.vocab_parallel import (
    sample_draft_full,
    vocab_parallel_draft,
    vocab_parallel_rejection_sample,
    vocab_starts,
)

pytestmark = pytest.mark.gpu

VOCAB = 151936  # Qwen3
DEV = "cuda"


def _case(num_rows: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    temps = torch.tensor([0.0, 0.6, 0.8, 1.0, 1.3], device=DEV).repeat(num_rows // 5 + 1)[:num_rows]
    draft = torch.randn(num_rows, k, VOCAB, device=DEV, generator=g) * 4
    target = torch.randn(num_rows, k + 1, VOCAB, device=DEV, generator=g) * 4
    mix = torch.rand(num_rows, 1, 1, device=DEV, generator=g) ** 2
    target[:, :k] = (1 - mix) * draft + mix * target[:, :k]
    return dict(
        temps=temps,
        draft=draft,
        target=target,
        seeds=torch.randint(-(2**62), 2**62, (num_rows,), device=DEV, generator=g),
        positions=torch.randint(0, 100_000, (num_rows,), device=DEV, generator=g),
        num_draft=torch.arange(num_rows, device=DEV) % (k + 1),
    )


@pytest.mark.parametrize("sizes", [[VOCAB // 2] * 2, [40000, 50000, VOCAB - 90000]])
def test_vocab_parallel_matches_full_vocab_on_cuda(sizes: list[int]) -> None:
    num_rows, k = 32, 7
    for seed in range(3):
        c = _case(num_rows, k, seed)
        flat = c["draft"].reshape(num_rows * k, VOCAB)
        temps = c["temps"].repeat_interleave(k)
        seeds = c["seeds"].repeat_interleave(k)
        positions = (c["positions"][:, None] + torch.arange(k, device=DEV)).reshape(-1)
        full = sample_draft_full(flat, temps, seeds, positions).view(num_rows, k)
        vp = vocab_parallel_draft(
            list(flat.split(sizes, -1)), vocab_starts(sizes), temps, seeds, positions
        )
        assert torch.equal(vp.token_ids.view(num_rows, k), full)
        # The same drafts on the CPU (the noise's u is bit-identical across devices).
        cpu = sample_draft_full(flat.cpu(), temps.cpu(), seeds.cpu(), positions.cpu())
        assert torch.equal(cpu.view(num_rows, k), full.cpu())

        temp = torch.where(c["temps"] == 0, 1.0, c["temps"])[:, None, None]
        probs = torch.softmax(c["draft"] / temp, dim=-1)
        args = (c["temps"], c["seeds"], c["positions"], c["num_draft"])
        ref = rejection_sample(c["target"], full, probs, *args)
        got = vocab_parallel_rejection_sample(
            list(c["target"].split(sizes, -1)),
            list(c["draft"].split(sizes, -1)),
            vocab_starts(sizes),
            full,
            vp.logprobs.view(num_rows, k),
            vp.lse.view(num_rows, k),
            *args,
        )
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
        ref1 = rejection_sample(c["target"], full, None, *args)
        got1 = vocab_parallel_rejection_sample(
            list(c["target"].split(sizes, -1)), None, vocab_starts(sizes), full, None, None, *args
        )
        assert torch.equal(got1[1], ref1[1]) and torch.equal(got1[0], ref1[0])


def test_estimator_and_synthetic_acceptance_take_cuda_inputs() -> None:
    num_rows, k = 32, 7
    c = _case(num_rows, k, 9)
    feats = draft_feature(c["draft"], c["temps"][:, None])  # [R, K] on CUDA
    torch.testing.assert_close(
        feats.cpu(), draft_feature(c["draft"].cpu(), c["temps"].cpu()[:, None]), atol=1e-4, rtol=0
    )
    cost = CostModel(draft_ms=[(1, 2.0), (64, 3.0)], verify_ms=[(1, 8.0), (512, 14.0)])
    verifier = AdaptiveVerifier(AcceptanceEstimator(k), cost)
    nd = verifier.choose(feats)
    acc = synthetic_accept([0.8] * k, nd.to(DEV), c["seeds"], c["positions"])
    cpu = synthetic_accept([0.8] * k, nd, c["seeds"].cpu(), c["positions"].cpu())
    assert torch.equal(acc.cpu(), cpu)
    verifier.observe(feats, nd, acc)
    assert verifier.estimator.observed_steps == 1
