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
- Mistral is written as `llama` (q/k permuted like Llama's). A `llama.attention.sliding_window`
  key, where an export carries one, makes it a MistralForCausalLM with that window.
- `phi3`: Phi-3 / Phi-4. q/k/v fused in `attn_qkv` (or split `attn_q/k/v`, stacked here), gate and
  up fused in `ffn_up` (gate rows first), both exactly HF's `qkv_proj` / `gate_up_proj`.
  `rope.dimension_count` < head size is partial rotary; LongRoPE factors are the
  `rope_factors_long/short.weight` tensors (with `rope.scaling.original_context_length` and
  `rope.scaling.attn_factor`); `attention.sliding_window` 0 means none (Phi-4).
- `gemma3`: Gemma 3 text. llama.cpp stores every RMSNorm weight plus one (Gemma's norm scales by
  1 + w); the one is taken off again. The sliding layers' pattern and RoPE base are not always in
  the file: llama.cpp fixes them at every 6th layer full and base 10000, as here when absent, and
  derives the attention scale from the layer count (the 27B's 62 layers: hidden / heads, else
  head size), as here unless `attention.scale` is written. The embedding scale sqrt(hidden) is
  the model's own.
- `gpt-oss`: q/k/v/o with biases, `attn_sinks`, a biased router (`ffn_gate_inp`), experts stacked
  as `ffn_{gate,up,down}_exps` (or `ffn_gate_up_exps`, gate rows first) with biases, often in
  MXFP4. They are written in transformers' float layout (`experts.gate_up_proj` [E, H, 2I] with
  gate/up interleaved, `down_proj` [E, I, H] and their biases), unless all of them are MXFP4:
  then the weights are written packed instead (`mxfp4.py`), the biases as here. Sliding and full
  layers alternate (llama.cpp: pattern 2); the clamped SwiGLU's limit 7.0 and alpha 1.702 are
  fixed in llama.cpp and not stored; YaRN is written without `truncate`, which every gpt-oss
  checkpoint sets false.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
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
_MISTRAL = Family("MistralForCausalLM", "mistral", True, False, False, False)
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", False, True, False, False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", False, False, True, False),
    "qwen3moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", False, False, True, True),
    "phi3": Family("Phi3ForCausalLM", "phi3", False, False, False, False),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", False, False, True, False),
    "gpt-oss": Family("GptOssForCausalLM", "gpt_oss", False, True, False, True),
}
# Families whose tensors map through `_layer_pieces` (fused, stacked or shifted tensors).
_PIECE_FAMILIES = frozenset({"phi3", "gemma3_text", "gpt_oss"})
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: where it comes from and what shape it must have."""

    hf_name: str
    source: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]  # HF layout, [out, in] for matrices
    unpermute_heads: int  # > 0: undo llama.cpp's q/k row permutation with this many heads
    expert: int = -1  # >= 0: this expert's slice of a stacked [experts, out, in] tensor
    more: tuple[Any, ...] = ()  # further sources, combined with `source` by `build`
    source_shapes: tuple[tuple[int, ...], ...] = ()  # HF-layout shape of each source
    # Makes the HF tensor from the sources' dequantized values; None: `source` as it is.
    build: Callable[[list[np.ndarray]], np.ndarray] | None = None
    dtype: str = "F32"  # safetensors dtype written
    # Makes the tensor from `source`'s raw GGUF bytes instead (packed MXFP4 experts, mxfp4.py).
    raw: Callable[[np.ndarray], np.ndarray] | None = None


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
    elif family is _LLAMA and _window(meta, "llama.") is not None:
        family = _MISTRAL
    return arch, family


def _window(meta: Metadata, p: str) -> int | None:
    """`attention.sliding_window`; absent or 0 (Phi-4 writes 0) means none."""
    window = meta.int(p + "attention.sliding_window", 0)
    return window if window > 0 else None


def _layer_types(meta: Metadata, p: str, layers: int, default_pattern: int) -> list[str]:
    """Per-layer attention kinds from `attention.sliding_window_pattern`, as llama.cpp reads it:
    an integer n makes every n-th layer full and the rest sliding (0: all sliding, 1: none), an
    array says per layer whether it slides."""
    pattern = meta.get(p + "attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CorruptCheckpointError(
                f"GGUF {str(meta.path)!r}: {p}attention.sliding_window_pattern has "
                f"{len(pattern)} entries for {layers} layers"
            )
        slides = [bool(x) for x in pattern]
    else:
        n = int(pattern)
        slides = [n == 0 or (n > 1 and (i + 1) % n != 0) for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _rope_scaling(meta: Metadata, p: str) -> dict[str, Any] | None:
    kind = meta.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.get(p + "rope.scaling.factor")
    if kind == "longrope":  # Phi-3: the factors are tensors (build_config)
        return {"rope_type": "longrope"}
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
        "supported: none, linear, yarn, longrope (phi3)"
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
    partial = family.model_type == "phi3" and 0 < rope_dim <= head_dim and rope_dim % 2 == 0
    if value_dim != head_dim or (rope_dim != head_dim and not partial):
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
    if (rope_scaling or {}).get("rope_type") == "longrope" and family.model_type != "phi3":
        raise UnsupportedModelError(
            f"GGUF {str(meta.path)!r}: LongRoPE scaling is supported for phi3 only"
        )
    if meta.get(p + "attention.temperature_scale"):
        raise UnsupportedModelError(
            f"GGUF {str(meta.path)!r}: {p}attention.temperature_scale (Llama-4-style attention "
            "temperature) is not supported"
        )
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
        # Written even when absent: some config classes (Phi-3's) default to an id past the
        # vocabulary.
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if family.model_type in ("llama", "mistral"):
        config |= {"attention_bias": False, "mlp_bias": False}
        if family.model_type == "mistral":
            config["sliding_window"] = _window(meta, p)
    elif family.model_type == "phi3":
        return _phi3_config(meta, p, config, tensors, rope_dim)
    elif family.model_type == "gemma3_text":
        return _gemma3_config(meta, p, config)
    elif family.model_type == "gpt_oss":
        return _gpt_oss_config(meta, p, config)
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


def _factors(tensor: Any) -> list[float]:
    from gguf.quants import dequantize

    # The shortest decimal of each float32 is the value config.json had (1.3, not 1.2999999523).
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).ravel()
    return [float(str(x)) for x in values]


def _phi3_config(
    meta: Metadata, p: str, config: dict[str, Any], tensors: dict[str, Any], rope_dim: int
) -> dict[str, Any]:
    head_dim, max_position = config["head_dim"], config["max_position_embeddings"]
    original = int(meta.get(p + "rope.scaling.original_context_length", max_position))
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    partial = rope_dim / head_dim
    scaling = config["rope_scaling"]
    if (long is None) != (short is None):
        raise CorruptCheckpointError(
            f"GGUF {str(meta.path)!r} has only one of rope_factors_long/rope_factors_short"
        )
    if long is not None:
        if scaling not in (None, {"rope_type": "longrope"}):
            raise UnsupportedModelError(
                f"GGUF {str(meta.path)!r}: LongRoPE factors with rope scaling {scaling!r}"
            )
        scaling = {"rope_type": "longrope", "long_factor": _factors(long),
                   "short_factor": _factors(short), "partial_rotary_factor": partial}  # fmt: skip
        for name in ("long_factor", "short_factor"):
            if len(scaling[name]) != rope_dim // 2:
                raise CorruptCheckpointError(
                    f"GGUF {str(meta.path)!r}: rope_factors_{name[:-7]} has "
                    f"{len(scaling[name])} values, expected rope dims / 2 = {rope_dim // 2}"
                )
        # HF's default attention factor; llama.cpp writes the same one unless the model set its own.
        scale = max_position / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        attn = meta.get(p + "rope.scaling.attn_factor")
        if attn is not None and not math.isclose(float(attn), default, rel_tol=1e-5):
            scaling["attention_factor"] = float(attn)
    elif scaling is not None:
        raise CorruptCheckpointError(
            f"GGUF {str(meta.path)!r}: rope scaling {scaling!r} without rope_factors tensors"
        )
    return config | {
        "intermediate_size": meta.int(p + "feed_forward_length"),
        "rope_scaling": scaling,
        "partial_rotary_factor": partial,
        "original_max_position_embeddings": original,
        "sliding_window": _window(meta, p),
        "attention_bias": False,
    }


def _gemma3_config(meta: Metadata, p: str, config: dict[str, Any]) -> dict[str, Any]:
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    window = _window(meta, p)
    if window is None:
        layer_types = ["full_attention"] * layers
    else:
        layer_types = _layer_types(meta, p, layers, 6)
    scale = meta.get(p + "attention.scale")
    if scale:
        scalar = float(scale) ** -2
    else:
        scalar = hidden // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    embed_scale = meta.get(p + "embedding_scale")
    if embed_scale is not None and not math.isclose(
        float(embed_scale), math.sqrt(hidden), rel_tol=1e-4
    ):
        raise UnsupportedModelError(
            f"GGUF {str(meta.path)!r}: {p}embedding_scale {embed_scale} is not sqrt(hidden); "
            "only Gemma's own embedding scale is supported"
        )
    cap = meta.get(p + "final_logit_softcapping")
    return config | {
        "intermediate_size": meta.int(p + "feed_forward_length"),
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_local_base_freq": float(meta.get(p + "rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": float(cap) if cap else None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


def _gpt_oss_config(meta: Metadata, p: str, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    window = _window(meta, p)
    if window is None:
        layer_types = ["full_attention"] * layers
    else:
        layer_types = _layer_types(meta, p, layers, 2)
    scaling = config["rope_scaling"]
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling = scaling | {"truncate": False}
    experts = meta.int(p + "expert_count")
    if experts <= 0:
        raise CorruptCheckpointError(f"GGUF {str(meta.path)!r} lacks {p}expert_count")
    inter = meta.int(p + "expert_feed_forward_length", meta.int(p + "feed_forward_length"))
    return config | {
        "intermediate_size": inter,
        "num_local_experts": experts,
        "num_experts_per_tok": meta.int(p + "expert_used_count"),
        "rope_scaling": scaling,
        "sliding_window": window,
        "layer_types": layer_types,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
    }


# --- families whose tensors are fused, stacked or shifted on export --------------------------


@dataclass(frozen=True)
class _Source:
    kind: str  # per-layer GGUF name, e.g. "attn_q.weight"
    shape: tuple[int, ...]  # its HF-layout shape


@dataclass(frozen=True)
class _Piece:
    """One HF tensor of a layer, built from GGUF tensors (`build` None: the one source as is)."""

    hf: str
    shape: tuple[int, ...]
    sources: tuple[_Source, ...]
    build: Callable[[list[np.ndarray]], np.ndarray] | None = None


def _minus_one(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] - np.float32(1.0)


def _rows(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts, axis=0)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[E, I, ...] gate and up -> [E, 2I, ...] with gate at even and up at odd rows."""
    return np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, *gate.shape[2:])


