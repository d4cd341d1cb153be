"""Qwen3: Llama with a per-head RMSNorm on q and k before RoPE (and no q/k/v bias by default)."""

from __future__ import annotations

import torch
from torch import nn

from libkk.kernels.norm import qk_norm_rope, qk_norm_rope_ref
from libkk.layers.norm import RMSNorm
from libkk.layers.rotary import RotaryEmbedding
from libkk.models.arch_config import ArchConfig
from libkk.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ArchConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, rotary_emb)
        # Normalizes each head's vector (over head_dim), shared across heads.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        q, k, v = self.qkv_proj(hidden)  # [T, H * D], [T, KV * D], [T, KV * D]
        # CUDA: one kernel for both norms and the rotation; CPU: its torch reference, which is
        # q_norm / k_norm then rotary_emb.
        norm_rope = qk_norm_rope if q.is_cuda else qk_norm_rope_ref
        q, k = norm_rope(
            q, k, self.q_norm.weight, self.k_norm.weight,
            self.rotary_emb.cos_sin_cache, positions, self.q_norm.eps,
        )  # fmt: skip
        out = self.attn(q, k, v)  # [T, H * D]
        return self.o_proj(out)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ArchConfig) -> nn.Module:
        return Qwen3Attention(config, self.rotary_emb)
