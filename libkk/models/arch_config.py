"""The architecture facts a model needs, parsed from a Hugging Face `config.json`.

One parser per family fills one `ArchConfig`. Defaults mirror the transformers config classes, so a
hub config that omits a field means what it means to transformers. Both spellings of RoPE settings
are read: transformers 5 writes `rope_parameters` (with `rope_theta` inside); older checkpoints have
a top-level `rope_theta` and a `rope_scaling` dict (whose type key may be `type`). Features the
models do not implement raise UnsupportedModelError naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from libkk.errors import CorruptCheckpointError, UnsupportedModelError
from libkk.layers.rotary import SUPPORTED_ROPE_TYPES, RopeConfig
from libkk.models.registry import unsupported_architecture
from libkk.quant.checkpoint import is_fp8_block_config


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # e.g. "Qwen3ForCausalLM"
    model_type: str  # e.g. "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (MoE layers use moe_intermediate_size)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # Every layer's attention window (Mistral, Phi-3): a query at p sees keys in (p - W, p].
    # None: full causal attention.
    sliding_window: int | None = None
    # Per-layer attention kind (Gemma 3, gpt-oss): "sliding_attention" layers take
    # `sliding_window` (and Gemma's `local_rope`), "full_attention" layers full attention and
    # `rope`. Empty: every layer alike.
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False  # a learned sink logit per head in each softmax (gpt-oss)
    local_rope: RopeConfig | None = None  # RoPE of the sliding layers; None: `rope`
    attention_scale: float | None = None  # scale of q.k; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights
    router_bias: bool = False  # the router linear has a bias (gpt-oss)
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    # The experts' clamped SwiGLU (gpt-oss): gate * sigmoid(alpha * gate) * (up + 1), gate and up
    # clamped at `swiglu_limit`; None: SiLU(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # The checkpoint stores its experts as MXFP4 blocks and scales (quantization_config mxfp4).
    mxfp4_experts: bool = False
    moe_layers: tuple[int, ...] = ()  # indices of the layers whose MLP is a sparse MoE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None  # "bfloat16", ... as written in config.json
    # Linear weights stored as FP8 with per-128x128-block scales (quantization_config "fp8").
    fp8_block_weights: bool = False

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def window_of(self, layer_idx: int) -> int | None:
        """The attention window of layer `layer_idx` (None: full attention)."""
        if self.layer_types and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window


_REQUIRED = object()


class _Fields:
    """Typed access to config.json fields with errors that name the file and field."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, default)
        if value is _REQUIRED:
            raise CorruptCheckpointError(f"{self.source}: required field {key!r} is missing")
        return value

    def _bad(self, key: str, value: Any, expected: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.source}: field {key!r} is {value!r}, expected {expected}"
        )

    def int(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._bad(key, value, f"an integer >= {minimum}")
        return value

    def float(self, key: str, default: Any = _REQUIRED) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(key, value, "a number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def unsupported(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.source}: {what} is not supported")


def parse_arch_config(raw: Mapping[str, Any], source: str = "config.json") -> ArchConfig:
    """Parses a config.json mapping; `source` (the file path) prefixes every error message."""
    architecture = _architecture(raw, source)
    parser = _PARSERS.get(architecture)
    if parser is None:
        raise unsupported_architecture(architecture, source)
    f = _Fields(raw, source)
    quantization = f.get("quantization_config")
    if architecture in _NATIVE_MXFP4 and _is_mxfp4_config(quantization):
        quantization = None  # the family's own expert format: its parser says so
    if quantization is not None and not is_fp8_block_config(quantization):
        method = (quantization or {}).get("quant_method", "unknown")
        raise f.unsupported(
            f"quantization_config (quant_method {method!r}; supported: 'fp8' with "
            "weight_block_size [128, 128])"
        )
    act = f.get("hidden_act", "silu")
    if act != "silu" and architecture not in _OWN_ACTIVATION:
        raise f.unsupported(f"hidden_act {act!r} (only 'silu')")
    return replace(parser(f, architecture), fp8_block_weights=quantization is not None)


_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
}

