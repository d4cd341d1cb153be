"""Shared fixtures of the GPU tests (`pytest -m gpu`; skipped without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen3")
    config = Qwen3Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))
    return path
