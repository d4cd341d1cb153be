"""Writes a transformers model as a GGUF the way llama.cpp's convert_hf_to_gguf.py lays it out,
in a chosen quantization type, and returns the weights a faithful importer must give back."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

# Byte offsets of the float16 scale fields in one block of the types gguf-py can dequantize but
# not quantize. Dequantized values are linear in these fields, so random blocks with the fields
# set to a chosen value give weights of a chosen size.
F16_SCALE_OFFSETS: dict[Q, tuple[int, ...]] = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}


# The types gguf.quants.quantize writes.
QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
QUANTIZABLE += (Q.TQ1_0, Q.TQ2_0, Q.MXFP4)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator, std: float = 0.1) -> np.ndarray:
    """`w` in `qtype`'s GGUF bytes (or as float for F32/F16). Types gguf-py cannot quantize get
    random blocks scaled to about `std` instead of `w` (the content does not matter, only that
    the importer dequantizes what was written)."""
    if qtype in F16_SCALE_OFFSETS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        shape = (*w.shape[:-1], w.shape[-1] // block, size)
        raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
        flat = raw.reshape(*w.shape[:-1], -1)  # a view: setting fields in `raw` changes it

        def set_scale(value: float) -> None:
            field = np.frombuffer(np.float16(value).tobytes(), np.uint8)
            for offset in F16_SCALE_OFFSETS[qtype]:
                raw[..., offset : offset + 2] = field

        set_scale(1.0)
        set_scale(std / max(float(np.nanstd(dequantize(flat, qtype))), 1e-6))
        return flat
    if qtype in QUANTIZABLE:
        return quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]  # e.g. IQ1_M: random bytes, any values
    return rng.integers(0, 256, size=(*w.shape[:-1], w.shape[-1] // block * size), dtype=np.uint8)


def llama_cpp_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `rope_freqs` for Llama-3 rope scaling."""
    base, factor = rope["rope_theta"], rope["factor"]
    low_freq_factor, high_freq_factor = rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def block_size(qtype: Q) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


# transformers model_type -> llama.cpp architecture (Mistral is written as llama).
_ARCH_KEYS = {"mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe",
              "gemma3_text": "gemma3", "gpt_oss": "gpt-oss"}  # fmt: skip
# HF parameter (under model.layers.{i}.) -> llama.cpp tensor, where names differ by family.
_FAMILY_NAMES: dict[str, dict[str, str]] = {
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gemma3_text": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
    "gpt_oss": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
        "self_attn.o_proj.bias": "attn_output.bias",
    },
}  # fmt: skip


