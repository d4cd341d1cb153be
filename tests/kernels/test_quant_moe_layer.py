"""Packed 4-bit MoE layers (QuantFusedMoE) against the dequantized reference layers.

The packed layer loads a checkpoint's per-expert parts (weight, scales, global/input scales, CSF
scale blobs) and runs the fused kernels (Triton's interpreter on CPU); the reference layer holds
the dequantized weights and runs the plain torch loop. Same weights, so the outputs agree to
summation order. A tiny Qwen3-MoE checkpoint runs end to end both ways.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from libkk.kernels._jit import INTERPRETED

import libkk.models.loader as loader
from libkk.layers.moe import FusedMoE, select_experts
from libkk.layers.quant_moe import MoeOptions, QuantFusedMoE, map_expert_part_name
from libkk.quant.checkpoint import dequantize_stream, quant_config, quantize_tensor

ON_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    ON_CUDA or not INTERPRETED,
    reason="CPU interpreter test (test_interpreter_process.py reruns it); GPU: tests/gpu",
)
EXPERT_WEIGHTS = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                  "down_proj": ("w2_weight", 0)}  # fmt: skip


def test_map_expert_part_name():
    m = map_expert_part_name
    assert m("l.0.mlp.experts.3.gate_proj.weight_scale", EXPERT_WEIGHTS) == (
        "l.0.mlp.experts.w13_weight_scale", (3, 0))  # fmt: skip
    assert m("l.0.mlp.experts.3.up_proj.weight_scale_csf", EXPERT_WEIGHTS) == (
        "l.0.mlp.experts.w13_weight_scale", (3, 1))  # fmt: skip
    assert m("l.0.mlp.experts.12.down_proj.weight_scale_2", EXPERT_WEIGHTS) == (
        "l.0.mlp.experts.w2_weight_scale_2", (12, 0))  # fmt: skip
    assert m("l.0.mlp.experts.1.down_proj.input_scale", EXPERT_WEIGHTS) == (
        "l.0.mlp.experts.w2_input_scale", (1, 0))  # fmt: skip
    assert m("l.0.mlp.experts.3.gate_proj.weight", EXPERT_WEIGHTS) is None
    assert m("l.0.mlp.gate_proj.weight_scale", EXPERT_WEIGHTS) is None
    assert m("l.0.mlp.experts.3.other.weight_scale", EXPERT_WEIGHTS) is None


def _checkpoint(e: int, hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for x in range(e):
        out[f"m.experts.{x}.gate_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.1
        out[f"m.experts.{x}.up_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.1
        out[f"m.experts.{x}.down_proj.weight"] = torch.randn(hidden, inter, generator=g) * 0.1
    return out


def _load(module: torch.nn.Module, tensors) -> set[str]:
    params = dict(module.named_parameters(prefix="m.experts"))
    seen = set()
    for name, t in tensors:
        target = map_expert_part_name(name, EXPERT_WEIGHTS)
        if target is None:
            stem, _, proj = name.removesuffix(".weight").rpartition(".")
            param, part = EXPERT_WEIGHTS[proj]
            target = (f"m.experts.{param}", (int(stem.rpartition(".")[2]), part))
        p = params[target[0]]
        p.weight_loader(p, t, name, target[1])
        seen.add(target[0])
    return seen


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nvfp4-csf", "mxfp4-csf"])
def test_packed_layer_equals_dequantized_layer(fmt):
    e, hidden, inter, top_k, t = 4, 64, 32, 2, 9
    algo = fmt.split("-")[0]
    dense = _checkpoint(e, hidden, inter, seed=1)
    parts = {}
    for name, w in dense.items():
        parts.update(quantize_tensor(name, w, fmt))
    if fmt == "nvfp4":  # a calibrated input scale for one projection, as ModelOpt stores it
        parts["m.experts.0.gate_proj.input_scale"] = torch.tensor(0.5)

    packed = QuantFusedMoE(e, hidden, inter, algo, MoeOptions(algo, False, "fp8"))
    seen = _load(packed, parts.items())
    assert {"m.experts.w13_weight", "m.experts.w2_weight", "m.experts.w13_weight_scale"} <= seen
    ref = FusedMoE(e, hidden, inter)
    _load(ref, dequantize_stream(parts.items(), quant_config(fmt), torch.float32))

    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, hidden, generator=g)
    weights, ids = select_experts(torch.randn(t, e, generator=g), top_k, True)
    got = packed(x, weights, ids)
    want = ref(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    if fmt == "nvfp4":
        assert float(packed.w13_input_scale[0, 0]) == 0.5
    # input scales start at zero: without every scale calibrated, prefill stays W4A16
    assert "no calibrated input scales" in packed.describe()


@pytest.mark.parametrize("fmt", ["nvfp4-csf", "mxfp4-csf", "nvfp4"])
def test_prefetch_planes_expand_to_the_loaded_scales(fmt):
    """csf_prefetch: the layer's compressed scales, assembled from the checkpoint's per-expert
    CSF blobs (or encoded from raw scales), expand bit-exactly to the scales it loaded."""
    from libkk.kernels.csf import csf_expand

    from libkk.layers.quant_moe import layer_csf_planes

    e, hidden, inter = 3, 64, 64
    algo = fmt.split("-")[0]
    parts = {}
    for name, w in _checkpoint(e, hidden, inter, seed=4).items():
        w[::3, :16] *= 300.0  # scale bytes far outside their row's window: exception records
        parts.update(quantize_tensor(name, w, fmt))
    packed = QuantFusedMoE(e, hidden, inter, algo, MoeOptions(algo, True, None))
    _load(packed, parts.items())
    assert len(packed._csf_blobs) == (3 * e if fmt.endswith("csf") else 0)
    w13, w2 = layer_csf_planes(packed, torch.device("cpu"))
    assert packed._csf_blobs == {}
    assert w13.records.numel() > 0 and w2.records.numel() > 0  # exceptions made above
    for planes, want in ((w13, packed.w13_weight_scale), (w2, packed.w2_weight_scale)):
        out = torch.full_like(want, 0xA5)
        csf_expand(planes.kind, planes.base, planes.offsets, planes.records,
                   planes.record_offsets, out)  # fmt: skip
        assert torch.equal(out, want)


def test_packed_layer_rejects_bad_parts():
    from libkk.errors import CorruptCheckpointError, UnsupportedModelError

    packed = QuantFusedMoE(2, 64, 32, "nvfp4")
    with pytest.raises(CorruptCheckpointError, match="shape"):
        p = packed.w13_weight
        p.weight_loader(p, torch.zeros(32, 16, dtype=torch.uint8), "x.weight", (0, 0))
    with pytest.raises(CorruptCheckpointError, match="uint8"):
        p = packed.w2_weight
        p.weight_loader(p, torch.zeros(64, 16), "x.weight", (0, 0))
    blob = quantize_tensor("x.weight", torch.randn(64, 64), "mxfp4-csf")["x.weight_scale_csf"]
    with pytest.raises(CorruptCheckpointError, match="kind 'mxfp4'"):
        p = packed.w2_weight_scale
        p.weight_loader(p, blob, "x.weight_scale_csf", (0, 0))
    with pytest.raises(UnsupportedModelError, match="stacked"):
        packed.w2_weight.weight_loader(packed.w2_weight, torch.zeros(1), "x", None)
    with pytest.raises(UnsupportedModelError, match="multiple of 32"):
        QuantFusedMoE(2, 48, 32, "nvfp4")


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny_moe_dir(request, tmp_path_factory):
    import transformers

    from libkk.models.quantize import quantize_checkpoint

    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
        max_position_embeddings=128,
    )  # fmt: skip
    if request.param == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=4)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**common, num_local_experts=4)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(path / "bf")
    quantize_checkpoint(path / "bf", path / "q", "nvfp4-csf", progress=False)
    return path / "q"


def test_tiny_model_packed_equals_dequantized(tiny_moe_dir, monkeypatch, caplog):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from paged_helpers import PagedKV

    ref, _ = loader.load_model(tiny_moe_dir, torch.float32, torch.device("cpu"), progress=False)
    assert not any(isinstance(m, QuantFusedMoE) for m in ref.modules())
    # Force the packed path on the CPU (the loader packs only on CUDA) to run the kernels here.
    monkeypatch.setattr(loader, "_moe_options", lambda *a: MoeOptions("nvfp4", False, None))
    with caplog.at_level(logging.INFO, logger="libkk"):
        packed, _ = loader.load_model(
            tiny_moe_dir, torch.float32, torch.device("cpu"), progress=False
        )
    layers = [m for m in packed.modules() if isinstance(m, QuantFusedMoE)]
    assert len(layers) == 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MoE ")]
    assert len(lines) == 2 and all("decode/verify rows: W4A16" in x for x in lines)
    prompts = [[5, 17, 3, 99, 42, 7], [200, 1]]
    want = PagedKV(ref).prefill_logits(prompts)
    got = PagedKV(packed).prefill_logits(prompts)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
