"""Random tiny checkpoints for tests: a transformers model saved with a tokenizer, so the real
loader runs and nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def save_with_word_tokenizer(model, path: Path) -> Path:
    """Saves `model` with a word-level tokenizer "t0".."t{V-1}" (token ids serve as prompts;
    "t1" is EOS, as the tiny configs' eos_token_id)."""
    from tokenizers import Tokenizer, models

    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))
    return path


def save_with_tokenizer_of(model, path: Path, source: Path) -> Path:
    """Saves `model` with the tokenizer files of the checkpoint in `source` (text prompts)."""
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


def tiny_llama_config(**overrides):
    """A 2-layer Llama with the default model's vocabulary; weights drawn wider than HF's default
    init so logits are well separated (greedy equivalence tests must not hinge on near-ties)."""
    from transformers import LlamaConfig

    base = dict(
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
    return LlamaConfig(**(base | overrides))
