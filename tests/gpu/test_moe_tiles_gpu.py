"""Measured MoE tiles end to end on CUDA: a Session on a tiny packed-MoE model times tile candidates
before graph capture and records them in its artifact entry; a second Session loads the same
choices without timing anything and generates the same tokens.

Run: python -m pytest -q -m gpu tests/gpu/test_moe_tiles_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.checkpoints import save_with_word_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen3-moe-tiles")
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return save_with_word_tokenizer(Qwen3MoeForCausalLM(config), path)


def test_session_tunes_records_and_a_second_session_loads_without_timing(
    tiny_moe_dir, tmp_path, monkeypatch
):
    from libkk.graphs import moe_tiles
    from libkk.graphs.artifacts import ArtifactCache
    from libkk.kernels import moe as M

    from libkk import SamplingParams, Session

    monkeypatch.setenv("LIBKK_CACHE_DIR", str(tmp_path / "cache"))
    M.clear_tile_choices()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 300, 99], [42, 7], [100, 3, 4, 5, 6, 7, 8, 9]]
    kwargs = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
                  moe_weight_format="nvfp4", progress=False)  # fmt: skip

    with Session(str(tiny_moe_dir), **kwargs) as s:
        cold = s.engine.runner.moe_tile_choices
        cold_tokens = [o.token_ids for o in s.generate(prompts, params)]
    assert cold and {c.source for c in cold} == {"measured"}
    shape = M.MoeShape("nvfp4", "w4a16", 16, 256, 128, 4)
    assert {c.shape for c in cold} == {shape}
    assert [c.bucket for c in cold] == moe_tiles.tuning_buckets(max(c.bucket for c in cold))
    assert all(c.seconds is not None and c.seconds <= c.static_seconds for c in cold)
    installed = M.installed_tile_choices()
    assert installed == {shape: {c.bucket: c.config for c in cold}}
    entries = ArtifactCache(tmp_path / "cache" / "artifacts").list_entries()
    stored = [
        ArtifactCache(tmp_path / "cache" / "artifacts").entry(e.key).load_autotune()
        for e in entries
    ]
    assert sum(len(s.get(moe_tiles.STORE_KERNELS["w4a16"], {})) for s in stored) == len(cold)

    def no_timing(self, problem, config):
        raise AssertionError("a warm start timed a MoE tile")

    M.clear_tile_choices()
    monkeypatch.setattr(moe_tiles.CudaTileTimer, "__call__", no_timing)
    with Session(str(tiny_moe_dir), **kwargs) as s:
        warm = s.engine.runner.moe_tile_choices
        warm_tokens = [o.token_ids for o in s.generate(prompts, params)]
    assert [(c.bucket, c.config, c.source) for c in warm] == [
        (c.bucket, c.config, "recorded") for c in cold
    ]
    assert M.installed_tile_choices() == installed
    assert warm_tokens == cold_tokens
    M.clear_tile_choices()


def test_tuning_can_be_turned_off(tiny_moe_dir, tmp_path, monkeypatch):
    from libkk.kernels import moe as M

    from libkk import Session

    monkeypatch.setenv("LIBKK_CACHE_DIR", str(tmp_path / "cache"))
    M.clear_tile_choices()
    with Session(str(tiny_moe_dir), device="cuda", dtype="bfloat16", max_num_seqs=2,
                 max_model_len=128, moe_weight_format="nvfp4", tune_moe_tiles=False,
                 progress=False) as s:  # fmt: skip
        assert s.engine.runner.moe_tile_choices == []
    assert M.installed_tile_choices() == {}
