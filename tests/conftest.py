from __future__ import annotations

import os

import pytest
import torch

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model, converted once into the user cache and shared by every test."""
    from libkk.models.default import default_model_path

    return default_model_path(progress=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir):
    """A 2-layer random Llama with the default model's tokenizer, so prompts can be text.

    Weights are drawn wider than HF's default init so logits are well separated: equivalence
    tests compare greedy tokens, and near-ties would make them depend on summation order.
    """
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A 3-layer random Qwen3 with a word-level tokenizer (token ids as prompts): no model
    download, so the GPU machine can run it."""
    import json

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
