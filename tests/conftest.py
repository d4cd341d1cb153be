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
    """A 2-layer random Llama with the default model's tokenizer, so prompts can be text."""
    from transformers import LlamaForCausalLM

    from tests.checkpoints import save_with_tokenizer_of, tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    return save_with_tokenizer_of(model, tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A 3-layer random Qwen3 with a word-level tokenizer (token ids as prompts): no model
    download, so the GPU machine can run it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.checkpoints import save_with_word_tokenizer

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
    return save_with_word_tokenizer(Qwen3ForCausalLM(config), path)
