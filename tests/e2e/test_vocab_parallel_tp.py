"""Vocab-parallel DFlash drafting and verification at tensor parallelism > 1 on CPU (gloo).

With `vocab_parallel_drafting` every rank drafts and verifies from its vocabulary shard with small
all-gathers; the tokens must be those of the full-vocabulary path: greedy tokens those of plain
decoding at one rank, sampled tokens (seeded; the noise is keyed by absolute token id) those of
the same tensor-parallel size drafting and verifying on whole rows, with the same draft and
acceptance counts. Steps the shards do not cover (top-p, logprobs) fall back to whole rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libkk import Session
from libkk.runtime import model_runner
from libkk.sample.params import SamplingParams

PROMPTS = [
    [5, 17, 42, 99, 3],
    list(range(30, 60)),  # longer than the step budget: chunked prefill
    [7, 7, 7],
    [200, 11, 64, 9],
]
SETTINGS = dict(
    progress=False,
    num_gpu_blocks=64,
    block_size=8,
    max_num_seqs=4,
    max_model_len=96,
    max_num_batched_tokens=24,
    worker_timeout_s=60.0,
)
COUNTS = ("spec_num_verify_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """A 2-layer random Qwen3, vocab 250 (not a multiple of 3: tp=3 pads the last shard), 12
    heads and 6 KV heads (splits at 2 and 3), token-id prompts."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.checkpoints import save_with_word_tokenizer

    path = tmp_path_factory.mktemp("vp-qwen3")
    config = Qwen3Config(
        vocab_size=250, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=12, num_key_value_heads=6, head_dim=8, max_position_embeddings=128,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return save_with_word_tokenizer(Qwen3ForCausalLM(config), path)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    """A random DFlash drafter for it: 6 heads and 6 KV heads (splits at 2 and 3), K = 4."""
    from libkk.spec_decode.dflash_model import DFlashConfig, save_drafter
    from libkk.spec_decode.training.distill import init_drafter

    config = DFlashConfig(
        hidden_size=48, intermediate_size=96, num_layers=1, num_heads=6, num_kv_heads=6,
        head_dim=8, vocab_size=250, target_layer_ids=(0, 1), mask_token_id=3, block_size=5,
        max_position_embeddings=128,
    )  # fmt: skip
    return save_drafter(init_drafter(config, seed=1), tmp_path_factory.mktemp("vp-drafter"))


@pytest.fixture
def shard_steps(monkeypatch) -> list[int]:
    """Rank 0's (this process's) verifications from vocab shards: requests per call."""
    calls: list[int] = []
    real = model_runner.verify_from_shards

    def counted(logits, requests, *args, **kwargs):
        calls.append(len(requests))
        return real(logits, requests, *args, **kwargs)

    monkeypatch.setattr(model_runner, "verify_from_shards", counted)
    return calls


def _spec(drafter_dir: Path, vocab_parallel: bool) -> dict:
    return {
        "method": "dflash",
        "draft_model": str(drafter_dir),
        "num_speculative_tokens": 4,
        "draft_sampling": "probabilistic",
        "vocab_parallel_drafting": vocab_parallel,
    }


def _run(path: Path, tp: int, spec: dict, params) -> tuple[list, dict]:
    with Session(str(path), tensor_parallel_size=tp, speculative=spec, **SETTINGS) as session:
        outs = session.generate(PROMPTS, params)
        return outs, session.stats()


def _sampled(temperatures, **extra) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=14, temperature=t, seed=100 + i, ignore_eos=True, **extra)
        for i, t in enumerate(temperatures)
    ]


def test_greedy_tokens_equal_plain_decoding_at_one_rank(qwen3_dir, drafter_dir, shard_steps):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    plain, _ = _run(qwen3_dir, 1, {}, params)
    two, stats = _run(qwen3_dir, 2, _spec(drafter_dir, True), params)
    assert [o.token_ids for o in two] == [o.token_ids for o in plain]
    assert stats["spec_num_verify_steps"] > 0
    assert shard_steps  # verified from vocab shards


@pytest.mark.parametrize("tp", [2, 3])
def test_sampled_tokens_equal_the_whole_row_path(qwen3_dir, drafter_dir, shard_steps, tp):
    """Temperatures 0.6 .. 1.3 and one greedy request in one batch: sampled drafts (q kept in
    shards) and one-hot drafts verified together."""
    params = _sampled([0.6, 1.0, 0.0, 1.3])
    whole, whole_stats = _run(qwen3_dir, tp, _spec(drafter_dir, False), params)
    assert not shard_steps
    shards, shard_stats = _run(qwen3_dir, tp, _spec(drafter_dir, True), params)
    assert [o.token_ids for o in shards] == [o.token_ids for o in whole]
    for key in COUNTS:
        assert shard_stats[key] == whole_stats[key], key
    assert shard_stats["spec_num_accepted_tokens"] > 0  # acceptance decisions were exercised
    assert shard_steps and max(shard_steps) > 1


def test_a_step_the_shards_do_not_cover_uses_whole_rows(
    qwen3_dir, drafter_dir, shard_steps, monkeypatch
):
    """top-p and logprobs rows: their steps verify on whole rows, the sampled drafts of the
    other requests gathered back from the kept shards; tokens and counts as the whole-row path."""
    gathered: list[int] = []
    real = model_runner.ModelRunner._with_gathered_drafts

    def counted(self, spec):
        result = real(self, spec)
        gathered.append(sum(a is not b for a, b in zip(result, spec, strict=True)))
        return result

    monkeypatch.setattr(model_runner.ModelRunner, "_with_gathered_drafts", counted)
    params = _sampled([0.8, 1.2, 0.7, 1.0])
    params[1] = SamplingParams(max_tokens=6, temperature=1.1, top_p=0.9, seed=7, ignore_eos=True)
    params[3] = SamplingParams(max_tokens=6, temperature=0.9, logprobs=2, seed=8, ignore_eos=True)
    whole, whole_stats = _run(qwen3_dir, 2, _spec(drafter_dir, False), params)
    shards, shard_stats = _run(qwen3_dir, 2, _spec(drafter_dir, True), params)
    assert [o.token_ids for o in shards] == [o.token_ids for o in whole]
    for key in COUNTS:
        assert shard_stats[key] == whole_stats[key], key
    assert sum(gathered) > 0  # whole-row steps verified shard-kept drafts
    assert shard_steps  # once the uncovered requests finished, steps went back to shards
    for got, ref in zip(shards[3].logprobs, whole[3].logprobs, strict=True):
        assert got.token_id == ref.token_id and abs(got.logprob - ref.logprob) < 1e-5