# Families whose checkpoints may store their experts as MXFP4 blocks and scales
# (`quantization_config: {"quant_method": "mxfp4"}`).
_NATIVE_MXFP4 = frozenset({"GptOssForCausalLM"})


def _is_mxfp4_config(quantization: Any) -> bool:
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


# Families whose parser reads and checks the activation itself (another field name).
_OWN_ACTIVATION = frozenset({"Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"})


def _architecture(raw: Mapping[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    if archs is None and raw.get("model_type") in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[raw["model_type"]]
    raise unsupported_architecture(archs, source)


# --- shared pieces -------------------------------------------------------------------------


def _base(
    f: _Fields,
    architecture: str,
    *,
    default_theta: float,
    default_eps: float,
    default_max_position: int,
    default_head_dim: int | None = None,
    partial_rotary: bool = False,
) -> dict[str, Any]:
    """Fields every family has; `default_head_dim` None means hidden_size // num_heads.
    `partial_rotary`: the family's RoPE may rotate part of each head (else the field is refused).
    """
    hidden = f.int("hidden_size")
    num_heads = f.int("num_attention_heads")
    num_kv_heads = f.get("num_key_value_heads") or num_heads
    if not isinstance(num_kv_heads, int) or num_heads % num_kv_heads:
        raise f._bad("num_key_value_heads", num_kv_heads, f"a divisor of {num_heads}")
    head_dim = f.get("head_dim") or default_head_dim or hidden // num_heads
    if not isinstance(head_dim, int) or head_dim % 2:
        raise f._bad("head_dim", head_dim, "an even integer")
    max_position = f.int("max_position_embeddings", default_max_position)
    eos = f.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        architecture=architecture,
        model_type=str(f.get("model_type", "")),
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_layers=f.int("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rms_norm_eps=f.float("rms_norm_eps", default_eps),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        rope=_rope(f, default_theta, max_position, partial_rotary),
        bos_token_id=f.get("bos_token_id"),
        eos_token_ids=eos_ids,
        checkpoint_dtype=f.get("dtype") or f.get("torch_dtype"),
    )


def _rope(
    f: _Fields, default_theta: float, max_position: int, partial_rotary: bool = False
) -> RopeConfig:
    params = f.get("rope_parameters") or f.get("rope_scaling") or {}
    key = "rope_parameters" if f.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise f._bad(key, params, "a mapping")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise f.unsupported(f"{key} per layer type")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn") and "long_factor" in params:
        rope_type = "longrope"  # older Phi-3 spellings (transformers maps them the same way)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise f.unsupported(
            f"{key}.rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", f.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        if not partial_rotary:
            raise f.unsupported(f"partial_rotary_factor {partial!r}")
        if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0 < partial:
            raise f._bad("partial_rotary_factor", partial, "a number in (0, 1]")
    partial = float(partial or 1.0)
    p = _Fields(params, f"{f.source}: {key}")
    theta = p.float("rope_theta", f.float("rope_theta", default_theta))
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "linear":
        return RopeConfig(
            rope_type="linear", theta=theta, factor=p.float("factor"), partial_rotary_factor=partial
        )
    # NOTE: like transformers, a top-level original_max_position_embeddings wins over the nested
    # one, and max_position_embeddings stands in when neither is given.
    original = f.get("original_max_position_embeddings")
    if original is None:
        original = params.get("original_max_position_embeddings", max_position)
    if rope_type == "longrope":
        factors = {}
        for name in ("short_factor", "long_factor"):
            value = params.get(name)
            if not isinstance(value, list) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in value
            ):
                raise p._bad(name, value, "a list of numbers")
            factors[name] = tuple(float(x) for x in value)
        factor = params.get("factor")
        attention_factor = params.get("attention_factor")
        return RopeConfig(
            rope_type="longrope",
            theta=theta,
            factor=float(factor) if factor is not None else max_position / int(original),
            original_max_position_embeddings=int(original),
            attention_factor=float(attention_factor) if attention_factor is not None else None,
            short_factor=factors["short_factor"],
            long_factor=factors["long_factor"],
            use_long_factor=max_position > int(original),
            partial_rotary_factor=partial,
        )
    if rope_type == "llama3":
        return RopeConfig(
            rope_type="llama3",
            theta=theta,
            factor=p.float("factor"),
            low_freq_factor=p.float("low_freq_factor"),
            high_freq_factor=p.float("high_freq_factor"),
            original_max_position_embeddings=int(original),
            partial_rotary_factor=partial,
        )
    # yarn
    factor = params.get("factor")
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor) if factor is not None else max_position / int(original),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention_factor) if attention_factor is not None else None,
        mscale=float(mscale) if mscale else None,
        mscale_all_dim=float(mscale_all_dim) if mscale_all_dim else None,
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=partial,
    )


