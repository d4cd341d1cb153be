"""GGUF architectures -> Hugging Face config.json and tensor names.

llama.cpp's `convert_hf_to_gguf.py` exports the families libkk runs as:

- `llama`: Llama (SmolLM2, Llama 2/3) and Mixtral (a `llama` with `expert_count` > 0 and
  `ffn_{gate,up,down}_exps` expert tensors stacked on a leading expert axis; older exports keep one
  `ffn_{gate,up,down}.{e}` tensor per expert). Only these get their q/k rows permuted for
  llama.cpp's interleaved RoPE, which is undone here.
- `qwen2`: Qwen2 / Qwen2.5 (q/k/v biases), no permutation.
- `qwen3`: Qwen3 (per-head `attn_q_norm` / `attn_k_norm`), no permutation.
- `qwen3moe`: Qwen3-MoE (`ffn_gate_inp` router + stacked experts), no permutation; llama.cpp
  always renormalizes the top-k routing weights, so `norm_topk_prob` is true.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from libkk.errors import CorruptCheckpointError, UnsupportedModelError
from libkk.models.gguf.metadata import Metadata


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps onto a Hugging Face model class."""

    architecture: str  # config.json `architectures[0]`
    model_type: str
    permute_qk: bool  # llama.cpp permuted q/k rows (llama-style interleaved RoPE)
    qkv_bias: bool  # q/k/v projections carry biases
    qk_norm: bool  # per-head RMSNorm on q and k
    moe: bool


