"""The DFlash drafter model (arXiv 2602.06036): its config, layers, checkpoint I/O and dense torch
references. The proposer that runs it is libkk/spec_decode/dflash.py.

The drafter shares the target's embedding and LM head. The target's hidden states after the
configured decoder layers (`target_layer_ids`, HF's `hidden_states[i + 1]`: the residual stream
after layer i) are concatenated, projected (`fc`, no bias) and RMS-normed into context features.
In every drafter layer the context rows contribute keys and values only: k/v projections of the
features, k-norm and RoPE at their positions, written once into the drafter's own paged KV cache.
A draft step runs the block [anchor, MASK x K] at positions p..p+K through the layers; each block
row attends to every context key and every block key (no causal mask), and the MASK row at p+j
predicts the token at p+j through the target's LM head.

Checkpoint layout (z-lab/dflash): `config.json` (Qwen3 fields plus `dflash_config` with
`target_layer_ids`, `mask_token_id`, `block_size`; the same keys at the top level are read too)
and `model.safetensors` with `fc.weight`, `hidden_norm.weight`, `norm.weight` and
`layers.N.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
mlp.{gate,up,down}_proj}.weight`. The embedding and LM head are not stored.

Under tensor parallelism the drafter is split like the target: `fc` is column-parallel with its
small output gathered (each rank reads 1/N of its rows; every output element is computed whole by
one rank, as the replicated projection computes it), attention heads and the MLP's intermediate
dimension are split with row-parallel o/down projections, and the embedding lookup and LM head go
through the target's vocab-parallel layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from libkk.errors import ConfigError, CorruptCheckpointError, ModelNotFoundError
from libkk.fsutil import read_json
from libkk.layers.linear import (
    WHOLE,
    ColumnParallelLinear,
    GateUpLinear,
    QKVLinear,
    RowParallelLinear,
    default_weight_loader,
)
from libkk.layers.linear import linear as linear_op
from libkk.layers.norm import RMSNorm
from libkk.layers.rotary import RopeConfig, RotaryEmbedding
from libkk.models.llama import STACKED_PARAMS
from libkk.models.sharded_read import ShardedReader, Slices
from libkk.quant.checkpoint import fp8_block_dequantize_stream
from libkk.quant.formats import quantize_fp8_block

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
# The drafter shipped for the default model (SmolLM2-135M-Instruct).
SHIPPED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-dflash"
SHIPPED_TARGET = "SmolLM2-135M-Instruct"

_QUANTIZED = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.")
_QUANTIZED += (".down_proj.",)


class DFlashConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The drafter's shape and its DFlash settings (a `config.json`, parsed)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int  # anchor + K masks: K = block_size - 1 drafts per forward
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    num_target_layers: int | None = None
    target_model: str | None = None  # informational: what it was trained for

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    @classmethod
    def from_json(cls, raw: dict[str, Any], source: str = CONFIG_FILE) -> DFlashConfig:
        """Reads a DFlash config.json; DFlash keys from `dflash_config` win over top-level ones."""
        if not isinstance(raw, dict):
            raise CorruptCheckpointError(f"{source}: expected a JSON object")
        arch = (raw.get("architectures") or [ARCHITECTURE])[0]
        if arch != ARCHITECTURE:
            raise CorruptCheckpointError(
                f"{source}: architectures[0] is {arch!r}, expected {ARCHITECTURE!r}"
            )
        dflash = raw.get("dflash_config") or {}

        def get(key: str, default: Any = None) -> Any:
            return dflash.get(key, raw.get(key, default))

        rope = raw.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", (raw.get("rope_scaling") or {}).get("rope_type"))
        if rope_type not in (None, "default"):
            raise CorruptCheckpointError(f"{source}: rope type {rope_type!r} is not supported")
        num_heads = raw.get("num_attention_heads")
        hidden = raw.get("hidden_size")
        values = {
            "hidden_size": hidden,
            "intermediate_size": raw.get("intermediate_size"),
            "num_layers": raw.get("num_hidden_layers"),
            "num_heads": num_heads,
            "num_kv_heads": raw.get("num_key_value_heads", num_heads),
            "head_dim": raw.get("head_dim")
            or (hidden // num_heads if isinstance(hidden, int) and num_heads else None),
            "vocab_size": raw.get("vocab_size"),
            "target_layer_ids": get("target_layer_ids"),
            "mask_token_id": get("mask_token_id"),
            "block_size": get("block_size", 16),
            "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
            "rope_theta": rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            "max_position_embeddings": raw.get("max_position_embeddings", 32768),
            "num_target_layers": get("num_target_layers"),
            "target_model": get("target_model"),
        }
        try:
            config = msgspec.convert(values, cls)
        except msgspec.ValidationError as e:
            raise CorruptCheckpointError(f"{source}: {e}") from None
        config.check(source)
        return config

    def check(self, source: str = CONFIG_FILE) -> None:
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        ids = list(self.target_layer_ids)
        if not ids or min(ids) < 0 or len(set(ids)) < len(ids):
            problems.append(f"target_layer_ids {ids} must be distinct layers >= 0, one or more")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} must be >= 2 (anchor + 1 mask)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary")
        if problems:
            raise CorruptCheckpointError(f"{source}: {'; '.join(problems)}")

    def to_json(self) -> dict[str, Any]:
        """The config.json of the checkpoint layout (Qwen3 fields + dflash_config)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
                "target_model": self.target_model,
            },
        }


