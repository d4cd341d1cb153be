"""gpt-oss (GptOssForCausalLM): OpenAI's open-weight MoE, after transformers' modeling_gpt_oss.py.

- attention with biases on q/k/v/o and a learned sink logit per head in every softmax
  (`Attention(sinks=True)`); sliding-window (128) and full layers alternating (`layer_types`);
  YaRN RoPE over the rotate-half layout;
- every MLP is an MoE: a router linear with a bias, top-k over its logits and a softmax over those
  k (the renormalized top-k of the full softmax); experts with biases and the clamped SwiGLU
  (gate clamped above at `swiglu_limit`, up to +-limit, gate * sigmoid(alpha * gate) * (up + 1));
- plain RMSNorm, untied head.

Checkpoint experts are stacked per layer, in one of two layouts, converted by `convert_checkpoint`
into libkk's per-expert tensors (`experts.<e>.<gate_proj|up_proj|down_proj>.<part>`):
- transformers' float layout: `experts.gate_up_proj` [E, H, 2I] (x @ W: input rows), gate and up
  interleaved along the last dim (gate = even columns), `down_proj` [E, I, H], biases
  `gate_up_proj_bias` [E, 2I] (interleaved alike) and `down_proj_bias` [E, H];
- the released MXFP4 layout (quantization_config `mxfp4`): `gate_up_proj_blocks` uint8
  [E, 2I, H/32, 16] (output rows, gate and up rows interleaved; 32 E2M1 codes per 16 bytes, the
  even element in the low nibble, which is libkk's packing), `gate_up_proj_scales` uint8
  [E, 2I, H/32] (E8M0), and `down_proj_blocks` / `down_proj_scales` likewise. These become the
  parts of per-expert MXFP4 weights: kept packed for the W4A16 kernels on CUDA, with no
  dequantize round trip; dequantized by the loader's stream elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Iterator

import torch
from torch import nn

from libkk.distributed import get_tp_size
from libkk.errors import CorruptCheckpointError, UnsupportedModelError
from libkk.kernels.moe import ExpertActivation
from libkk.layers.moe import SparseMoeBlock
from libkk.layers.quant_moe import map_expert_part_name
from libkk.models.arch_config import ArchConfig
from libkk.models.llama import LlamaForCausalLM

_STACKED = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<part>_blocks|_scales|_bias)?$"
)
_EXPERT_BIAS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.bias$")
_MXFP4_BLOCK_BYTES = 16  # 32 E2M1 codes


class GptOssForCausalLM(LlamaForCausalLM):
    weight_renames = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"))
    expert_weights = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                      "down_proj": ("w2_weight", 0)}  # fmt: skip

    def __init__(self, config: ArchConfig) -> None:
        if get_tp_size() > 1:
            raise UnsupportedModelError(
                "gpt-oss runs at tensor_parallel_size 1 only (its stacked experts are not split "
                "across ranks)"
            )
        super().__init__(config)

    def make_mlp(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        assert config.swiglu_limit is not None
        return SparseMoeBlock(
            config.hidden_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=True,
            router_bias=True,
            expert_bias=True,
            activation=ExpertActivation(
                "clamped_swiglu", alpha=config.swiglu_alpha, limit=config.swiglu_limit
            ),
        )

    def convert_checkpoint(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stacked expert tensors as per-expert ones; everything else as it is."""
        for name, tensor in tensors:
            m = _STACKED.match(name)
            if m is None:
                yield name, tensor
                continue
            convert = _CONVERSIONS[(m["proj"], m["part"] or "")]
            for e in range(tensor.shape[0]):
                for proj, part, value in convert(name, tensor[e]):
                    yield f"{m['experts']}.{e}.{proj}.{part}", value.contiguous()

    def _map_weight_name(self, name: str) -> tuple[str, Hashable] | None:
        for old, new in self.weight_renames:
            name = name.replace(old, new)
        if (m := _EXPERT_BIAS.match(name)) and m["proj"] in self.expert_weights:
            param, part = self.expert_weights[m["proj"]]
            return f"{m['prefix']}.{param.replace('_weight', '_bias')}", (int(m["expert"]), part)
        # The parts of a 4-bit expert weight (its scales) load by expert.
        return map_expert_part_name(name, self.expert_weights) or super()._map_weight_name(name)


def _float_gate_up(name: str, w: torch.Tensor):  # [H, 2I], x @ w; gate = even columns
    _check_dims(name, w, 2)
    return [("gate_proj", "weight", w[:, 0::2].t()), ("up_proj", "weight", w[:, 1::2].t())]


def _float_down(name: str, w: torch.Tensor):  # [I, H], x @ w
    _check_dims(name, w, 2)
    return [("down_proj", "weight", w.t())]


def _gate_up_bias(name: str, b: torch.Tensor):  # [2I] interleaved
    _check_dims(name, b, 1)
    return [("gate_proj", "bias", b[0::2]), ("up_proj", "bias", b[1::2])]


def _down_bias(name: str, b: torch.Tensor):  # [H]
    _check_dims(name, b, 1)
    return [("down_proj", "bias", b)]


def _blocks(name: str, blocks: torch.Tensor) -> torch.Tensor:
    """[N, K/32, 16] packed bytes -> [N, K/2], the per-expert packed weight's layout."""
    _check_dims(name, blocks, 3)
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != _MXFP4_BLOCK_BYTES:
        raise CorruptCheckpointError(
            f"tensor {name!r}: MXFP4 blocks must be uint8 [E, rows, K/32, 16], got "
            f"{blocks.dtype} [E, {', '.join(map(str, blocks.shape))}]"
        )
    return blocks.reshape(blocks.shape[0], -1)


def _gate_up_blocks(name: str, blocks: torch.Tensor):  # [2I, H/32, 16], gate = even rows
    w = _blocks(name, blocks)
    return [("gate_proj", "weight", w[0::2]), ("up_proj", "weight", w[1::2])]


def _down_blocks(name: str, blocks: torch.Tensor):  # [H, I/32, 16]
    return [("down_proj", "weight", _blocks(name, blocks))]


def _gate_up_scales(name: str, s: torch.Tensor):  # [2I, H/32]
    _check_dims(name, s, 2)
    return [("gate_proj", "weight_scale", s[0::2]), ("up_proj", "weight_scale", s[1::2])]


def _down_scales(name: str, s: torch.Tensor):  # [H, I/32]
    _check_dims(name, s, 2)
    return [("down_proj", "weight_scale", s)]


def _check_dims(name: str, per_expert: torch.Tensor, dims: int) -> None:
    if per_expert.dim() != dims:
        raise CorruptCheckpointError(
            f"tensor {name!r} has {per_expert.dim() + 1} dims, expected {dims + 1} (experts first)"
        )


# (projection, suffix) of a stacked checkpoint tensor -> its per-expert parts
_CONVERSIONS = {
    ("gate_up_proj", ""): _float_gate_up,
    ("down_proj", ""): _float_down,
    ("gate_up_proj", "_bias"): _gate_up_bias,
    ("down_proj", "_bias"): _down_bias,
    ("gate_up_proj", "_blocks"): _gate_up_blocks,
    ("down_proj", "_blocks"): _down_blocks,
    ("gate_up_proj", "_scales"): _gate_up_scales,
    ("down_proj", "_scales"): _down_scales,
}
