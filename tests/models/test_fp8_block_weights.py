"""FP8 per-block linears: an FP8 checkpoint (quantization_config "fp8", 128x128 blocks) and a
full-precision one quantized on load give the same weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from libkk.errors import UnsupportedModelError
from libkk.models.loader import load_model
from libkk.quant.checkpoint import FP8_BLOCK_CONFIG, fp8_block_quantize_stream

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    full = tmp_path_factory.mktemp("full")
    config = LlamaConfig(
        vocab_size=256, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(full)
    fp8 = tmp_path_factory.mktemp("fp8")
    shutil.copy(full / "config.json", fp8 / "config.json")
    tensors = dict(fp8_block_quantize_stream(load_file(full / "model.safetensors").items()))
    save_file(tensors, fp8 / "model.safetensors")
    raw = json.loads((fp8 / "config.json").read_text())
    raw["quantization_config"] = FP8_BLOCK_CONFIG
    (fp8 / "config.json").write_text(json.dumps(raw))
    return full, fp8, tensors


def _params(path, **kw):
    model, _ = load_model(path, torch.float32, CPU, progress=False, **kw)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_fp8_checkpoint_equals_quantize_on_load(tiny_dirs):
    full, fp8, tensors = tiny_dirs
    # Ragged blocks: 192 and 320 are not multiples of 128.
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert scale.shape == (2, 3)
    original = _params(full)
    from_checkpoint = _params(fp8)
    on_load = _params(full, quantization="fp8_per_block")
    assert from_checkpoint.keys() == on_load.keys() == original.keys()
    for name, value in on_load.items():
        assert torch.equal(value, from_checkpoint[name]), name
        if name.endswith("proj.weight"):
            assert not torch.equal(value, original[name])  # really quantized
            err = (value - original[name]).abs().max() / original[name].abs().max()
            assert err < 0.07  # e4m3 keeps 3 mantissa bits
        else:
            assert torch.equal(value, original[name]), name  # norms, embeddings untouched


def test_other_quantization_configs_are_refused(tiny_dirs, tmp_path):
    full, _, _ = tiny_dirs
    other = tmp_path / "awq"
    shutil.copytree(full, other)
    raw = json.loads((other / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (other / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="awq"):
        load_model(other, torch.float32, CPU, progress=False)
