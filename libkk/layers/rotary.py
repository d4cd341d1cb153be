"""Rotary position embedding (NeoX / half-split style, as HF Llama, Qwen and Mixtral use).

The inverse frequencies and the cos/sin table are computed on the CPU in fp32 with the same
operations as `transformers.modeling_rope_utils` (whatever the target device, so every device
gets the same table), so fp32 parity holds to rounding. The table
covers positions [0, max_position); the model runner never schedules a position past it.

Partial rotary (`partial_rotary_factor` < 1, Phi-4-mini) rotates the first
int(head_dim * factor) dims of each head and passes the rest through, as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from libkk.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """Normalized RoPE settings (from `rope_parameters` or the older `rope_scaling` + `rope_theta`).

    Fields beyond `rope_type` and `theta` matter only for the scaled types that read them.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0  # linear, llama3, yarn, longrope
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    # yarn, longrope: scale on cos/sin; None = from factor (and mscale)
    attention_factor: float | None = None
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within the original
    long_factor: tuple[float, ...] = ()  # longrope: ... and past it (rotary_dim // 2 each)
    # longrope: use long_factor for every position (the table spans past the original context).
    use_long_factor: bool = False
    partial_rotary_factor: float = 1.0  # rotary dims = int(head_dim * partial_rotary_factor)

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def compute_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim // 2] fp32 on CPU, attention scaling applied to cos/sin)."""
    base = rope.theta
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (base**exponent)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(rope, dim)
    raise UnsupportedModelError(
        f"rope type {rope.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    assert rope.original_max_position_embeddings is not None
    factor = rope.factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    assert rope.original_max_position_embeddings is not None
    base, factor = rope.theta, rope.factor
    original_max = rope.original_max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp  # 1: keep the original frequency

    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3, Phi-4): each frequency divided by its short or long factor; cos/sin
    scaled by sqrt(1 + log(factor) / log(original_max)) unless the config gives the factor.

    transformers picks the long factors for a whole forward when its largest position + 1
    exceeds original_max_position_embeddings, else the short ones, so one sequence's keys change
    rotation as it grows. A paged cache keeps keys rotated once, so here the choice is made once
    per model (`use_long_factor`: the position table reaches past the original context); a
    sequence longer than the original context matches transformers exactly.
    """
    assert rope.original_max_position_embeddings is not None
    original_max = rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        factor = rope.factor
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
        )
    ext = rope.long_factor if rope.use_long_factor else rope.short_factor
    if len(ext) != dim // 2:
        raise UnsupportedModelError(
            f"longrope factors have {len(ext)} entries; rotary dim {dim} needs {dim // 2}"
        )
    ext_factors = torch.tensor(ext, dtype=torch.float32, device="cpu")
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (ext_factors * rope.theta**inv_freq_shape)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat q/k rows by position, from a precomputed cos/sin table.

    The table is an fp32 buffer on the default device at construction; it stays fp32 (build the
    model in its dtype rather than calling `.to(dtype)` on it, which would round the table).
    """

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope = rope
        self.rotary_dim = rope.rotary_dim(head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise UnsupportedModelError(
                f"rotary dim {self.rotary_dim} of head_dim {head_dim} must be even and positive"
            )
        # [rotary_dim // 2]
        inv_freq, attention_scaling = compute_inv_freq(rope, self.rotary_dim)
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim // 2]
        # HF scales cos and sin by the attention factor (YaRN mscale) before the rotation.
        cos = freqs.cos() * attention_scaling
        sin = freqs.sin() * attention_scaling
        cos_sin = torch.cat([cos, sin], dim=-1)  # [max_position, rotary_dim]
        self.register_buffer(
            "cos_sin_cache", cos_sin.to(torch.get_default_device()), persistent=False
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: HF casts cos/sin to the activation dtype before rotating; do the same.
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(q.dtype)  # [T, rotary_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim // 2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_dim)  # [T, heads, head_dim]
        x_pass = None
        if self.rotary_dim < self.head_dim:
            x, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = x.chunk(2, dim=-1)  # [T, heads, rotary_dim // 2] each
        # Same products and sums as HF's `x * cos + rotate_half(x) * sin`.
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if x_pass is not None:
            out = torch.cat([out, x_pass], dim=-1)
        return out.reshape(num_tokens, -1)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, "
            f"rope_type={self.rope.rope_type!r}, theta={self.rope.theta}"
        )