def _check_sliding_window(f: _Fields, enabled: bool, max_position: int) -> None:
    window = f.get("sliding_window")
    if enabled and window is not None and window < max_position:
        raise f.unsupported(
            f"sliding window attention (sliding_window {window} < max_position_embeddings "
            f"{max_position})"
        )


def _sliding_window(f: _Fields, default: int | None, max_position: int) -> int | None:
    """The window every layer attends over; None when absent or no narrower than the positions
    the model takes (then it hides nothing)."""
    window = f.get("sliding_window", default)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise f._bad("sliding_window", window, "null or an integer >= 1")
    return window if window < max_position else None


def _layer_types(f: _Fields, num_layers: int, pattern: int) -> list[str]:
    """The config's `layer_types`, checked; absent: every `pattern`-th layer full, the others
    sliding (transformers' default for Gemma 3 and gpt-oss)."""
    layer_types = f.get("layer_types")
    if layer_types is None:
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or any(kind not in _LAYER_TYPES for kind in layer_types)
    ):
        raise f._bad("layer_types", layer_types, f"{num_layers} of {', '.join(_LAYER_TYPES)}")
    return layer_types


# --- families --------------------------------------------------------------------------------


def _llama(f: _Fields, architecture: str) -> ArchConfig:
    base = _base(
        f, architecture, default_theta=10000.0, default_eps=1e-6, default_max_position=2048
    )
    bias = f.bool("attention_bias", False)
    return ArchConfig(**base, qkv_bias=bias, o_proj_bias=bias, mlp_bias=f.bool("mlp_bias", False))


def _qwen2(f: _Fields, architecture: str) -> ArchConfig:
    base = _base(
        f, architecture, default_theta=10000.0, default_eps=1e-6, default_max_position=32768
    )
    _check_sliding_window(f, f.bool("use_sliding_window", False), base["max_position_embeddings"])
    # Qwen2 always has q/k/v biases and no o_proj bias.
    return ArchConfig(**base, qkv_bias=True, o_proj_bias=False)


def _qwen3(f: _Fields, architecture: str) -> ArchConfig:
    base = _base(
        f,
        architecture,
        default_theta=10000.0,
        default_eps=1e-6,
        default_max_position=32768,
        default_head_dim=128,  # Qwen3Config's default; real configs always write it
    )
    _check_sliding_window(f, f.bool("use_sliding_window", False), base["max_position_embeddings"])
    bias = f.bool("attention_bias", False)
    return ArchConfig(**base, qkv_bias=bias, o_proj_bias=bias, qk_norm=True)


def _qwen3_moe(f: _Fields, architecture: str) -> ArchConfig:
    base = _base(
        f, architecture, default_theta=10000.0, default_eps=1e-6, default_max_position=32768
    )
    _check_sliding_window(f, f.bool("use_sliding_window", False), base["max_position_embeddings"])
    bias = f.bool("attention_bias", False)
    # Hub configs say `num_experts`; transformers 5 writes `num_local_experts` (an alias).
    key = "num_experts" if "num_experts" in f.raw else "num_local_experts"
    num_experts = f.int(key, 128, minimum=0)
    step = f.int("decoder_sparse_step", 1)
    mlp_only = f.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise f._bad("mlp_only_layers", mlp_only, "a list of layer indices")
    moe_layers = tuple(
        i
        for i in range(base["num_layers"])
        if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
    )
    return ArchConfig(
        **base,
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        num_experts=num_experts,
        num_experts_per_tok=f.int("num_experts_per_tok", 8),
        moe_intermediate_size=f.int("moe_intermediate_size", 768),
        norm_topk_prob=f.bool("norm_topk_prob", False),
        moe_layers=moe_layers,
    )