_LLAMA = Family("LlamaForCausalLM", "llama", True, False, False, False)
_MIXTRAL = Family("MixtralForCausalLM", "mixtral", True, False, False, True)
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", False, True, False, False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", False, False, True, False),
    "qwen3moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", False, False, True, True),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: where it comes from and what shape it must have."""

    hf_name: str
    source: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]  # HF layout, [out, in] for matrices
    unpermute_heads: int  # > 0: undo llama.cpp's q/k row permutation with this many heads
    expert: int = -1  # >= 0: this expert's slice of a stacked [experts, out, in] tensor


def resolve_family(meta: Metadata) -> tuple[str, Family]:
    arch = meta.require("general.architecture")
    family = FAMILIES.get(arch)
    if family is None:
        raise UnsupportedModelError(
            f"GGUF {str(meta.path)!r} has architecture {arch!r} (general.architecture); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if family is _LLAMA and meta.int("llama.expert_count", 0) > 0:
        family = _MIXTRAL
    return arch, family


def _rope_scaling(meta: Metadata, p: str) -> dict[str, Any] | None:
    kind = meta.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.get(p + "rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor is not None:
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if (original := meta.get(p + "rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := meta.get(f"{p}rope.scaling.{key}")) is not None:
                scaling[name] = float(value)
        return scaling
    raise UnsupportedModelError(
        f"GGUF rope scaling {kind!r} ({p}rope.scaling.type, factor {factor!r}) is not supported; "
        "supported: none, linear, yarn"
    )


def _llama3_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """llama.cpp's `rope_freqs` (per-frequency divisors) for Llama-3 rope scaling, as its
    convert_hf_to_gguf.py computes them."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _llama3_from_rope_freqs(
    factors: np.ndarray, theta: float, head_dim: int, path: Path
) -> dict[str, Any] | None:
    """Llama-3 rope scaling parameters that reproduce llama.cpp's `rope_freqs` tensor.

    The divisors depend on (low, high, original) only through the wavelengths original / high
    and original / low, so `original_max_position_embeddings` is fixed at 8192 (Llama 3.1's) and
    the two factors are fitted; the result is checked against the tensor.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    refuse = UnsupportedModelError(
        f"GGUF {str(path)!r}: rope_freqs.weight {factors[:6].tolist()}... does not follow "
        "Llama-3 rope scaling; other per-frequency rope factors are not supported"
    )
    if factors.shape != wavelen.shape or not np.isfinite(factors).all():
        raise refuse
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    original = 8192.0
    ones = np.flatnonzero(np.isclose(factors, 1.0, rtol=1e-5))
    full = np.flatnonzero(np.isclose(factors, factor, rtol=1e-5))
    mid = np.flatnonzero(~np.isclose(factors, 1.0, rtol=1e-5) & ~np.isclose(factors, factor))
    if not len(ones) or not len(full):
        raise refuse
    # smooth = original / (high - low) / wavelen - low / (high - low) on the middle band.
    smooth = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    if len(mid) >= 2:
        slope, offset = np.polyfit(1.0 / wavelen[mid], smooth, 1)
    else:
        # The band's edge (smooth = 1) between the last undivided and the next wavelength; with
        # one middle wavelength the line goes through it, with none it drops to 0 before the
        # first fully divided one.
        edge = np.sqrt(wavelen[ones[-1]] * wavelen[ones[-1] + 1])
        x0, y0 = 1.0 / edge, 1.0
        x1 = 1.0 / wavelen[mid[0]] if len(mid) else 1.0 / np.sqrt(edge * wavelen[full[0]])
        y1 = smooth[0] if len(mid) else 0.0
        slope = (y0 - y1) / (x0 - x1)
        offset = y0 - slope * x0
    if slope <= 0 or offset >= 0:
        raise refuse
    width = original / slope  # high - low
    low = -offset * width
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + width),
        "original_max_position_embeddings": int(original),
    }
    got = _llama3_factors(theta, head_dim, factor, low, low + width, original)
    if not np.allclose(got, factors, rtol=1e-4, atol=1e-6):
        raise refuse
    return params


def build_config(meta: Metadata, reader: Any, arch: str, family: Family) -> dict[str, Any]:
    """config.json for `family` from the `{arch}.*` metadata and the tensor shapes."""
    p = arch + "."
    hidden = meta.int(p + "embedding_length")
    heads = meta.int(p + "attention.head_count")
    kv_heads = meta.int(p + "attention.head_count_kv", heads)
    head_dim = meta.int(p + "attention.key_length", hidden // heads)
    value_dim = meta.int(p + "attention.value_length", head_dim)
    rope_dim = meta.int(p + "rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise UnsupportedModelError(
            f"GGUF head sizes key={head_dim} value={value_dim} rope={rope_dim} differ; "
            "only equal key/value/rope head sizes are supported"
        )
    if heads % kv_heads:
        raise CorruptCheckpointError(
            f"GGUF {p}attention.head_count={heads} is not a multiple of head_count_kv={kv_heads}"
        )
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise CorruptCheckpointError("GGUF lacks the tensor 'token_embd.weight'")
    layers = meta.int(p + "block_count")
    max_position = meta.int(p + "context_length")
    theta = float(meta.get(p + "rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(meta, p)
    if (freqs := tensors.get("rope_freqs.weight")) is not None:
        if rope_scaling is not None or family.model_type != "llama":
            raise UnsupportedModelError(
                f"GGUF {str(meta.path)!r}: rope_freqs.weight is supported only for Llama-3 rope "
                "scaling of the llama architecture"
            )
        rope_scaling = _llama3_from_rope_freqs(np.asarray(freqs.data), theta, head_dim, meta.path)
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.require(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": max_position,
        "vocab_size": int(embed.shape[-1]),  # GGUF dims are [hidden, vocab]
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if family.model_type == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    elif family.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        config |= {"use_sliding_window": False, "sliding_window": None}
        if family.model_type != "qwen2":
            config["attention_bias"] = False
    if not family.moe:
        config["intermediate_size"] = meta.int(p + "feed_forward_length")
        return config

    experts = meta.int(p + "expert_count", 0)
    if experts <= 0:
        raise CorruptCheckpointError(f"GGUF {arch} lacks {p}expert_count")
    moe_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    dense_layers = [i for i in range(layers) if i not in moe_layers]
    moe_inter = meta.get(p + "expert_feed_forward_length")
    if moe_inter is None:  # from the stacked or per-expert gate shape: GGUF dims [hidden, inter]
        first = moe_layers[0] if moe_layers else 0
        gate = tensors.get(f"blk.{first}.ffn_gate_exps.weight")
        gate = gate or tensors.get(f"blk.{first}.ffn_gate.0.weight")
        moe_inter = meta.int(p + "feed_forward_length") if gate is None else int(gate.shape[1])
    moe_inter = int(moe_inter)
    used = meta.int(p + "expert_used_count")
    if family.model_type == "mixtral":
        if dense_layers:
            raise UnsupportedModelError(
                f"GGUF Mixtral-style llama with dense layers {dense_layers[:8]} is not supported"
            )
        return config | {
            "intermediate_size": moe_inter,
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "sliding_window": None,
        }
    return config | {
        "intermediate_size": meta.int(p + "feed_forward_length", moe_inter),
        "moe_intermediate_size": moe_inter,
        "num_experts": experts,
        "num_experts_per_tok": used,
        "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense_layers,
    }


_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# GGUF per-layer name -> HF name under `model.layers.{i}.`, in checkpoint order.
_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_EXPERT_PROJ = ("gate", "up", "down")
_PER_EXPERT_RE = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")
# HF expert names: Qwen3-MoE's gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2.
_HF_EXPERT = {
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def _layer_shapes(
    config: dict[str, Any], family: Family, moe_layer: bool
) -> dict[str, tuple[int, ...]]:
    """GGUF per-layer name -> expected HF shape, for the tensors this layer must have."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (hidden,),
        "attn_q.weight": (q_dim, hidden),
        "attn_k.weight": (kv_dim, hidden),
        "attn_v.weight": (kv_dim, hidden),
        "attn_output.weight": (hidden, q_dim),
        "ffn_norm.weight": (hidden,),
    }
    if family.qkv_bias:
        shapes |= {"attn_q.bias": (q_dim,), "attn_k.bias": (kv_dim,), "attn_v.bias": (kv_dim,)}
    if family.qk_norm:
        shapes |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    if moe_layer:
        experts = config.get("num_experts", config.get("num_local_experts"))
        inter = config.get("moe_intermediate_size", config["intermediate_size"])
        shapes["ffn_gate_inp.weight"] = (experts, hidden)
        shapes["ffn_gate_exps.weight"] = (experts, inter, hidden)
        shapes["ffn_up_exps.weight"] = (experts, inter, hidden)
        shapes["ffn_down_exps.weight"] = (experts, hidden, inter)
    else:
        inter = config["intermediate_size"]
        shapes |= {
            "ffn_gate.weight": (inter, hidden),
            "ffn_up.weight": (inter, hidden),
            "ffn_down.weight": (hidden, inter),
        }
    return shapes