# -- the model ------------------------------------------------------------------------------


def _rope(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """RoPE on one tensor [N, heads * head_dim] (the rotary module rotates q and k together)."""
    cos_sin = rotary.cos_sin_cache.index_select(0, positions).to(x.dtype)  # [N, head_dim]
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    return rotary._rotate(x, cos, sin)


# attend(layer index, q [N, H*D], k [N, KV*D], v [N, KV*D]) -> [N, H*D]: the block rows'
# attention over the context and the block (paged at inference, dense in training and tests).
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, False
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.rotary = [rotary]  # a list: shared, not a submodule of each layer

    def _norm_rope(self, x: torch.Tensor, norm: RMSNorm, heads: int, positions: torch.Tensor):
        n = x.shape[0]
        x = norm(x.reshape(n, heads, self.head_dim)).view(n, -1)
        return _rope(self.rotary[0], positions, x)

    def context_kv(
        self,
        features: torch.Tensor,  # [N, hidden]
        positions: torch.Tensor,  # [N]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [N, KV * D] each
        """Keys and values of context rows: no queries (the rows of the merged weight after q)."""
        q_size = self.qkv_proj.q_size
        kv = linear_op(features, self.qkv_proj.weight[q_size:])  # [N, 2 * KV * D]
        k, v = kv.split(self.qkv_proj.kv_size, dim=-1)
        return self._norm_rope(k, self.k_norm, self.num_kv_heads, positions), v

    def block_qkv(
        self,
        hidden: torch.Tensor,  # [N, hidden], after input_layernorm
        positions: torch.Tensor,  # [N]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(hidden)
        q = self._norm_rope(q, self.q_norm, self.num_heads, positions)
        k = self._norm_rope(k, self.k_norm, self.num_kv_heads, positions)
        return q, k, v


class DFlashMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [N, I] each
        return self.down_proj(F.silu(gate) * up)


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, rotary)
        self.mlp = DFlashMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DFlashDraftModel(nn.Module):
    """The drafter's own weights; the embedding and LM head are the target's (passed in)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            RopeConfig(theta=config.rope_theta),
        )
        self.fc = ColumnParallelLinear(
            len(config.target_layer_ids) * config.hidden_size,
            config.hidden_size,
            gather_output=True,
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            [DFlashLayer(config, self.rotary_emb) for _ in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[N, len(ids) * H] target hidden states -> [N, H] context features."""
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (k [N, KV*D], v [N, KV*D]) of context rows."""
        return [layer.self_attn.context_kv(features, positions) for layer in self.layers]

    def forward_block(
        self,
        embeds: torch.Tensor,  # [N, H]: embeddings of [anchor, MASK x K] of each block
        positions: torch.Tensor,  # [N]
        attend: AttendFn,
    ) -> torch.Tensor:  # [N, H], after the final norm
        hidden = embeds
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(hidden)
            q, k, v = layer.self_attn.block_qkv(x, positions)
            hidden = hidden + layer.self_attn.o_proj(attend(i, q, k, v))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    # -- weights ------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        seen: dict[str, set[Hashable]] = {}
        for ckpt_name, tensor in weights:
            name, shard = _param_name(ckpt_name.removeprefix("model."))
            if name not in params:
                raise CorruptCheckpointError(f"unexpected drafter tensor {ckpt_name!r}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, ckpt_name, shard)
            seen.setdefault(name, set()).add(shard)
        return {
            name
            for name, shards in seen.items()
            if None in shards or shards >= getattr(params[name], "shard_ids", WHOLE)
        }

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters under DFlash checkpoint names (q/k/v and gate/up split apart)."""
        out: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            t = param.detach()
            if ".qkv_proj." in name:
                attn = self.get_submodule(name.rsplit(".", 1)[0])
                parts = t.split([attn.q_size, attn.kv_size, attn.kv_size])
                for part, tag in zip(parts, "qkv", strict=True):
                    out[name.replace(".qkv_proj.", f".{tag}_proj.")] = part
            elif ".gate_up_proj." in name:
                gate, up = t.chunk(2)
                out[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
                out[name.replace(".gate_up_proj.", ".up_proj.")] = up
            else:
                out[name] = t
        return {k: v.contiguous() for k, v in out.items()}


def _param_name(name: str) -> tuple[str, Hashable]:
    for ckpt_part, param_part, shard in STACKED_PARAMS:
        if ckpt_part in name:
            return name.replace(ckpt_part, param_part), shard
    return name, None


def save_drafter(
    model: DFlashDraftModel, folder: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Writes config.json + model.safetensors (DFlash layout) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to("cpu", dtype) for k, v in model.checkpoint_tensors().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = model.config.to_json()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def read_drafter_config(folder: str | Path) -> DFlashConfig:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"DFlash drafter {str(folder)!r} has no {CONFIG_FILE}")
    raw = read_json(path)
    return DFlashConfig.from_json(raw, source=str(path))


def _fp8_quantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each projection (and fc) as e4m3 + 128x128 block scales, as an FP8 checkpoint holds it.

    NOTE: q/k/v and gate/up are quantized as separate checkpoint tensors, so when they are
    stacked into one merged weight each part is dequantized with its own scales.
    """
    for name, tensor in tensors:
        if (
            name.endswith(".weight")
            and tensor.dtype != torch.float8_e4m3fn
            and (name.removeprefix("model.") == "fc.weight" or any(p in name for p in _QUANTIZED))
        ):
            weight, scale = quantize_fp8_block(tensor.float())
            yield name, weight
            yield f"{name}_scale_inv", scale
        else:
            yield name, tensor


def load_drafter(
    folder: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
) -> DFlashDraftModel:
    """Builds a drafter from a DFlash checkpoint folder; `quantization="fp8_per_block"` gives
    the weights an FP8 per-block checkpoint would load. FP8 checkpoints load as they are."""
    if quantization not in (None, "fp8_per_block"):
        raise ConfigError(
            f"drafter quantization {quantization!r} is not supported (None or 'fp8_per_block')"
        )
    folder = Path(folder)
    config = read_drafter_config(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"DFlash drafter {str(folder)!r} has no {WEIGHTS_FILE}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DFlashDraftModel(config)
    finally:
        torch.set_default_dtype(previous)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = list(f.keys())
            # Each rank reads its rows of split weights; FP8 weights (stored, or quantized on
            # load) are read whole and cut after dequantizing, like the target's loader does.
            fp8 = quantization is not None or any(n.endswith("_scale_inv") for n in names)
            reader = ShardedReader(_drafter_slices(model), None, presplit=not fp8)
            tensors: Iterable[tuple[str, torch.Tensor]] = ((n, reader.read(f, n)) for n in names)
            if quantization == "fp8_per_block":
                tensors = _fp8_quantize_stream(tensors)
            tensors = reader.slice_rest(fp8_block_dequantize_stream(tensors, dtype))
            loaded = model.load_weights(tensors)
    except (SafetensorError, OSError) as e:
        raise CorruptCheckpointError(f"cannot read {str(path)!r}: {e}") from None
    missing = sorted({n for n, _ in model.named_parameters()} - loaded)
    if missing:
        raise CorruptCheckpointError(f"{str(path)!r} lacks drafter weights: {', '.join(missing)}")
    return model.eval()


def _drafter_slices(model: DFlashDraftModel) -> Callable[[str], Slices | None]:
    """Checkpoint name -> the ranges this tensor-parallel rank holds (None: all of it)."""
    params = dict(model.named_parameters())

    def slices_of(ckpt_name: str) -> Slices | None:
        name, shard = _param_name(ckpt_name.removeprefix("model."))
        tp_slices = getattr(params.get(name), "tp_slices", None)
        return None if tp_slices is None else tp_slices(shard)

    return slices_of


# -- dense reference attention (training, tests) -------------------------------------------------


def dense_block_attention(
    q: torch.Tensor,  # [Q, H * D]
    keys: torch.Tensor,  # [S, KV * D]
    values: torch.Tensor,  # [S, KV * D]
    visible: torch.Tensor,  # [Q, S] bool
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:  # [Q, H * D]
    n_q, n_s = q.shape[0], keys.shape[0]
    qh = q.view(n_q, num_heads, head_dim).transpose(0, 1)[None]  # [1, H, Q, D]
    kh = keys.view(n_s, num_kv_heads, head_dim).transpose(0, 1)[None].to(q.dtype)
    vh = values.view(n_s, num_kv_heads, head_dim).transpose(0, 1)[None].to(q.dtype)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=visible[None, None], scale=head_dim**-0.5, enable_gqa=True
    )  # [1, H, Q, D]
    return out[0].transpose(0, 1).reshape(n_q, num_heads * head_dim)


def dense_draft_hidden(
    model: DFlashDraftModel,
    target_hidden: torch.Tensor,  # [C, len(ids) * H]: the context of one request, positions 0..C-1
    block_embeds: torch.Tensor,  # [B, H]: [anchor, MASK x K] embedded
    anchor_position: int,
) -> torch.Tensor:  # [B, H]
    """The draft forward of one block without any cache: every row sees all context + block."""
    ctx_pos = torch.arange(target_hidden.shape[0], device=block_embeds.device)
    blk_pos = anchor_position + torch.arange(block_embeds.shape[0], device=block_embeds.device)
    ctx = model.context_kv(model.features(target_hidden), ctx_pos)
    n_keys = target_hidden.shape[0] + block_embeds.shape[0]
    visible = torch.ones(block_embeds.shape[0], n_keys, dtype=torch.bool, device=ctx_pos.device)
    cfg = model.config

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([ctx[i][0], k])
        values = torch.cat([ctx[i][1], v])
        return dense_block_attention(
            q, keys, values, visible, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        )

    return model.forward_block(block_embeds, blk_pos, attend)


# -- the proposer ---------------------------------------------------------------------------------


def find_embedding_module(target: nn.Module) -> nn.Module:
    """The target's input embedding layer."""
    for path in ("model.embed_tokens", "embed_tokens"):
        try:
            return target.get_submodule(path)
        except AttributeError:
            continue
    if hasattr(target, "get_input_embeddings"):
        return target.get_input_embeddings()
    raise ConfigError(f"target model {type(target).__name__} has no embed_tokens for DFlash")


def find_embedding(target: nn.Module) -> torch.Tensor:
    """The target's input embedding matrix [vocab, hidden] (this rank's rows under tensor
    parallelism)."""
    return find_embedding_module(target).weight


def num_target_layers(target: nn.Module) -> int | None:
    n = getattr(target, "num_layers", None)
    if isinstance(n, int):
        return n
    layers = getattr(getattr(target, "model", None), "layers", None)
    return len(layers) if layers is not None else None


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` layers spread evenly from layer 1 to num_target_layers - 3 (DFlash's choice);
    fewer on a target too shallow for `count` distinct layers there."""
    if count == 1:
        return (num_target_layers // 2,)
    start, end = 1, max(1, num_target_layers - 3)
    spread = (round(start + (end - start) * i / (count - 1)) for i in range(count))
    return tuple(dict.fromkeys(spread))  # distinct, in order
