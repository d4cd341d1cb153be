"""Qwen3: Llama with a per-head RMSNorm on q and k before RoPE (and no q/k/v bias by default)."""

from __future__ import annotations

from torch import nn

from libkk.layers.attention import QKNormRope
from libkk.layers.norm import RMSNorm
from libkk.layers.rotary import RotaryEmbedding
from libkk.models.arch_config import ArchConfig
from libkk.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ArchConfig, rotary_emb: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__(config, rotary_emb, layer_idx)
        # Normalizes each head's vector (over head_dim), shared across heads.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        # The norms and the rotation run inside attention (fused with the KV store on CUDA).
        self.attn.qk_norm_rope = QKNormRope(self.q_norm, self.k_norm, rotary_emb)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        return Qwen3Attention(config, self.rotary_emb, layer_idx)
