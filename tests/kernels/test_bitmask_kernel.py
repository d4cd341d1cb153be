"""Structured output's mask kernel against its torch reference and against a plain loop: listed
rows only, word and sign-bit edges, vocabularies past the mask (padded model vocabularies) and
shorter than it, every logits dtype; and the sampler through it on the kernels' device."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, ON_CUDA, RUNS_KERNELS
from libkk.kernels.bitmask import apply_token_bitmask, apply_token_bitmask_ref

from libkk.sample.params import SamplingParams
from libkk.sample.sampler import Sampler, SamplingRow

pytestmark = RUNS_KERNELS

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def _signed(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "mask_vocab, logits_vocab", [(100, 100), (70, 2100), (2100, 1500), (33, 33)]
)
def test_kernel_matches_reference_and_a_loop(dtype, mask_vocab, logits_vocab):
    g = torch.Generator().manual_seed(mask_vocab + logits_vocab)
    allowed = [torch.randperm(mask_vocab, generator=g)[:n].tolist() for n in (0, 1, 5, mask_vocab)]
    allowed[2] += [31, 0, mask_vocab - 1]  # word edges, bit 31 (the sign bit)
    bitmask = torch.stack([_signed(_mask_of_int64(a, mask_vocab)) for a in allowed]).to(DEVICE)
    logits = torch.randn(6, logits_vocab, generator=g).to(DEVICE, dtype)
    rows = torch.tensor([4, 0, 5, 2], device=DEVICE)  # rows 1 and 3 carry no grammar
    got = apply_token_bitmask(logits.clone(), bitmask, rows)
    want = apply_token_bitmask_ref(logits.clone(), bitmask, rows)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    by_hand = logits.clone()
    for r, ids in zip(rows.tolist(), allowed, strict=True):
        keep = torch.full((logits_vocab,), float("-inf"), dtype=dtype, device=DEVICE)
        ids = [t for t in ids if t < logits_vocab]
        keep[ids] = logits[r, ids]
        by_hand[r] = keep
    torch.testing.assert_close(got, by_hand, rtol=0, atol=0)


def _mask_of_int64(allowed: list[int], vocab: int) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in set(allowed):
        words[t // 32] += 1 << (t % 32)
    return words


def test_no_masks_and_bad_inputs():
    logits = torch.randn(3, 40, device=DEVICE)
    empty = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert torch.equal(apply_token_bitmask(logits.clone(), empty, rows), logits)
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask(logits, empty.long(), rows)
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), rows)


def test_sampler_on_the_kernels_device():
    """The sampler masks constrained rows (only those) through the kernel on CUDA and through
    the reference on the CPU: the same tokens either way, always allowed ones."""
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [7, 40, 63, 299]
    rows = [
        SamplingRow(SamplingParams(temperature=1.0), 3, 5, [1], [],
                    grammar_mask=_signed(_mask_of_int64(allowed, vocab))),
        SamplingRow(SamplingParams(temperature=0.0), 3, 5, [1], []),
        SamplingRow(SamplingParams(temperature=0.0), 3, 5, [1], [],
                    grammar_mask=_signed(_mask_of_int64(allowed[:1], vocab))),
        SamplingRow(SamplingParams(temperature=1.0), 4, 5, [1], []),
    ]  # fmt: skip
    sampler = Sampler()
    cpu = sampler(logits, rows).token_ids
    assert cpu[0] in allowed and cpu[2] == 7
    assert cpu[1] == int(logits[1].argmax())
    if ON_CUDA:
        assert sampler(logits.cuda(), rows).token_ids == cpu
