"""Gemma 3 text (Gemma3ForCausalLM) and the text tower of Gemma3ForConditionalGeneration.

The arithmetic of transformers' modeling_gemma3.py:

- embeddings times sqrt(hidden_size), the factor rounded to the embedding dtype;
- four norms a layer (input, post-attention, pre- and post-feedforward), each `GemmaRMSNorm`
  (x / rms(x) * (1 + weight) in fp32), and a residual add after each sublayer's post-norm;
- per-head q/k norms (GemmaRMSNorm over head_dim) before RoPE;
- sliding-window layers and full layers interleaved (`ArchConfig.layer_types`), each kind with its
  own RoPE table (`local_rope` for the sliding ones, `rope` with its scaling for the full ones);
- attention scaled by query_pre_attn_scalar ** -0.5;
- a GELU-tanh gated MLP;
- logits soft-capped as cap * tanh(logits / cap) when final_logit_softcapping is set;
- the head tied to the embedding (unless the config says otherwise).

Multimodal checkpoints keep the text tower under `language_model.model.` (older layout) or
`model.language_model.` (transformers 5); both map onto `model.`, and the vision tower and
projector are skipped, so only text prompts run.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from libkk.layers.activation import GeluTanhAndMul
from libkk.layers.attention import Attention
from libkk.layers.embedding import LMHead, VocabEmbedding
from libkk.layers.gemma_norm import GemmaRMSNorm
from libkk.layers.linear import GateUpLinear, QKVLinear, RowParallelLinear
from libkk.layers.rotary import RotaryEmbedding
from libkk.models.arch_config import ArchConfig
from libkk.models.llama import LlamaForCausalLM

SLIDING = "sliding_attention"

# Checkpoint name prefixes of a multimodal checkpoint's text tower -> libkk's.
_TEXT_TOWER_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size, False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3Attention(nn.Module):
    def __init__(
        self, config: ArchConfig, rotary_emb: RotaryEmbedding, sliding_window: int | None
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
            bias=config.qkv_bias,
        )  # fmt: skip
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias
        )
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # shared by the layers of one kind
        scale = config.attention_scale
        self.attn = Attention(
            self.num_heads,
            config.head_dim,
            self.num_kv_heads,
            scale=config.head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        q, k, v = self.qkv_proj(hidden)  # [T, H * D], [T, KV * D], [T, KV * D]
        n, d = hidden.shape[0], self.head_dim
        q = self.q_norm(q.view(n, -1, d)).view(n, -1)
        k = self.k_norm(k.view(n, -1, d)).view(n, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich block: each sublayer between a pre- and a post-norm, then the residual add."""

    def __init__(self, config: ArchConfig, self_attn: Gemma3Attention, mlp: Gemma3MLP) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]: the residual stream
    ) -> torch.Tensor:  # [num_tokens, hidden]
        attn = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, config: ArchConfig, layers: list[Gemma3DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # Created in the model's dtype (the default dtype while the model is built), as
        # transformers' buffer is: sqrt(3072) = 55.4256 is 55.5 in bfloat16.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_hidden_layers: tuple[int, ...] = ()  # see LlamaForCausalLM.set_aux_hidden_layers
        self.aux_hidden_states: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden)
            if i in self.aux_hidden_layers:
                aux.append(hidden)
        if aux:
            self.aux_hidden_states = torch.cat(aux, dim=-1)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3: LlamaForCausalLM's model interface and weight mapping (q/k/v and gate/up stacked)
    over Gemma's own module tree."""

    fused_on_cuda = False  # its (1 + w) q/k norms and rotation are torch ops; not yet measured

    def __init__(self, config: ArchConfig) -> None:
        # NOTE: LlamaForCausalLM.__init__ builds Llama's tree; this builds Gemma's instead and
        # inherits only the methods.
        nn.Module.__init__(self)
        self.config = config
        types = config.layer_types or (SLIDING,) * config.num_layers
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope
        )
        self.rotary_emb_local = self.rotary_emb
        if SLIDING in types and config.local_rope is not None:
            self.rotary_emb_local = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.local_rope
            )
        layers = []
        for kind in types:
            sliding = kind == SLIDING
            attn = Gemma3Attention(
                config,
                self.rotary_emb_local if sliding else self.rotary_emb,
                config.sliding_window if sliding else None,
            )
            mlp = Gemma3MLP(config.hidden_size, config.intermediate_size)
            layers.append(Gemma3DecoderLayer(config, attn, mlp))
        self.model = Gemma3Model(config, layers)
        tie = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tie_to=tie)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N] int64
        if self.config.final_logit_softcapping is None:
            return super().greedy_tokens(hidden)
        # The argmax of the capped logits (capping can round distinct large logits together).
        return self.compute_logits(hidden).argmax(dim=-1)

    def _map_weight_name(self, name: str) -> tuple[str, Hashable] | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for old, new in _TEXT_TOWER_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        return super()._map_weight_name(name)
