"""Packed 4-bit experts with biases and the clamped SwiGLU (gpt-oss) against the dense layer.

QuantFusedMoE loads per-expert bias parts (`experts.<e>.<proj>.bias`) next to the packed weights
and runs them on the torch path and on the fused kernels (Triton's interpreter on CPU); FusedMoE
holds the dequantized weights and the same biases. Same arithmetic, so the outputs agree to
summation order.
"""

from __future__ import annotations

import pytest
import torch
from libkk.kernels._jit import INTERPRETED
from libkk.kernels.moe import SILU, ExpertActivation
from test_quant_moe_layer import EXPERT_WEIGHTS, _checkpoint, _load

import libkk.layers.quant_moe as quant_moe
from libkk.errors import CorruptCheckpointError
from libkk.layers.moe import FusedMoE, SparseMoeBlock, select_experts
from libkk.layers.quant_moe import (
    MoeOptions,
    QuantFusedMoE,
    map_expert_part_name,
    moe_options,
)
from libkk.quant.checkpoint import dequantize_stream, quant_config, quantize_tensor

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not INTERPRETED,
    reason="CPU interpreter test (test_interpreter_process.py reruns it); GPU: tests/gpu",
)
TIGHT = ExpertActivation("clamped_swiglu", alpha=1.702, limit=0.3)
PROJS = ("gate_proj", "up_proj", "down_proj")


def test_map_expert_part_name_maps_bias_parts():
    m = map_expert_part_name
    assert m("l.0.mlp.experts.3.gate_proj.bias", EXPERT_WEIGHTS) == (
        "l.0.mlp.experts.w13_bias", (3, 0))  # fmt: skip
    assert m("l.0.mlp.experts.3.up_proj.bias", EXPERT_WEIGHTS) == (
        "l.0.mlp.experts.w13_bias", (3, 1))  # fmt: skip
    assert m("l.0.mlp.experts.12.down_proj.bias", EXPERT_WEIGHTS) == (
        "l.0.mlp.experts.w2_bias", (12, 0))  # fmt: skip
    assert m("l.0.mlp.gate_proj.bias", EXPERT_WEIGHTS) is None


