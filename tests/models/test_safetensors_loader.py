"""The safetensors loader's failure modes: each bad folder raises its error class, naming the
file / tensor / field at fault. Checkpoints are real (save_pretrained of a tiny model), then
damaged the way real downloads get damaged."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from libkk.errors import (
    CorruptCheckpointError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from libkk.models import arch_config, registry
from libkk.models.loader import load_model

CPU = torch.device("cpu")


def _load(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return load_model(path, dtype, CPU, progress=False)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama saved whole and sharded (read-only templates; tests copy them)."""
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    root = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return {"single": root / "single", "sharded": root / "sharded"}


@pytest.fixture
def single(tiny_dirs: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dirs["single"], tmp_path / "single"))


@pytest.fixture
def sharded(tiny_dirs: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dirs["sharded"], tmp_path / "sharded"))


def _edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _rewrite_tensors(path: Path, edit: Any) -> None:
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_loads_and_casts_to_the_requested_dtype(single: Path) -> None:
    model, config = _load(single, torch.bfloat16)
    assert config.architecture == "LlamaForCausalLM" and config.num_layers == 2
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with safe_open(str(single / "model.safetensors"), "pt") as f:
        want = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
    qkv = model.model.layers[1].self_attn.qkv_proj.weight  # rows [q 32 | k 16 | v 16]
    assert torch.equal(qkv[32:48], want.to(torch.bfloat16))


def test_missing_folder_and_config(tmp_path: Path, single: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        _load(tmp_path / "nowhere")
    (single / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        _load(single)


def test_corrupt_config_json(single: Path) -> None:
    text = (single / "config.json").read_text()
    (single / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(CorruptCheckpointError, match="config.json"):
        _load(single)


def test_missing_required_config_field(single: Path) -> None:
    config = json.loads((single / "config.json").read_text())
    del config["hidden_size"]
    (single / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError, match="hidden_size"):
        _load(single)


def test_unknown_architecture_lists_supported(single: Path) -> None:
    _edit_config(single, architectures=["FalconForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM") as info:
        _load(single)
    for name in registry.supported_architectures():
        assert name in str(info.value)
    assert len(registry.supported_architectures()) == 11


def test_registry_and_parsers_agree() -> None:
    assert set(registry.supported_architectures()) == set(arch_config._PARSERS)
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM"):
        registry.get_model_class("GPT2LMHeadModel")


@pytest.mark.parametrize("keep", [0.5, 0.99, 20])
def test_truncated_safetensors(single: Path, keep: float) -> None:
    file = single / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep) if keep < 1 else int(keep)])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        _load(single)


def test_missing_shard(sharded: Path) -> None:
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2
    shards[-1].unlink()
    with pytest.raises(ModelNotFoundError, match=shards[-1].name):
        _load(sharded)


def test_truncated_shard(sharded: Path) -> None:
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=shard.name):
        _load(sharded)


def test_index_names_a_tensor_its_shard_lacks(sharded: Path) -> None:
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, shard = next(iter(index["weight_map"].items()))
    others = sorted({f for f in index["weight_map"].values() if f != shard})
    index["weight_map"][name] = others[0]  # now points at the wrong shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=name) as info:
        _load(sharded)
    assert others[0] in str(info.value)


@pytest.mark.parametrize(
    "tensor",
    ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.k_proj.weight"],
)
def test_shape_mismatch_names_tensor_and_shapes(single: Path, tensor: str) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[tensor] = tensors[tensor][:, :-1].contiguous()

    _rewrite_tensors(single, shrink)
    with pytest.raises(CorruptCheckpointError, match=tensor.replace(".", r"\.")) as info:
        _load(single)
    message = str(info.value)
    assert "(16, 31)" in message or "(32, 31)" in message  # got
    assert "(16, 32)" in message or "(32, 32)" in message  # expected
    assert "model.safetensors" in message


def test_pickle_only_folder(single: Path) -> None:
    (single / "model.safetensors").unlink()
    (single / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(ModelNotFoundError, match="only safetensors") as info:
        _load(single)
    assert "pytorch_model.bin" in str(info.value)


def test_missing_weight_is_listed(single: Path) -> None:
    _rewrite_tensors(single, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CorruptCheckpointError, match=r"model\.layers\.1\.mlp\.gate_up_proj"):
        _load(single)


def test_extra_tensors_ignored_and_tied_head_copy_skipped(single: Path) -> None:
    reference, _ = _load(single)
    _edit_config(single, tie_word_embeddings=True)

    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        tensors["some.unrelated.tensor"] = torch.zeros(3)

    _rewrite_tensors(single, add)  # lm_head.weight stays in the file, as in some real repos
    model, _ = _load(single)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, reference.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial"),
    ],
)
def test_unsupported_features(single: Path, changes: dict[str, Any], field: str) -> None:
    _edit_config(single, **changes)
    with pytest.raises(UnsupportedModelError, match=field):
        _load(single)


def test_sliding_window_rejected_when_enabled() -> None:
    base = dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=4096,
        sliding_window=1024,
    )
    assert not arch_config.parse_arch_config({**base, "use_sliding_window": False}).is_moe
    with pytest.raises(UnsupportedModelError, match="sliding"):
        arch_config.parse_arch_config({**base, "use_sliding_window": True})
    mixtral = {**base, "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(UnsupportedModelError, match="sliding"):
        arch_config.parse_arch_config(mixtral)
    assert arch_config.parse_arch_config({**mixtral, "sliding_window": None}).is_moe
