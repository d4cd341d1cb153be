"""Weights loaded onto CUDA through the staged reader equal those loaded from memory-mapped files."""

from __future__ import annotations

import pytest
import torch

import libkk.models.loader as loader
from libkk.models.loader import load_model

pytestmark = pytest.mark.gpu


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load_both_ways(path, dtype, monkeypatch) -> tuple[dict, dict]:  # noqa: ANN001
    """The model's weights loaded staged (forced: a checkpoint this small would be memory-mapped),
    then memory-mapped."""
    files_read = []
    read = loader.StagedReader.read

    def counting(self, files):  # noqa: ANN001, ANN202
        files_read.extend(files)
        return read(self, files)

    monkeypatch.setattr(loader, "worth_staging", lambda total_bytes: True)
    monkeypatch.setattr(loader.StagedReader, "read", counting)
    staged, _ = load_model(path, dtype, torch.device("cuda"), progress=False)
    assert files_read, "the CUDA load did not go through the staged reader"
    monkeypatch.setattr(loader, "worth_staging", lambda total_bytes: False)
    mapped, _ = load_model(path, dtype, torch.device("cuda"), progress=False)
    return _state(staged), _state(mapped)


def _assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_staged_dense_load_equals_the_mapped_one(tmp_path, dtype, monkeypatch):
    from transformers import LlamaForCausalLM

    from tests.checkpoints import save_with_word_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    path = save_with_word_tokenizer(
        LlamaForCausalLM(tiny_llama_config(vocab_size=4096, tie_word_embeddings=False)),
        tmp_path / "llama",
    )
    _assert_same_bits(*_load_both_ways(path, dtype, monkeypatch))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4-csf"])
def test_staged_packed_expert_load_equals_the_mapped_one(tiny_moe_dirs, fmt, monkeypatch):
    _assert_same_bits(*_load_both_ways(tiny_moe_dirs[fmt], torch.bfloat16, monkeypatch))
