"""Mixtral: Llama attention; every layer's MLP is a sparse MoE with renormalized top-k weights.

Checkpoint names: hub checkpoints (and transformers 5's save_pretrained) keep the original
`block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{e}.w{1,2,3}.weight` (w1 gate,
w3 up, w2 down); transformers 5's in-memory layout is `mlp.experts.gate_up_proj` / `down_proj`.
Both load into `mlp.experts.w13_weight` / `w2_weight`.
"""

from __future__ import annotations

from collections.abc import Hashable

from torch import nn

from libkk.layers.moe import SparseMoeBlock
from libkk.layers.quant_moe import map_expert_part_name
from libkk.models.arch_config import ArchConfig
from libkk.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    fused_on_cuda = False  # the router's torch ops; compiled against eager not yet measured
    weight_renames = ((".block_sparse_moe.", ".mlp."),)
    expert_weights = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", 0)}

    def make_mlp(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=True,
        )

    def _map_weight_name(self, name: str) -> tuple[str, Hashable] | None:
        # The parts of a 4-bit expert weight (scales, global and input scales) load by expert.
        for old, new in self.weight_renames:
            name = name.replace(old, new)
        return map_expert_part_name(name, self.expert_weights) or super()._map_weight_name(name)
