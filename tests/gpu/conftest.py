"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory):
    """A 3-layer random Qwen3-MoE (8 heads, 16 experts of intermediate 128, top-4) with a word-level
    tokenizer: bf16 ("bf"), and quantized to "nvfp4" and "mxfp4-csf"."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from libkk.models.quantize import quantize_checkpoint
    from tests.checkpoints import save_with_word_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    config = Qwen3MoeConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=1024,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    dirs = {"bf": save_with_word_tokenizer(Qwen3MoeForCausalLM(config), path / "bf")}
    for fmt in ("nvfp4", "mxfp4-csf"):
        quantize_checkpoint(path / "bf", path / fmt, fmt, progress=False)
        dirs[fmt] = path / fmt
    return dirs