def _bias_parts(e: int, hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = {"gate_proj": inter, "up_proj": inter, "down_proj": hidden}
    return {
        f"m.experts.{x}.{proj}.bias": torch.randn(sizes[proj], generator=g) * 0.3
        for x in range(e)
        for proj in PROJS
    }


def _layers(fmt: str, act: ExpertActivation, e: int = 4, hidden: int = 64, inter: int = 32):
    """(packed layer, dense layer, bias parts) loaded from one checkpoint's parts."""
    algo = fmt.split("-")[0]
    parts: dict[str, torch.Tensor] = {}
    for name, w in _checkpoint(e, hidden, inter, seed=1).items():
        parts.update(quantize_tensor(name, w, fmt))
    biases = _bias_parts(e, hidden, inter, seed=3)
    parts.update(biases)
    packed = QuantFusedMoE(e, hidden, inter, algo, MoeOptions(algo, False, "fp8"), bias=True,
                           activation=act)  # fmt: skip
    seen = _load(packed, parts.items())
    assert {"m.experts.w13_bias", "m.experts.w2_bias"} <= seen
    dense = FusedMoE(e, hidden, inter, bias=True, activation=act)
    _load(dense, dequantize_stream(parts.items(), quant_config(fmt), torch.float32))
    return packed, dense, biases


def test_bias_parts_load_by_expert_and_part():
    packed, dense, biases = _layers("mxfp4", TIGHT)
    inter = packed.intermediate_size
    for x in range(packed.num_experts):
        assert torch.equal(packed.w13_bias[x, :inter], biases[f"m.experts.{x}.gate_proj.bias"])
        assert torch.equal(packed.w13_bias[x, inter:], biases[f"m.experts.{x}.up_proj.bias"])
        assert torch.equal(packed.w2_bias[x], biases[f"m.experts.{x}.down_proj.bias"])
    assert torch.equal(packed.w13_bias, dense.w13_bias)
    assert torch.equal(packed.w2_bias, dense.w2_bias)
    assert packed.w13_bias.dtype == torch.get_default_dtype()
    assert "bias=True, activation=clamped_swiglu" in repr(packed)


def test_bias_loading_stacked_bad_and_off_rank(monkeypatch):
    e, hidden, inter = 2, 64, 32
    packed = QuantFusedMoE(e, hidden, inter, "nvfp4", bias=True)
    stacked = torch.randn(e, 2 * inter)
    packed.w13_bias.weight_loader(packed.w13_bias, stacked, "experts.gate_up_proj_bias", None)
    assert torch.equal(packed.w13_bias, stacked)
    with pytest.raises(CorruptCheckpointError, match="shape"):
        p = packed.w13_bias
        p.weight_loader(p, torch.zeros(2 * inter), "experts.0.gate_proj.bias", (0, 0))
    with pytest.raises(CorruptCheckpointError, match="expected floats"):
        p = packed.w2_bias
        p.weight_loader(p, torch.zeros(hidden, dtype=torch.uint8), "experts.0.down_proj.bias",
                        (0, 0))  # fmt: skip
    # Tensor parallelism: the ranks' partial outputs are summed, so only rank 0 adds the down
    # projection's bias (the gate/up biases are this rank's rows: each rank adds its own).
    monkeypatch.setattr(quant_moe, "get_tp_rank", lambda: 1)
    p = packed.w2_bias
    p.weight_loader(p, torch.ones(hidden), "experts.1.down_proj.bias", (1, 0))
    assert not packed.w2_bias[1].any()
    p = packed.w13_bias
    p.weight_loader(p, torch.ones(inter), "experts.1.up_proj.bias", (1, 1))
    assert bool((packed.w13_bias[1, inter:] == 1).all())


@pytest.mark.parametrize("act", [SILU, TIGHT], ids=["silu", "clamped-swiglu"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4-csf"])
def test_packed_layer_with_biases_equals_dense_layer(fmt, act):
    """The torch path (before the layer settles its kernels) and the fused kernels both give the
    dense layer's output; the routed terms sum to it; FP8 prefill is refused with the reason."""
    packed, dense, _ = _layers(fmt, act)
    t, top_k = 9, 2
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, packed.hidden_size, generator=g)
    weights, ids = select_experts(torch.randn(t, packed.num_experts, generator=g), top_k, True)
    want = dense(x, weights, ids)
    tol = dict(rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert not packed.fused_kernels
    torch.testing.assert_close(packed(x, weights, ids), want, **tol)
    packed.settle_row_kernels()
    assert packed.fused_kernels and packed.leaves_topk_sum()
    torch.testing.assert_close(packed(x, weights, ids), want, **tol)
    routed = packed.routed_outputs(x, weights, ids)
    assert routed.shape == (t, top_k, packed.hidden_size)
    torch.testing.assert_close(routed.sum(dim=1), want, **tol)
    # the biases take part: without them the output is another
    no_bias = FusedMoE(packed.num_experts, packed.hidden_size, packed.intermediate_size,
                       activation=act)  # fmt: skip
    no_bias.w13_weight.data.copy_(dense.w13_weight)
    no_bias.w2_weight.data.copy_(dense.w2_weight)
    assert (no_bias(x, weights, ids) - want).abs().max() > 0.1 * want.abs().max()
    assert "W4A8 kernels run neither expert biases" in (packed.prefill_fp8_blocker() or "")
    assert "W4A8 kernels run neither expert biases" in packed.describe()


def test_fp8_prefill_refused_for_the_activation_alone():
    packed = QuantFusedMoE(2, 64, 32, "nvfp4", MoeOptions("nvfp4", False, "fp8"),
                           activation=TIGHT)  # fmt: skip
    assert "activation=clamped_swiglu" in (packed.prefill_fp8_blocker() or "")
    plain = QuantFusedMoE(2, 64, 32, "nvfp4", MoeOptions("nvfp4", False, "fp8"))
    assert "no calibrated input scales" in (plain.prefill_fp8_blocker() or "")


def test_sparse_block_builds_packed_experts_with_biases():
    with moe_options(MoeOptions("mxfp4")):
        block = SparseMoeBlock(64, 4, 2, 32, True, router_bias=True, expert_bias=True,
                               activation=TIGHT)  # fmt: skip
    experts = block.experts
    assert isinstance(experts, QuantFusedMoE) and experts.activation == TIGHT
    assert experts.w13_bias.shape == (4, 64) and experts.w2_bias.shape == (4, 64)


def test_gate_up_bias_reads_this_ranks_rows_under_tensor_parallelism(monkeypatch):
    import libkk.layers.linear as linear

    monkeypatch.setattr(quant_moe, "get_tp_size", lambda: 2)
    monkeypatch.setattr(linear, "get_tp_size", lambda: 2)
    monkeypatch.setattr(linear, "get_tp_rank", lambda: 1)
    packed = QuantFusedMoE(2, 64, 32, "mxfp4", full_intermediate_size=64, bias=True)
    slices = packed.w13_bias.tp_slices
    assert slices((0, 1)) == [(0, 32, 64)]  # a per-expert part [I]
    assert slices(None) == [(1, 32, 64), (1, 96, 128)]  # stacked [E, 2I]: gate rows, up rows
    assert not hasattr(packed.w2_bias, "tp_slices")  # [H] whole on every rank
