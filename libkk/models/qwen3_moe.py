"""Qwen3-MoE: Qwen3 attention; the MLP of each layer in `moe_layers` is a sparse MoE.

Routing: softmax over all experts, top-k, renormalized only when `norm_topk_prob`. Layers outside
`moe_layers` (`mlp_only_layers`, `decoder_sparse_step`) keep a dense MLP of `intermediate_size`.

Checkpoint expert names: `mlp.experts.{e}.{gate,up,down}_proj.weight` (hub checkpoints and what
transformers 5 saves) or the stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`
(transformers 5's in-memory layout); both load into `experts.w13_weight` / `experts.w2_weight`.
"""

from __future__ import annotations

from collections.abc import Hashable

from torch import nn

from libkk.layers.moe import SparseMoeBlock
from libkk.layers.quant_moe import map_expert_part_name
from libkk.models.arch_config import ArchConfig
from libkk.models.llama import LlamaMLP
from libkk.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    fused_on_cuda = False  # the router's torch ops; compiled against eager not yet measured

    expert_weights = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                      "down_proj": ("w2_weight", 0)}  # fmt: skip

    def make_mlp(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        if layer_idx not in config.moe_layers:
            return LlamaMLP(config.hidden_size, config.intermediate_size)
        return SparseMoeBlock(
            config.hidden_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
        )

    def _map_weight_name(self, name: str) -> tuple[str, Hashable] | None:
        # The parts of a 4-bit expert weight (scales, global and input scales) load by expert.
        for old, new in self.weight_renames:
            name = name.replace(old, new)
        return map_expert_part_name(name, self.expert_weights) or super()._map_weight_name(name)
