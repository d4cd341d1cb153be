"""`libkk quantize`: 4-bit expert weights written to a checkpoint and loaded back."""

from __future__ import annotations

import json

import pytest
import torch

from libkk.errors import CorruptCheckpointError
from libkk.models.loader import load_model
from libkk.models.quantize import quantize_checkpoint
from libkk.quant.checkpoint import QUANT_CONFIG
from libkk.quant.formats import dequantize_mxfp4, dequantize_nvfp4, quantize_mxfp4, quantize_nvfp4

FORMATS = ("nvfp4", "mxfp4", "nvfp4-csf", "mxfp4-csf")


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("tiny-moe")
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir, torch.float32, torch.device("cpu"), progress=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def quantized(tiny_moe_dir, tmp_path_factory):
    out = {}
    for fmt in FORMATS:
        dst = tmp_path_factory.mktemp(fmt)
        report = quantize_checkpoint(tiny_moe_dir, dst / "q", fmt, progress=False)
        model, _ = load_model(dst / "q", torch.float32, torch.device("cpu"), progress=False)
        out[fmt] = (dst / "q", report, {n: p.detach() for n, p in model.named_parameters()})
    return out


def _fake_quant(w: torch.Tensor, algo: str) -> torch.Tensor:
    if algo == "nvfp4":
        return dequantize_nvfp4(quantize_nvfp4(w))
    return dequantize_mxfp4(quantize_mxfp4(w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_loaded_experts_are_the_dequantized_weights(fmt, quantized, reference):
    path, report, params = quantized[fmt]
    assert json.loads((path / QUANT_CONFIG).read_text())["csf"] == fmt.endswith("csf")
    assert report.num_quantized == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert report.dst_bytes < report.src_bytes
    algo = fmt.split("-")[0]
    experts = [n for n in params if ".experts." in n]
    assert experts
    for name, value in params.items():
        if name in experts:
            # Stacked [E, rows, K]: each expert's rows were quantized as their own tensors.
            ref = reference[name]
            assert not torch.equal(value, ref)  # really quantized
            if name.endswith("w2_weight"):
                expected = torch.stack([_fake_quant(w, algo) for w in ref])
            else:  # w13: gate rows then up rows, quantized separately
                half = ref.shape[1] // 2
                expected = torch.stack(
                    [torch.cat([_fake_quant(w[:half], algo), _fake_quant(w[half:], algo)])
                     for w in ref]
                )  # fmt: skip
            torch.testing.assert_close(value, expected, rtol=0, atol=0)
        else:
            assert torch.equal(value, reference[name]), name


@pytest.mark.parametrize("algo", ["nvfp4", "mxfp4"])
def test_csf_checkpoint_loads_bit_identical_weights(algo, quantized):
    plain, csf = quantized[algo][2], quantized[f"{algo}-csf"][2]
    assert plain.keys() == csf.keys()
    assert all(torch.equal(plain[n], csf[n]) for n in plain)
    report = quantized[f"{algo}-csf"][1]
    assert report.scale_bytes == quantized[algo][1].stored_scale_bytes


def test_bad_format_and_nonempty_destination(tiny_moe_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown format"):
        quantize_checkpoint(tiny_moe_dir, tmp_path / "x", "int3")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    with pytest.raises(FileExistsError):
        quantize_checkpoint(tiny_moe_dir, tmp_path / "full", "nvfp4")


def test_a_missing_scale_is_a_corrupt_checkpoint(quantized, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = quantized["mxfp4"][0]
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    weights = broken / "model.safetensors"
    tensors = load_file(weights)
    victim = next(n for n in tensors if n.endswith(".weight_scale"))
    del tensors[victim]
    save_file(tensors, weights)
    with pytest.raises(CorruptCheckpointError, match="missing parts"):
        load_model(broken, torch.float32, torch.device("cpu"), progress=False)


def _corrupt(blob: bytes, how: str) -> bytes:
    import struct

    if how == "magic":
        return b"XXXX" + blob[4:]
    if how == "version":
        return blob[:4] + struct.pack("<H", 99) + blob[6:]
    return blob[: len(blob) - 5]  # truncated


def _with_corrupt_csf_blob(src, dst, how: str) -> str:
    """A copy of the checkpoint `src` at `dst` with one CSF scale blob corrupted; its name."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    tensors = load_file(weights)
    victim = sorted(n for n in tensors if n.endswith(".weight_scale_csf"))[3]
    bad = _corrupt(tensors[victim].numpy().tobytes(), how)
    tensors[victim] = torch.frombuffer(bytearray(bad), dtype=torch.uint8)
    save_file(tensors, weights)
    return victim


@pytest.mark.parametrize(
    "how, match", [("magic", "bad magic"), ("version", "version 99"), ("truncated", "bytes")]
)
def test_a_corrupt_csf_blob_is_a_corrupt_checkpoint_naming_the_tensor(
    quantized, tmp_path, how, match
):
    victim = _with_corrupt_csf_blob(quantized["mxfp4-csf"][0], tmp_path / "broken", how)
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        load_model(tmp_path / "broken", torch.float32, torch.device("cpu"), progress=False)
    assert repr(victim) in str(info.value)


def test_a_csf_blob_decoded_by_the_model_is_reported_with_the_tensor_name(
    quantized, tmp_path, monkeypatch
):
    """Packed experts (CUDA) decode CSF blobs inside the model's load_weights, without the tensor
    name: the loader names the tensor the model was taking."""
    from libkk.models import loader
    from libkk.quant.csf import CSFTensor

    victim = _with_corrupt_csf_blob(quantized["mxfp4-csf"][0], tmp_path / "broken", "magic")

    def passthrough(tensors, config, dtype):  # the blobs reach the model as they are
        yield from tensors

    def load_weights(self, tensors):
        for name, tensor in tensors:
            if name.endswith("_csf"):
                CSFTensor.from_bytes(tensor.numpy().tobytes())
        return set()

    monkeypatch.setattr(loader, "dequantize_stream", passthrough)
    model_dir = tmp_path / "broken"
    model_class = loader.get_model_class(loader.read_arch_config(model_dir).architecture)
    monkeypatch.setattr(model_class, "load_weights", load_weights)
    with pytest.raises(CorruptCheckpointError, match="bad magic") as info:
        load_model(model_dir, torch.float32, torch.device("cpu"), progress=False)
    assert repr(victim) in str(info.value) and "model.safetensors" in str(info.value)


def test_cli_quantize(tiny_moe_dir, tmp_path, capsys):
    from libkk.cli import main

    assert main(["quantize", str(tiny_moe_dir), str(tmp_path / "q"), "--format", "mxfp4-csf"]) == 0
    assert "24 expert weights as mxfp4-csf" in capsys.readouterr().out
    assert (tmp_path / "q" / QUANT_CONFIG).exists()
    assert main(["quantize", str(tiny_moe_dir), str(tmp_path / "q"), "--format", "nvfp4"]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize("algo", ["nvfp4", "mxfp4"])
def test_quantize_on_load_equals_the_quantized_checkpoint(algo, tiny_moe_dir, quantized):
    model, _ = load_model(
        tiny_moe_dir, torch.float32, torch.device("cpu"), progress=False, moe_weight_format=algo
    )
    on_load = {n: p.detach() for n, p in model.named_parameters()}
    prequantized = quantized[algo][2]
    assert on_load.keys() == prequantized.keys()
    assert all(torch.equal(on_load[n], prequantized[n]) for n in on_load)