def _mixtral(f: _Fields, architecture: str) -> ArchConfig:
    base = _base(
        f, architecture, default_theta=1e6, default_eps=1e-5, default_max_position=4096 * 32
    )
    _check_sliding_window(f, True, base["max_position_embeddings"])
    return ArchConfig(
        **base,
        num_experts=f.int("num_local_experts", 8),
        num_experts_per_tok=f.int("num_experts_per_tok", 2),
        moe_intermediate_size=base["intermediate_size"],
        norm_topk_prob=True,  # Mixtral always renormalizes its top-k weights
        moe_layers=tuple(range(base["num_layers"])),
    )


def _mistral(f: _Fields, architecture: str) -> ArchConfig:
    base = _base(
        f, architecture, default_theta=10000.0, default_eps=1e-6, default_max_position=4096 * 32
    )
    # NOTE: like transformers' MistralModel, every layer takes the window: a `layer_types` list
    # is read only for MinistralForCausalLM (`_ministral`).
    # MistralConfig's default window is 4096; a config written with null has none.
    window = _sliding_window(f, 4096, base["max_position_embeddings"])
    return ArchConfig(**base, sliding_window=window)


def _ministral(f: _Fields, architecture: str) -> ArchConfig:
    """Ministral: Mistral whose `layer_types` say which layers take the window (transformers'
    MinistralConfig: every layer, unless the list says otherwise)."""
    mistral = _mistral(f, architecture)
    num_layers = mistral.num_layers
    layer_types = _layer_types(f, num_layers, num_layers + 1)  # absent: every layer sliding
    return replace(mistral, layer_types=tuple(layer_types))


def _phi3(f: _Fields, architecture: str) -> ArchConfig:
    base = _base(
        f,
        architecture,
        default_theta=10000.0,
        default_eps=1e-5,
        default_max_position=4096,
        partial_rotary=True,
    )
    window = _sliding_window(f, None, base["max_position_embeddings"])
    # Phi-3 has no biases; its checkpoints store q/k/v and gate/up already stacked.
    return ArchConfig(**base, sliding_window=window)


# Gemma3TextConfig's defaults for the fields hub configs (text_config of the multimodal ones
# especially) leave out.
_GEMMA3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131_072,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
)
_LAYER_TYPES = ("sliding_attention", "full_attention")
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")