def write_model_gguf(
    model: torch.nn.Module,
    path: Path,
    qtype: Q,
    *,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    seed: int = 0,
    fallback: Q = Q.Q8_0,
    per_expert: bool = False,
    expert_type: Q | None = None,
    expert_types: dict[str, Q] | None = None,
    fused_gate_up: bool = False,
    split_qkv: bool = False,
    tokenizer_pre: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Writes `model` (a transformers Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE/Mixtral/Phi-3/Gemma 3/
    gpt-oss) as llama.cpp's convert_hf_to_gguf.py lays it out; matrices in `qtype` (`fallback`
    where a row does not fill whole blocks, as llama.cpp does; gpt-oss experts in `expert_type`
    if given, or `expert_types[name]` for the GGUF tensor `name`), norms, biases, sinks and routers in F32. Returns the model's state dict with every
    weight replaced by exactly what the GGUF holds, in HF layout (q/k un-permuted, Gemma's norms
    less the one llama.cpp adds, gpt-oss gate/up interleaved again). `per_expert`: one tensor per
    expert (`blk.{i}.ffn_gate.{e}.weight`, older llama.cpp Mixtral exports) instead of stacked
    ones; `fused_gate_up`: gpt-oss experts as one `ffn_gate_up_exps` (gate rows first), as
    llama.cpp writes them with --fuse-gate-up-exps; `split_qkv`: Phi-3's q/k/v as three tensors
    (`attn_q/k/v`), which llama.cpp's Phi-3 tensor list also allows. `metadata`: extra keys (int, float, str or
    a list of bools)."""
    cfg = model.config
    model_type = cfg.model_type
    arch = _ARCH_KEYS.get(model_type, model_type)
    permute = model_type in ("llama", "mixtral", "mistral")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    if model_type == "gemma3_text":
        rope = rope.get("full_attention", rope)
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if model_type != "phi3":  # llama.cpp's Phi-3 export leaves the head size implied
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    rope_dims = int(head_dim * (partial or 1.0))
    if permute or model_type == "phi3":
        w.add_rope_dimension_count(rope_dims)
    theta = rope.get("rope_theta")
    w.add_rope_freq_base(float(theta or getattr(cfg, "rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, head_dim))
    elif rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if model_type == "phi3":
        original = cfg.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            w.add_rope_scaling_attn_factors(attn)
            for kind in ("long", "short"):
                factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
                w.add_tensor(f"rope_factors_{kind}.weight", factors)
    elif model_type in ("gemma3_text", "gpt_oss") or getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if model_type == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if model_type == "gpt_oss":
            w.add_expert_feed_forward_length(cfg.intermediate_size)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer_pre or ("qwen2" if arch.startswith("qwen") else "smollm"))
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    expected: dict[str, torch.Tensor] = {}
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}

    def add(
        name: str, value: np.ndarray, matrix: bool, n_head: int = 0, as_type: Q | None = None
    ) -> np.ndarray:
        """Writes one tensor; returns what it dequantizes to, in HF row order."""
        stored = value
        if n_head:
            stored = value.reshape(n_head, 2, -1, *value.shape[1:]).swapaxes(1, 2)
            stored = stored.reshape(value.shape)
        t = Q.F32
        if matrix:
            t = as_type or qtype
            t = t if value.shape[-1] % block_size(t) == 0 else fallback
        data = encode(np.ascontiguousarray(stored), t, rng)
        if t in (Q.F32, Q.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=t)
        got = dequantize(data, t).astype(np.float32).reshape(value.shape)
        if n_head:
            got = got.reshape(n_head, -1, 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
        return got

    def add_experts(blk: str, proj: str, value: np.ndarray) -> np.ndarray:
        if not per_expert:
            return add(f"{blk}ffn_{proj}_exps.weight", value, True)
        return np.stack([add(f"{blk}ffn_{proj}.{e}.weight", v, True) for e, v in enumerate(value)])

    def add_norm(name: str, value: np.ndarray) -> np.ndarray:
        if model_type != "gemma3_text":
            return add(name, value, False)
        # llama.cpp stores Gemma's norm weights plus one (Gemma scales by 1 + w).
        return add(name, value + np.float32(1.0), False) - np.float32(1.0)

    def add_gpt_oss_experts(blk: str, rest: str, value: np.ndarray) -> np.ndarray:
        def t(name: str) -> Q | None:
            return (expert_types or {}).get(name, expert_type)

        if rest == "mlp.experts.down_proj":  # [E, I, H] (x @ W) -> [E, H, I]
            name = f"{blk}ffn_down_exps.weight"
            got = add(name, value.transpose(0, 2, 1).copy(), True, 0, t(name))
            return got.transpose(0, 2, 1)
        if rest == "mlp.experts.down_proj_bias":
            return add(f"{blk}ffn_down_exps.bias", value, False)
        bias = rest.endswith("_bias")
        rows = value if bias else value.transpose(0, 2, 1)  # [E, 2I(, H)], gate/up interleaved
        gate, up = rows[:, 0::2], rows[:, 1::2]
        part = "bias" if bias else "weight"
        if fused_gate_up:
            name = f"{blk}ffn_gate_up_exps.{part}"
            got = add(name, np.concatenate([gate, up], axis=1), not bias, 0, t(name))
            gate, up = np.split(got, 2, axis=1)
        else:
            name = f"{blk}ffn_gate_exps.{part}"
            gate = add(name, np.ascontiguousarray(gate), not bias, 0, t(name))
            name = f"{blk}ffn_up_exps.{part}"
            up = add(name, np.ascontiguousarray(up), not bias, 0, t(name))
        out = np.stack([gate, up], axis=2).reshape(rows.shape)
        return out if bias else out.transpose(0, 2, 1)

    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[hf_name]
            if name == "output_norm.weight":
                expected[hf_name] = torch.from_numpy(add_norm(name, value))
            else:
                expected[hf_name] = torch.from_numpy(add(name, value, value.ndim == 2))
            continue
        parts = hf_name.split(".")  # model.layers.{i}.<module>.<proj>.<param>
        i, rest = int(parts[2]), ".".join(parts[3:])
        blk = f"blk.{i}."
        if split_qkv and rest == "self_attn.qkv_proj.weight":
            q_dim = cfg.num_attention_heads * head_dim
            kv_dim = cfg.num_key_value_heads * head_dim
            q, k, v = np.split(value, [q_dim, q_dim + kv_dim])
            got = [
                add(f"{blk}attn_{n}.weight", x, True) for n, x in zip("qkv", (q, k, v), strict=True)
            ]
            expected[hf_name] = torch.from_numpy(np.concatenate(got))
            continue
        if model_type == "gpt_oss" and rest.startswith("mlp.experts."):
            expected[hf_name] = torch.from_numpy(add_gpt_oss_experts(blk, rest, value))
            continue
        if rest == "mlp.experts.gate_up_proj":
            inter = value.shape[1] // 2
            gate = add_experts(blk, "gate", value[:, :inter])
            up = add_experts(blk, "up", value[:, inter:])
            expected[hf_name] = torch.from_numpy(np.concatenate([gate, up], axis=1))
            continue
        if rest == "mlp.experts.down_proj":
            expected[hf_name] = torch.from_numpy(add_experts(blk, "down", value))
            continue
        name = (
            _FAMILY_NAMES.get(model_type, {}).get(rest)
            or {
                "input_layernorm.weight": "attn_norm.weight",
                "post_attention_layernorm.weight": "ffn_norm.weight",
                "self_attn.q_proj.weight": "attn_q.weight",
                "self_attn.k_proj.weight": "attn_k.weight",
                "self_attn.v_proj.weight": "attn_v.weight",
                "self_attn.q_proj.bias": "attn_q.bias",
                "self_attn.k_proj.bias": "attn_k.bias",
                "self_attn.v_proj.bias": "attn_v.bias",
                "self_attn.o_proj.bias": "attn_output.bias",
                "self_attn.o_proj.weight": "attn_output.weight",
                "self_attn.q_norm.weight": "attn_q_norm.weight",
                "self_attn.k_norm.weight": "attn_k_norm.weight",
                "mlp.gate_proj.weight": "ffn_gate.weight",
                "mlp.up_proj.weight": "ffn_up.weight",
                "mlp.down_proj.weight": "ffn_down.weight",
                "mlp.gate.weight": "ffn_gate_inp.weight",
            }[rest]
        )
        if "norm" in rest:
            expected[hf_name] = torch.from_numpy(add_norm(blk + name, value))
            continue
        matrix = value.ndim >= 2 and rest not in ("mlp.gate.weight", "mlp.router.weight")
        n_head = heads.get(parts[-2], 0) if permute and rest.endswith("weight") else 0
        expected[hf_name] = torch.from_numpy(add(blk + name, value, matrix, n_head))
    if cfg.tie_word_embeddings and "lm_head.weight" in model.state_dict():
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
