"""Llama (and Qwen2, SmolLM2): the dense decoder the other families build on.

Flat batch: `forward(input_ids [T], positions [T]) -> hidden [T, hidden]` with every request's
tokens concatenated; attention finds each request's rows and KV blocks in the forward context.

Qwen2 is Llama with q/k/v biases; SmolLM2 is Llama with tied embeddings. Both differences come from
the ArchConfig, not from code. Parameter names mirror the HF module tree, except that q/k/v and
gate/up are stacked into `qkv_proj` and `gate_up_proj`; `load_weights` maps checkpoint names.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Hashable, Iterable

import torch
from torch import nn

from libkk.distributed import all_gather_last_dim, get_tp_size
from libkk.kernels.gemv import gate_up_silu
from libkk.layers.activation import SiluAndMul
from libkk.layers.attention import Attention, QKNormRope
from libkk.layers.embedding import LMHead, VocabEmbedding
from libkk.layers.linear import (
    WHOLE,
    GateUpLinear,
    QKVLinear,
    RowParallelLinear,
    Slices,
    default_weight_loader,
    takes_kernels,
)
from libkk.layers.norm import RMSNorm
from libkk.layers.rotary import RotaryEmbedding
from libkk.models.arch_config import ArchConfig

logger = logging.getLogger(__name__)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        w, bias = self.gate_up_proj.weight, self.gate_up_proj.bias
        if takes_kernels(x, w, bias):  # product and activation in one kernel
            act = gate_up_silu(x, w, bias)
        else:
            act = self.act_fn(self.gate_up_proj(x))  # [num_tokens, intermediate]
        return self.down_proj(act)


class LlamaAttention(nn.Module):
    def __init__(self, config: ArchConfig, rotary_emb: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
            bias=config.qkv_bias,
        )  # fmt: skip
        # This rank's heads (all of them at one rank).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias
        )
        self.rotary_emb = rotary_emb  # shared by all layers; one cos/sin table per model
        self.attn = Attention(
            self.num_heads,
            config.head_dim,
            self.num_kv_heads,
            scale=config.head_dim**-0.5,
            sliding_window=config.window_of(layer_idx),
            sinks=config.attention_sinks,
        )
        # A rotation of whole heads runs inside attention (with the KV store, one kernel on
        # CUDA); a partial one (Phi-4-mini) runs here.
        if rotary_emb.rotary_dim == config.head_dim:
            self.attn.qk_norm_rope = QKNormRope(None, None, rotary_emb)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        q, k, v = self.qkv_proj(hidden)  # [T, H * D], [T, KV * D], [T, KV * D]
        if self.attn.qk_norm_rope is None:
            q, k = self.rotary_emb(positions, q, k)
            out = self.attn(q, k, v)  # [T, H * D]
        else:
            out = self.attn(q, k, v, positions)  # (q/k norms,) RoPE, then attention
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. Carries the residual stream separately so each norm fuses the add."""

    def __init__(self, config: ArchConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden] (or the previous layer's top-k terms)
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None in the first layer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it). The output may carry an MoE
        layer's top-k terms ([num_tokens, top_k, hidden]): the next norm sums them."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return hidden, residual