def _gemma3(f: _Fields, architecture: str) -> ArchConfig:
    """Gemma 3 text (Gemma3ForCausalLM) and the text tower of Gemma3ForConditionalGeneration
    (its `text_config`; the vision tower is not read)."""
    multimodal = architecture == "Gemma3ForConditionalGeneration"
    text = dict(f.raw)
    if multimodal:
        sub = f.get("text_config") or {}
        if not isinstance(sub, dict):
            raise f._bad("text_config", sub, "a mapping")
        text = dict(sub)
        for key in ("bos_token_id", "eos_token_id", "dtype", "torch_dtype"):
            if text.get(key) is None and f.get(key) is not None:
                text[key] = f.get(key)
        # The multimodal model ties its head to the text embedding by the top-level setting.
        text["tie_word_embeddings"] = f.get("tie_word_embeddings", True)
    text = {**_GEMMA3_DEFAULTS, **text}
    source = f"{f.source}: text_config" if multimodal else f.source
    t = _Fields(text, source)
    act = t.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise t.unsupported(f"hidden_activation {act!r} (only 'gelu_pytorch_tanh')")
    if t.get("use_bidirectional_attention"):
        raise t.unsupported("use_bidirectional_attention")
    # NOTE: transformers' Gemma 3 attention never applies attn_logit_softcapping (its attention
    # call passes no softcap); the field is ignored here too, so that the two compute the same.

    # RoPE: full layers take rope_parameters["full_attention"] (older configs: rope_theta and
    # rope_scaling), sliding layers rope_parameters["sliding_attention"] (rope_local_base_freq).
    rest = {k: v for k, v in text.items() if k not in _ROPE_KEYS}
    params = t.get("rope_parameters")
    per_type = isinstance(params, dict) and any(k in params for k in _LAYER_TYPES)
    if per_type:
        full = params.get("full_attention") or {"rope_type": "default"}
        local = params.get("sliding_attention") or {"rope_type": "default"}
    else:
        full = params or t.get("rope_scaling") or {"rope_type": "default"}
        local = {"rope_type": "default"}
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise t._bad("rope_parameters", params, "a mapping per layer type")
    full_theta = t.float("rope_theta", 1_000_000.0)
    local_theta = t.float("rope_local_base_freq", 10_000.0)
    full_f = _Fields({**rest, "rope_parameters": full, "rope_theta": full_theta}, source)
    local_f = _Fields({**rest, "rope_parameters": local, "rope_theta": local_theta}, source)
    base = _base(
        full_f, architecture, default_theta=full_theta, default_eps=1e-6,
        default_max_position=131_072, default_head_dim=256,
    )  # fmt: skip
    max_position = base["max_position_embeddings"]
    local_rope = _rope(local_f, local_theta, max_position)

    num_layers = base["num_layers"]
    pattern = t.int("sliding_window_pattern", 6) if t.get("layer_types") is None else 1
    layer_types = _layer_types(t, num_layers, pattern)
    scalar = t.float("query_pre_attn_scalar", 256)
    if scalar <= 0:
        raise t._bad("query_pre_attn_scalar", scalar, "a positive number")
    cap = t.get("final_logit_softcapping")
    if cap is not None:
        cap = t.float("final_logit_softcapping")
        if cap <= 0:
            raise t._bad("final_logit_softcapping", cap, "null or a positive number")
    if multimodal:
        cap = None  # transformers' Gemma3ForConditionalGeneration does not cap its logits
    bias = t.bool("attention_bias", False)
    return ArchConfig(
        **base,
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        sliding_window=_sliding_window(t, 4096, max_position),
        layer_types=tuple(layer_types),
        local_rope=local_rope,
        attention_scale=scalar**-0.5,
        final_logit_softcapping=cap,
        hidden_act="gelu_pytorch_tanh",
    )


def _gpt_oss(f: _Fields, architecture: str) -> ArchConfig:
    """gpt-oss: every layer an MoE of biased experts with the clamped SwiGLU, a biased router
    (softmax over the top-k logits), attention with biases and sinks, sliding (128) and full
    layers alternating, YaRN RoPE."""
    base = _base(
        f, architecture, default_theta=150000.0, default_eps=1e-5, default_max_position=131072,
        default_head_dim=64,
    )  # fmt: skip
    num_layers = base["num_layers"]
    layer_types = _layer_types(f, num_layers, 2)  # GptOssConfig's default: alternating
    bias = f.bool("attention_bias", True)
    limit = f.float("swiglu_limit", 7.0)
    if limit <= 0:
        raise f._bad("swiglu_limit", limit, "a positive number")
    quantization = f.get("quantization_config")
    return ArchConfig(
        **base,
        qkv_bias=bias,
        o_proj_bias=bias,
        sliding_window=_sliding_window(f, 128, base["max_position_embeddings"]),
        layer_types=tuple(layer_types),
        attention_sinks=True,
        num_experts=f.int("num_local_experts", 128),
        num_experts_per_tok=f.int("num_experts_per_tok", f.get("experts_per_token", 4)),
        moe_intermediate_size=base["intermediate_size"],
        norm_topk_prob=True,  # softmax over the top-k logits: the renormalized top-k
        moe_layers=tuple(range(num_layers)),
        router_bias=True,
        expert_bias=True,
        swiglu_limit=limit,
        swiglu_alpha=f.float("swiglu_alpha", 1.702),
        mxfp4_experts=_is_mxfp4_config(quantization),
    )


_PARSERS: dict[str, Callable[[_Fields, str], ArchConfig]] = {
    "LlamaForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
    "MistralForCausalLM": _mistral,
    "MinistralForCausalLM": _ministral,
    "Phi3ForCausalLM": _phi3,
    "Gemma3ForCausalLM": _gemma3,
    "Gemma3ForConditionalGeneration": _gemma3,
    "GptOssForCausalLM": _gpt_oss,
}
