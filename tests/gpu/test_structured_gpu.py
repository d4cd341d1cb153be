"""Structured output on CUDA: the mask kernel in the sampler, with the forward in FULL CUDA graphs
(and asynchronous scheduling, the CUDA default) against the eager forward: the same tokens, every
output valid. A tiny random Qwen3 with a byte-level BPE tokenizer trained here (llguidance needs a
byte-level or SentencePiece vocabulary; nothing is downloaded)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from libkk import SamplingParams, Session

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


def byte_level_tokenizer(path, vocab_size: int = 400) -> None:
    """A byte-level BPE trained on a few lines, saved as tokenizer.json (+ config, EOS "<eos>")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ['{"name": "Ada", "age": 36, "tags": ["a", "b"]}', "2024-05-17 is a date"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen3-bpe")
    config = Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    byte_level_tokenizer(path)
    return path


def _run(path, **settings) -> list[str]:
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured={"json_schema": SCHEMA})
        for s in range(6)
    ] + [SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured={"regex": DATE})
         for s in range(6)]  # fmt: skip
    with Session(str(path), device="cuda", max_model_len=256, max_num_seqs=16, progress=False,
                 **settings) as s:  # fmt: skip
        outs = s.generate(["Describe someone:"] * 6 + ["A date:"] * 6, params)
    return [o.text for o in outs]


def test_graphs_equal_eager_and_outputs_are_valid(model_dir):
    import jsonschema

    eager = _run(model_dir, cudagraph_mode="NONE", torch_compile=False)
    assert _run(model_dir) == eager
    for text in eager[:6]:
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in eager[6:]:
        assert re.fullmatch(DATE, text), text
