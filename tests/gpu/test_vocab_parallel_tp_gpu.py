"""Vocab-parallel probabilistic DFlash drafting and verification on two GPUs (NCCL): seeded
sampled tokens and draft/acceptance counts equal those of drafting and verifying on whole rows.

    pytest -m gpu tests/gpu/test_vocab_parallel_tp_gpu.py     (needs >= 2 CUDA devices)
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs at least 2 CUDA devices",
    ),
]


def test_sampled_dflash_at_tp2_from_vocab_shards_equals_whole_rows(tiny_qwen3_dir, tmp_path):
    from libkk import SamplingParams, Session
    from libkk.spec.dflash import DFlashConfig, save_drafter
    from libkk.spec.train import init_drafter

    config = DFlashConfig(
        hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=64, vocab_size=2048, target_layer_ids=(0, 2), mask_token_id=3, block_size=5,
        max_position_embeddings=1024,
    )  # fmt: skip
    drafter = save_drafter(init_drafter(config, seed=2), tmp_path / "drafter", torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 2048, (n,), generator=g).tolist() for n in (5, 40, 90, 12)]
    params = [
        SamplingParams(max_tokens=32, temperature=t, seed=10 + i, ignore_eos=True)
        for i, t in enumerate([0.6, 1.0, 1.3, 0.0])
    ]
    results = []
    for vocab_parallel in (False, True):
        spec = {"method": "dflash", "draft_model": str(drafter), "num_speculative_tokens": 4,
                "draft_sampling": "probabilistic", "vocab_parallel_drafting": vocab_parallel}  # fmt: skip
        with Session(str(tiny_qwen3_dir), device="cuda", dtype="float32", tensor_parallel_size=2,
                     max_num_seqs=8, max_model_len=512, progress=False, worker_timeout_s=120.0,
                     speculative=spec) as s:  # fmt: skip
            tokens = [o.token_ids for o in s.generate(prompts, params)]
            stats = s.stats()
            assert (s.engine.runner.vocab_head is not None) == vocab_parallel
        counts = [stats[k] for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens")]
        results.append((tokens, counts))
    assert results[1] == results[0]
    assert results[0][1][0] > 0