def _halves(fused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    half = fused.shape[1] // 2
    return fused[:, :half], fused[:, half:]


def _gate_up_weight(parts: list[np.ndarray]) -> np.ndarray:  # -> [E, H, 2I]
    gate, up = parts if len(parts) == 2 else _halves(parts[0])
    return _interleave(gate, up).transpose(0, 2, 1)


def _gate_up_bias(parts: list[np.ndarray]) -> np.ndarray:  # -> [E, 2I]
    gate, up = parts if len(parts) == 2 else _halves(parts[0])
    return _interleave(gate, up)


def _swap_last(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0].transpose(0, 2, 1)


def _one(hf: str, kind: str, shape: tuple[int, ...], build: Any = None) -> list[_Piece]:
    return [_Piece(hf, shape, (_Source(kind, shape),), build)]


def _layer_pieces(config: dict[str, Any], family: Family) -> list[list[_Piece]]:
    """Per layer: each HF tensor's ways of being built (the first whose sources all exist)."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    kind = family.model_type
    shift = _minus_one if kind == "gemma3_text" else None
    out: list[list[_Piece]] = [
        _one("input_layernorm.weight", "attn_norm.weight", (hidden,), shift),
        _one("self_attn.o_proj.weight", "attn_output.weight", (hidden, q_dim)),
    ]
    if kind == "phi3":
        qkv = (q_dim + 2 * kv_dim, hidden)
        split = (_Source("attn_q.weight", (q_dim, hidden)),
                 _Source("attn_k.weight", (kv_dim, hidden)),
                 _Source("attn_v.weight", (kv_dim, hidden)))  # fmt: skip
        out += [
            [
                _Piece("self_attn.qkv_proj.weight", qkv, (_Source("attn_qkv.weight", qkv),)),
                _Piece("self_attn.qkv_proj.weight", qkv, split, _rows),
            ],  # fmt: skip
            _one("post_attention_layernorm.weight", "ffn_norm.weight", (hidden,)),
            _one("mlp.gate_up_proj.weight", "ffn_up.weight", (2 * inter, hidden)),
            _one("mlp.down_proj.weight", "ffn_down.weight", (hidden, inter)),
        ]
        return out
    for proj, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
        out.append(_one(f"self_attn.{proj}_proj.weight", f"attn_{proj}.weight", (dim, hidden)))
    if kind == "gemma3_text":
        out += [
            _one("self_attn.q_norm.weight", "attn_q_norm.weight", (head_dim,), shift),
            _one("self_attn.k_norm.weight", "attn_k_norm.weight", (head_dim,), shift),
            _one("post_attention_layernorm.weight", "post_attention_norm.weight", (hidden,), shift),
            _one("pre_feedforward_layernorm.weight", "ffn_norm.weight", (hidden,), shift),
            _one("post_feedforward_layernorm.weight", "post_ffw_norm.weight", (hidden,), shift),
            _one("mlp.gate_proj.weight", "ffn_gate.weight", (inter, hidden)),
            _one("mlp.up_proj.weight", "ffn_up.weight", (inter, hidden)),
            _one("mlp.down_proj.weight", "ffn_down.weight", (hidden, inter)),
        ]
        return out
    # gpt-oss
    experts = config["num_local_experts"]
    for proj, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim), ("output", hidden)):
        hf = f"self_attn.{'o' if proj == 'output' else proj}_proj.bias"
        out.append(_one(hf, f"attn_{proj}.bias", (dim,)))
    e_in, e_2i = (experts, inter, hidden), (experts, 2 * inter, hidden)
    out += [
        _one("self_attn.sinks", "attn_sinks.weight", (config["num_attention_heads"],)),
        _one("post_attention_layernorm.weight", "post_attention_norm.weight", (hidden,)),
        _one("mlp.router.weight", "ffn_gate_inp.weight", (experts, hidden)),
        _one("mlp.router.bias", "ffn_gate_inp.bias", (experts,)),
        [_Piece("mlp.experts.gate_up_proj", (experts, hidden, 2 * inter),
                (_Source("ffn_gate_exps.weight", e_in), _Source("ffn_up_exps.weight", e_in)),
                _gate_up_weight),
         _Piece("mlp.experts.gate_up_proj", (experts, hidden, 2 * inter),
                (_Source("ffn_gate_up_exps.weight", e_2i),), _gate_up_weight)],
        [_Piece("mlp.experts.gate_up_proj_bias", (experts, 2 * inter),
                (_Source("ffn_gate_exps.bias", (experts, inter)),
                 _Source("ffn_up_exps.bias", (experts, inter))), _gate_up_bias),
         _Piece("mlp.experts.gate_up_proj_bias", (experts, 2 * inter),
                (_Source("ffn_gate_up_exps.bias", (experts, 2 * inter)),), _gate_up_bias)],
        [_Piece("mlp.experts.down_proj", (experts, inter, hidden),
                (_Source("ffn_down_exps.weight", (experts, hidden, inter)),), _swap_last)],
        _one("mlp.experts.down_proj_bias", "ffn_down_exps.bias", (experts, hidden)),
    ]  # fmt: skip
    return out


def _piece_plan(
    reader: Any, config: dict[str, Any], family: Family, path: Path
) -> list[TensorPlan]:
    layers, vocab, hidden = config["num_hidden_layers"], config["vocab_size"], config["hidden_size"]
    shift = _minus_one if family.model_type == "gemma3_text" else None
    tensors = {t.name: t for t in reader.tensors}
    # Folded into config.json (build_config).
    consumed = {"rope_factors_long.weight", "rope_factors_short.weight"}
    consumed &= set(tensors) if family.model_type == "phi3" else set()
    missing: list[str] = []
    plan: list[TensorPlan] = []

    def add(hf: str, piece: _Piece, names: list[str]) -> None:
        sources = [tensors[n] for n in names]
        for tensor, src in zip(sources, piece.sources, strict=True):
            _check_shape(tensor, src.shape, path)
        consumed.update(names)
        plan.append(
            TensorPlan(hf, sources[0], piece.shape, 0, more=tuple(sources[1:]),
                       source_shapes=tuple(s.shape for s in piece.sources), build=piece.build)
        )  # fmt: skip

    globals_ = [
        ("model.embed_tokens.weight", "token_embd.weight", (vocab, hidden), None),
        ("model.norm.weight", "output_norm.weight", (hidden,), shift),
        ("lm_head.weight", "output.weight", (vocab, hidden), None),
    ]
    for hf, name, shape, build in globals_[:2]:
        if name not in tensors:
            missing.append(name)
            continue
        add(hf, _one(hf, name, shape, build)[0], [name])
    per_layer = _layer_pieces(config, family)
    for i in range(layers):
        for ways in per_layer:
            names = None
            for piece in ways:
                candidate = [f"blk.{i}.{src.kind}" for src in piece.sources]
                if all(n in tensors for n in candidate):
                    names = candidate
                    break
            if names is None:
                missing.append(f"blk.{i}.{ways[0].sources[0].kind}")
                continue
            add(f"model.layers.{i}.{piece.hf}", piece, names)
    hf, name, shape, _ = globals_[2]
    if name in tensors:
        add(hf, _one(hf, name, shape)[0], [name])
    if missing:
        raise CorruptCheckpointError(
            f"GGUF {str(path)!r} lacks {len(missing)} tensors, e.g. {', '.join(missing[:4])}"
        )
    unknown = [name for name in tensors if name not in consumed]
    if unknown:
        raise UnsupportedModelError(
            f"GGUF {str(path)!r} has tensors libkk's {family.architecture} converter does not "
            f"know: {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}"
        )
    return plan


def _check_shape(tensor: Any, shape: tuple[int, ...], path: Path) -> None:
    # The reader's numpy shape is the GGUF dims reversed, i.e. HF's [out, in].
    got = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if got != shape:
        raise CorruptCheckpointError(
            f"GGUF {str(path)!r}: tensor {tensor.name!r} has shape {list(got)}, expected "
            f"{list(shape)} from the model's metadata"
        )


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
    if family.model_type in _PIECE_FAMILIES:
        return _piece_plan(reader, config, family, path)
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
        _check_shape(tensor, shape, path)

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
