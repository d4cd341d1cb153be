"""Mixture of experts: router top-k, stacked expert weights and the plain-torch fused-MoE path.

Packed 4-bit experts (NVFP4/MXFP4 on CUDA, the fused W4A16 kernels) live in
libkk/layers/quant_moe.py; SparseMoeBlock builds them when the loader asks for them.

Expert weights are stacked the way the Triton fused-MoE kernels read them:
  w13 [num_experts, 2 * intermediate, hidden]  rows [gate (w1) | up (w3)] of each expert
  w2  [num_experts, hidden, intermediate]      the down projection
With expert biases (gpt-oss): w13_bias [num_experts, 2 * intermediate] (gate | up) and w2_bias
[num_experts, hidden], added after each projection, before the activation and before the routing
weight.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from libkk.distributed import all_reduce, get_tp_size
from libkk.kernels.moe import SILU, ExpertActivation, expert_activation_ref, moe_topk_routing
from libkk.layers.forward_context import get_forward_context
from libkk.layers.linear import (
    Linear,
    check_shape,
    default_weight_loader,
    new_param,
    shard_expert_weights,
    tp_split,
)
from libkk.layers.quant_moe import QuantFusedMoE, current_moe_options, expert_biases
from libkk.layers.registry import IndexedLayer


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights [num_tokens, top_k] fp32, ids [num_tokens, top_k] int64).

    Softmax over all experts in fp32, then top-k of the probabilities, then (optionally) divide by
    their sum. This is HF's exact op order for Qwen3-MoE (`norm_topk_prob`) and Mixtral (always
    renormalized, which equals a softmax over the top-k logits up to rounding).
    """
    if scoring != "softmax":
        raise ValueError(f"scoring {scoring!r} is not supported; supported: 'softmax'")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    activation: ExpertActivation = SILU,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Reference fused MoE: for each expert that received tokens, gather, run its MLP, scatter-add.

    NOTE: reads the per-expert token counts on the host, so it cannot be captured in a CUDA graph;
    the Triton kernel replaces it there. Experts are visited in ascending id order, so each token's
    contributions are summed in the same order as HF's loop (bit-identical in fp32).
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1)  # [num_tokens * top_k]
    order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
    token_of = order // top_k  # [num_tokens * top_k] token row of each sorted assignment
    weight_of = topk_weights.reshape(-1)[order]  # [num_tokens * top_k] fp32
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]  # [count]
        x = hidden.index_select(0, rows)  # [count, hidden]
        b13 = None if w13_bias is None else w13_bias[expert]
        b2 = None if w2_bias is None else w2_bias[expert]
        gate, up = F.linear(x, w13[expert], b13).chunk(2, dim=-1)  # [count, intermediate] each
        y = F.linear(expert_activation_ref(gate, up, activation), w2[expert], b2)  # [count, hidden]
        # NOTE: the routing weight multiplies in fp32 (as HF Mixtral does); cast back after.
        y = y * weight_of[start : start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


class FusedMoE(IndexedLayer):
    """The experts of one MoE layer as two stacked weights (gated MLPs, `activation` between).

    A compiled forward calls them through one opaque op (`libkk::experts`): traced, the routing
    counts read on the host would break the graph and compile it again for every routing.

    Loading: a per-expert checkpoint tensor uses shard id `(expert, 0)` (gate / w1, or the down
    projection for w2) or `(expert, 1)` (up / w3); an already-stacked tensor (transformers 5
    in-memory layout `experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) loads whole.
    Biases (`bias=True`) load the same way: w13_bias [E, 2I] by (expert, part), w2_bias [E, H].
    """

    layer_kind = "experts"

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: ExpertActivation = SILU,
        full_intermediate_size: int | None = None,
    ) -> None:
        """intermediate_size: this rank's part of every expert's intermediate dimension;
        full_intermediate_size: the whole (default: the same)."""
        super().__init__()
        full_intermediate_size = full_intermediate_size or intermediate_size
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        w13_shards = frozenset((e, j) for e in range(num_experts) for j in (0, 1))
        w2_shards = frozenset((e, 0) for e in range(num_experts))
        # [E, 2I, H] and [E, H, I]
        self.w13_weight = new_param(
            num_experts, 2 * intermediate_size, hidden_size, loader=self._load, shard_ids=w13_shards
        )
        self.w2_weight = new_param(
            num_experts, hidden_size, intermediate_size, loader=self._load, shard_ids=w2_shards
        )
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.w13_bias, self.w2_bias = expert_biases(
                num_experts, hidden_size, intermediate_size, full_intermediate_size
            )

    def _load(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: Hashable = None
    ) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded, name)
            return
        expert, part = shard_id  # type: ignore[misc]
        if param is self.w13_weight:
            # rows of gate (part 0) or up (part 1) within this expert's block
            size = self.intermediate_size
            target = param.data[expert].narrow(0, part * size, size)
        else:
            target = param.data[expert]
        check_shape(name, target.shape, loaded.shape)
        target.copy_(loaded)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if torch.compiler.is_compiling():
            return torch.ops.libkk.experts(hidden, topk_weights, topk_ids, self.layer_key)
        return self.run(hidden, topk_weights, topk_ids)

    def run(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe_ref(
            hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.w13_bias,
            self.w2_bias, self.activation,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, bias={self.w13_bias is not None}, "
            f"activation={self.activation.kind}"
        )


@torch.library.custom_op("libkk::experts", mutates_args=())
def _experts_op(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_key: int
) -> torch.Tensor:
    layer = get_forward_context().layers.get(FusedMoE.layer_kind, layer_key)
    return layer.run(hidden, topk_weights, topk_ids)


@_experts_op.register_fake
def _(hidden, topk_weights, topk_ids, layer_key):
    return torch.empty_like(hidden)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, a linear to expert logits, with a bias where `router_bias`) + top-k +
    experts (`expert_bias`, `activation`: see FusedMoE).

    Parameter names (`gate.weight`, `experts.w13_weight`, `experts.w2_weight`) follow the HF
    module layout, so checkpoint names map onto them by suffix.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: ExpertActivation = SILU,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=router_bias)
        # Tensor parallelism: each rank holds its slice of every expert's intermediate dim and
        # the partial outputs are summed (all-reduce in forward).
        part = tp_split(intermediate_size, "moe_intermediate_size")
        opts = current_moe_options()
        self.experts: nn.Module
        if opts.weight_format is not None:  # packed 4-bit experts, fused kernels (CUDA)
            self.experts = QuantFusedMoE(
                num_experts, hidden_size, len(part), opts.weight_format, opts,
                full_intermediate_size=intermediate_size, bias=expert_bias, activation=activation,
            )  # fmt: skip
        else:
            self.experts = FusedMoE(
                num_experts, hidden_size, len(part), expert_bias, activation, intermediate_size
            )
        shard_expert_weights(self.experts.w13_weight, self.experts.w2_weight, intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden], or on the fused 4-bit kernels without tensor parallelism
        [num_tokens, top_k, hidden]: each routed expert's output, summed by the residual add and
        norm that follow (RMSNorm with a residual takes such terms), which spares the sum a
        kernel per layer."""
        router_logits = self.gate(hidden)  # [num_tokens, num_experts]
        if isinstance(self.experts, QuantFusedMoE) and hidden.is_cuda:
            # no host sync: the whole packed path can be captured in a CUDA graph
            weights, ids = moe_topk_routing(router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if get_tp_size() > 1:
            return all_reduce(self.experts(hidden, weights, ids))
        if isinstance(self.experts, QuantFusedMoE) and self.experts.leaves_topk_sum():
            return self.experts.routed_outputs(hidden, weights, ids)
        return self.experts(hidden, weights, ids)
