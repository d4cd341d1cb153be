"""Measured tile choices of the fused MoE ops, installed by a higher layer (graphs/moe_tiles.py)."""

from __future__ import annotations

import bisect
from typing import NamedTuple

from .._jit import next_pow2
from .common import FORMATS, PAIR_MAJOR, MoeTileConfig, W4A8TileConfig, _err

# --------------------------------------------------------------------------------------------------
# Measured tile choices, installed by a higher layer (graphs/moe_tiles.py)
#
# Per layer shape, a config per token bucket (powers of two). A call with n tokens uses the choice of
# the smallest installed bucket >= n, or the largest bucket's above them all; a shape with nothing
# installed keeps the static table, and an explicit `config` wins over both. Lookups are a dict hit
# and a bisect (eagerly, or inside `fused_moe_w4a16_measured` under torch.compile).

ACTIVATIONS = ("w4a16", "w4a8")
# MoeTileConfig fields of the pair-major down kernel's own tile, where 0 means gate_up's value.
DOWN_FIELDS = ("down_block_n", "down_block_k", "down_num_warps")


class MoeShape(NamedTuple):
    """What a tile choice depends on besides the token count."""

    fmt: str  # "nvfp4" | "mxfp4"
    activations: str  # "w4a16" | "w4a8"
    num_experts: int
    hidden: int  # H: K of gate_up, N of down
    intermediate: int  # I: N of gate_up (per projection), K of down
    top_k: int


TileConfig = MoeTileConfig | W4A8TileConfig

_TILE_CHOICES: dict[MoeShape, dict[int, TileConfig]] = {}
# Derived from _TILE_CHOICES: shape -> (sorted buckets, their configs), for the bisect.
_TILE_TABLES: dict[MoeShape, tuple[tuple[int, ...], tuple[TileConfig, ...]]] = {}


def token_bucket(num_tokens: int) -> int:
    """The power of two a token count is tuned at: the smallest one >= num_tokens (1 for 0)."""
    if num_tokens < 0:
        raise _err(f"num_tokens must be >= 0, got {num_tokens}")
    return next_pow2(max(num_tokens, 1))


def check_tile_config(activations: str, config: TileConfig) -> None:
    """Raises MoeKernelError unless `config` is a valid tile config for these activations."""
    if activations not in ACTIVATIONS:
        raise _err(f"activations {activations!r} is not one of {', '.join(ACTIVATIONS)}")
    kind = MoeTileConfig if activations == "w4a16" else W4A8TileConfig
    if type(config) is not kind:
        raise _err(f"{activations} tiles need a {kind.__name__}, got {config!r}")
    for name, value in vars(config).items():
        lowest = 0 if name in DOWN_FIELDS else 1  # 0: the down kernel takes gate_up's value
        if type(value) is not int or value < lowest:
            raise _err(f"{name} must be an int >= {lowest}, got {value!r}")
    powers = ("block_m", "block_n", "block_k", "num_warps", *DOWN_FIELDS)
    for name in (n for n in powers if hasattr(config, n)):
        value = getattr(config, name)
        if value & (value - 1):
            raise _err(f"{name} must be a power of two, got {value}")
    pair_major = isinstance(config, MoeTileConfig) and config.block_m == PAIR_MAJOR
    if isinstance(config, MoeTileConfig) and not pair_major:
        if any(getattr(config, name) for name in DOWN_FIELDS):
            raise _err(f"a down kernel tile of its own is for the pair-major path only: {config}")
    if config.block_m < 16 and not pair_major:
        raise _err(
            f"block_m must be >= 16 (tl.dot's minimum) or {PAIR_MAJOR} (W4A16 pair-major), "
            f"got {config.block_m}"
        )
    split_k = getattr(config, "split_k", 1)
    if split_k & (split_k - 1) or (split_k > 1 and not pair_major):
        raise _err(f"split_k must be a power of two, above 1 only on the pair-major path: {config}")
    if config.block_n < 16 and not pair_major:
        raise _err(f"block_n must be >= 16 (tl.dot's minimum) on M tiles, got {config.block_n}")
    if isinstance(config, MoeTileConfig) and min(config.block_k, config.down_tile()[1]) < 32:
        raise _err(f"block_k and down_block_k must be >= 32: {config}")


def install_tile_choice(shape: MoeShape, bucket: int, config: TileConfig) -> None:
    """From now on, calls of `shape` in `bucket`'s token range run `config` (see above)."""
    if not isinstance(shape, MoeShape):
        raise _err(f"shape must be a MoeShape, got {shape!r}")
    if shape.fmt not in FORMATS:
        raise _err(f"format {shape.fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    if bucket < 1 or bucket & (bucket - 1):
        raise _err(f"a token bucket is a power of two >= 1, got {bucket}")
    check_tile_config(shape.activations, config)
    choices = _TILE_CHOICES.setdefault(shape, {})
    choices[bucket] = config
    buckets = tuple(sorted(choices))
    _TILE_TABLES[shape] = (buckets, tuple(choices[b] for b in buckets))


def has_tile_choices(shape: MoeShape) -> bool:
    return shape in _TILE_TABLES


def tile_choice(shape: MoeShape, num_tokens: int) -> TileConfig | None:
    """The installed choice for `num_tokens` rows of `shape`, or None (use the static table)."""
    table = _TILE_TABLES.get(shape)
    if table is None:
        return None
    buckets, configs = table
    return configs[min(bisect.bisect_left(buckets, num_tokens), len(configs) - 1)]


def installed_tile_choices() -> dict[MoeShape, dict[int, TileConfig]]:
    """A copy of every installed choice: shape -> bucket -> config."""
    return {shape: dict(choices) for shape, choices in _TILE_CHOICES.items()}


def clear_tile_choices() -> None:
    _TILE_CHOICES.clear()
    _TILE_TABLES.clear()