class LlamaModel(nn.Module):
    def __init__(self, config: ArchConfig, layers: list[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Decoder layers whose output hidden states forward also stashes (speculative drafters
        # read them); see LlamaForCausalLM.set_aux_hidden_layers.
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i in self.aux_hidden_layers:
                # The layer's output is the residual stream: the norm input the next layer sees.
                terms = hidden.sum(dim=-2) if hidden.dim() > residual.dim() else hidden
                aux.append(terms + residual)  # [num_tokens, hidden]
        if aux:
            self.aux_hidden_states = torch.cat(aux, dim=-1)  # [num_tokens, len(ids) * hidden]
        if residual is None:  # a model with no layers
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# Checkpoint name fragment -> (parameter name fragment, shard id) for stacked parameters.
STACKED_PARAMS: tuple[tuple[str, str, Hashable], ...] = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


class LlamaForCausalLM(nn.Module):
    """The model interface every family implements.

    - `forward(input_ids, positions) -> hidden`, run under `set_forward_context(...)`;
    - `compute_logits(hidden [N, hidden]) -> [N, vocab] float32`;
    - `attention_layers()`: the `Attention` modules in layer order (the runner binds `kv_cache`);
    - `convert_checkpoint(tensors) -> tensors`: the checkpoint's tensors in the names and layouts
      libkk's streams and `load_weights` take (a family's own stacked layouts made per-expert);
    - `load_weights(weights) -> set[str]`: the parameter names that were fully loaded.
    """

    # Checkpoint name substrings renamed before matching (e.g. Mixtral's block_sparse_moe -> mlp).
    weight_renames: tuple[tuple[str, str], ...] = ()
    # Every op of the CUDA forward is a libkk kernel: torch.compile has nothing left to fuse, so
    # `torch_compile="auto"` leaves it off: compiled and eager measured equal in decode and eager
    # faster in prefill for the Llama-3-8B and Qwen3-8B shapes and gpt-oss-20b
    # (benchmarks/RESULTS.md, 2026-12-05 and 2026-12-07). A family whose forward adds torch ops
    # of its own sets it False until a benchmark shows otherwise.
    fused_on_cuda: bool = True
    # Per-expert checkpoint projection name -> (FusedMoE parameter, part); empty for dense models.
    expert_weights: dict[str, tuple[str, int]] = {}

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope
        )
        layers = [
            LlamaDecoderLayer(config, self.make_attention(config, i), self.make_mlp(config, i))
            for i in range(config.num_layers)
        ]
        self.model = LlamaModel(config, layers)
        tie = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tie_to=tie)

    # -- family hooks ---------------------------------------------------------------------

    def make_attention(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, self.rotary_emb, layer_idx)

    def make_mlp(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    # -- the model interface --------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them at one rank)."""
        layers = self.attention_layers()
        return layers[0].num_kv_heads if layers else self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        logits = self.lm_head(hidden)  # [N, vocab / tp] under tensor parallelism
        if get_tp_size() == 1:
            return logits
        # NOTE: every rank gathers the full vocabulary (every rank samples the same tokens).
        return all_gather_last_dim(logits)[:, : self.config.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N] int64
        """compute_logits(hidden).argmax(-1) without gathering whole rows across ranks."""
        return self.lm_head.argmax(hidden)

    def set_aux_hidden_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Makes forward also keep the hidden states after these decoder layers (0-based), in
        order, as `aux_hidden_states` [num_tokens, len(layer_ids) * hidden]; () turns it off."""
        bad = [i for i in layer_ids if not 0 <= i < self.config.num_layers]
        if bad:
            raise ValueError(f"aux hidden layers {bad} out of range [0, {self.config.num_layers})")
        # Stashed in layer order, so the ids must be given in that order.
        if list(layer_ids) != sorted(layer_ids):
            raise ValueError(f"aux hidden layers must be increasing, got {list(layer_ids)}")
        self.model.aux_hidden_layers = tuple(layer_ids)
        self.model.aux_hidden_states = None

    @property
    def aux_hidden_states(self) -> torch.Tensor | None:
        """[num_tokens, len(ids) * hidden] from the last forward, or None when off."""
        return self.model.aux_hidden_states if self.model.aux_hidden_layers else None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def convert_checkpoint(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return tensors

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (HF names) into the parameters; returns those fully loaded.

        Stacked parameters count as loaded once every shard arrived (q, k and v; gate and up; each
        expert's projections). Names that match no parameter are skipped with a debug log.
        """
        params = dict(self.named_parameters())
        shards_seen: dict[str, set[Hashable]] = defaultdict(set)
        for ckpt_name, tensor in weights:
            target = self._map_weight_name(ckpt_name)
            if target is None or target[0] not in params:
                logger.debug("ignoring checkpoint tensor %s", ckpt_name)
                continue
            name, shard_id = target
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, ckpt_name, shard_id)
            shards_seen[name].add(shard_id)
        return {
            name
            for name, seen in shards_seen.items()
            if None in seen or seen >= getattr(params[name], "shard_ids", WHOLE)
        }

    def weight_slices(self, ckpt_name: str) -> Slices | None:
        """Under tensor parallelism, the ranges of checkpoint tensor `ckpt_name` this rank reads;
        None: the whole tensor (replicated, skipped, or a single rank)."""
        target = self._map_weight_name(ckpt_name)
        if target is None:
            return None
        param = self._params_by_name().get(target[0])
        slices = getattr(param, "tp_slices", None)
        return None if slices is None else slices(target[1])

    def _params_by_name(self) -> dict[str, nn.Parameter]:
        if not hasattr(self, "_param_index"):
            self._param_index = dict(self.named_parameters())
        return self._param_index

    def _map_weight_name(self, name: str) -> tuple[str, Hashable] | None:
        """Checkpoint name -> (parameter name, shard id), or None to skip the tensor."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if self.config.tie_word_embeddings and name.startswith("lm_head."):
            return None  # tied: the embedding is the head (some checkpoints still store a copy)
        for old, new in self.weight_renames:
            name = name.replace(old, new)
        if self.expert_weights:
            if m := _PER_EXPERT.match(name):
                proj = self.expert_weights.get(m["proj"])
                if proj is None:
                    return None
                param, part = proj
                return f"{m['prefix']}.{param}", (int(m["expert"]), part)
            if m := _FUSED_EXPERTS.match(name):
                param = "w13_weight" if m["proj"] == "gate_up_proj" else "w2_weight"
                return f"{m['prefix']}.{param}", None
        for ckpt_part, param_part, shard_id in STACKED_PARAMS:
            if ckpt_part in name:
                return name.replace(ckpt_part, param_part), shard_id
        return name, None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases (set by its ArchConfig)."""
