"""The engine against transformers' greedy tokens, shared by the model-family tests: a full
recompute per token on the HF side; on libkk's, the same prompts alone, batched, in 7-token
chunked-prefill steps and from the prefix cache, all equal."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from libkk import SamplingParams, Session


@torch.no_grad()
def hf_greedy(hf: nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):  # full recompute every step
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def check_engine_greedy(path: Path, prompts: list[list[int]], want: list[list[int]]) -> None:
    """`prompts[1]` must share at least 24 leading tokens with `prompts[0]`, and every prompt be
    at least 40 tokens (the prefix-hit and chunk-count checks rely on it)."""
    assert all(len(set(w)) > 1 for w in want), "degenerate reference"
    params = SamplingParams(max_tokens=len(want[0]), temperature=0.0, ignore_eos=True)
    common = dict(block_size=4, max_model_len=128)
    with Session(str(path), max_num_seqs=1, enable_prefix_caching=False, **common) as s:
        assert [s.generate(p, params).token_ids for p in prompts] == want
    with Session(str(path), enable_prefix_caching=False, **common) as s:
        assert [o.token_ids for o in s.generate(prompts, params)] == want
    with Session(
        str(path), max_num_batched_tokens=7, enable_prefix_caching=False, **common
    ) as s:  # fmt: skip
        assert [o.token_ids for o in s.generate(prompts, params)] == want
        assert s.engine.num_steps > len(prompts) * 40 // 7
    with Session(str(path), **common) as s:
        first = s.generate(prompts[0], params)
        again = s.generate(prompts, params)  # prompts[0] whole, prompts[1] its first 24 tokens
        assert first.token_ids == want[0]
        assert [o.token_ids for o in again] == want
        assert again[0].num_cached_tokens >= 36 and again[1].num_cached_tokens >= 24
