"""The KV host tier on CUDA: copies on a side stream, ordered by events, give the same tokens."""

from __future__ import annotations

import pytest
import torch

from libkk import SamplingParams, Session

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefix_from_the_host_tier_equals_a_fresh_run_on_cuda(tiny_qwen3_dir):
    long = list(range(100, 164))  # 16 blocks of 4
    others = [list(range(1000 + 64 * i, 1064 + 64 * i)) for i in range(12)]
    settings = dict(device="cuda", block_size=4, max_model_len=128, progress=False)
    with Session(str(tiny_qwen3_dir), enable_prefix_caching=False, **settings) as s:
        fresh = s.generate(long, GREEDY).token_ids
    # A device pool of about one sequence: the others push `long` out to pinned host memory.
    with Session(
        str(tiny_qwen3_dir), num_gpu_blocks=40, kv_offload_bytes=64 << 20, **settings
    ) as s:
        assert s.engine.host_tier._stream is not None  # copies run on the side stream
        assert s.generate(long, GREEDY).token_ids == fresh
        s.generate(others, GREEDY)
        again = s.generate(long, GREEDY)
        stats = s.stats()
    assert again.token_ids == fresh
    assert again.num_cached_tokens >= 32
    assert stats["offload_blocks_restored"] >= 8