def tensor_plan(
    reader: Any, config: dict[str, Any], family: Family, path: Path
) -> list[TensorPlan]:
    """Map every GGUF tensor to its HF name(s) and expected HF shape; refuse unknown tensors."""
    layers, vocab, hidden = config["num_hidden_layers"], config["vocab_size"], config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dense_only = set(config.get("mlp_only_layers", ()))
    expected_global = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    shapes_by_layer = [
        _layer_shapes(config, family, family.moe and i not in dense_only) for i in range(layers)
    ]
    moe_parent, moe_names = _HF_EXPERT.get(family.model_type, ("mlp", {}))
    plan: list[tuple[tuple[int, ...], TensorPlan]] = []
    unknown: list[str] = []
    seen: set[str] = set()

    def check(tensor: Any, shape: tuple[int, ...]) -> None:
        # The reader's numpy shape is the GGUF dims reversed, i.e. HF's [out, in].
        got = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if got != shape:
            raise CorruptCheckpointError(
                f"GGUF {str(path)!r}: tensor {tensor.name!r} has shape {list(got)}, expected "
                f"{list(shape)} from the model's metadata"
            )

    for tensor in reader.tensors:
        name = tensor.name
        if name == "rope_freqs.weight" and (config["rope_scaling"] or {}).get("rope_type") in (
            "llama3",
            None,
        ):
            continue  # folded into config.json's rope_scaling (build_config)
        if name in _GLOBAL:
            check(tensor, expected_global[name])
            order = (-1, 0) if name == "token_embd.weight" else (layers, 0 if "norm" in name else 1)
            plan.append((order, TensorPlan(_GLOBAL[name], tensor, expected_global[name], 0)))
            seen.add(name)
            continue
        m = _LAYER_RE.fullmatch(name)
        if m is None or int(m.group(1)) >= layers:
            unknown.append(name)
            continue
        layer, kind = int(m.group(1)), m.group(2)
        prefix = f"model.layers.{layer}."
        shapes = shapes_by_layer[layer]
        per_expert = _PER_EXPERT_RE.fullmatch(kind) if family.moe else None
        if per_expert and "ffn_gate_inp.weight" in shapes:
            # Older llama.cpp exports: one tensor per expert.
            proj, expert = per_expert.group(1), int(per_expert.group(2))
            stacked = shapes[f"ffn_{proj}_exps.weight"]
            if expert >= stacked[0]:
                unknown.append(name)
                continue
            check(tensor, stacked[1:])
            hf = f"{prefix}{moe_parent}.experts.{expert}.{moe_names[proj]}.weight"
            order = (layer, 100 + expert * 3 + _EXPERT_PROJ.index(proj))
            plan.append((order, TensorPlan(hf, tensor, stacked[1:], 0)))
            seen.add(f"blk.{layer}.ffn_{proj}_exps.weight")
            continue
        if kind not in shapes:
            unknown.append(name)
            continue
        check(tensor, shapes[kind])
        seen.add(name)
        if kind in _ATTENTION:
            unpermute = 0
            if family.permute_qk:  # q with num_attention_heads, k with num_key_value_heads
                unpermute = {"attn_q.weight": heads, "attn_k.weight": kv_heads}.get(kind, 0)
            order = (layer, list(_ATTENTION).index(kind))
            hf = prefix + _ATTENTION[kind]
            plan.append((order, TensorPlan(hf, tensor, shapes[kind], unpermute)))
        elif kind in _DENSE:
            order = (layer, 50 + list(_DENSE).index(kind))
            plan.append((order, TensorPlan(prefix + _DENSE[kind], tensor, shapes[kind], 0)))
        elif kind == "ffn_gate_inp.weight":
            hf = f"{prefix}{moe_parent}.gate.weight"
            plan.append(((layer, 99), TensorPlan(hf, tensor, shapes[kind], 0)))
        else:  # ffn_{gate,up,down}_exps: one HF tensor per expert
            proj = kind.split("_")[1]
            for e in range(shapes[kind][0]):
                hf = f"{prefix}{moe_parent}.experts.{e}.{moe_names[proj]}.weight"
                order = (layer, 100 + e * 3 + _EXPERT_PROJ.index(proj))
                plan.append((order, TensorPlan(hf, tensor, shapes[kind][1:], 0, expert=e)))
    if unknown:
        raise UnsupportedModelError(
            f"GGUF {str(path)!r} has tensors libkk's {family.architecture} converter does not "
            f"know: {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}"
        )
    required = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{kind}" for i in range(layers) for kind in shapes_by_layer[i]
    }
    missing = sorted(required - seen)
    if missing:
        raise CorruptCheckpointError(
            f"GGUF {str(path)!r} lacks {len(missing)} tensors, e.g. {', '.join(missing[:4])}"
        )
    return [item for _, item in sorted(plan, key=lambda pair: pair[0])]


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved-pair RoPE -> HF's half-split RoPE).

    llama.cpp writes `w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)`; this is the
    inverse: GGUF row `h * head_dim + 2 * i + j` goes back to HF row
    `h * head_dim + j * head_dim // 2 + i`.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise CorruptCheckpointError(
            f"q/k weight with {rows} rows cannot be split into {n_head} heads of even size"
        )
    w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))
