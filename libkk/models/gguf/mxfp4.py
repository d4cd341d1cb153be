"""gpt-oss MXFP4 experts written packed, as libkk's per-expert MXFP4 parts.

ggml's `block_mxfp4` holds 32 elements of a row in 17 bytes: one E8M0 byte `e`, then 16 bytes
whose byte j carries element j in the low nibble and element j + 16 in the high nibble. Its
values are the E2M1 codes doubled (0, 1, 2, 3, 4, 6, 8, 12, then the same negative) times
2^(e - 128), i.e. e2m1 * 2^(e - 127): the same codes and the same scale byte as OCP MXFP4, which
libkk stores as `weight` uint8 [rows, K/2] (element 2i in the low nibble of byte i) and
`weight_scale` uint8 [rows, K/32]. So repacking only moves nibbles; no value changes. The one
difference: ggml reads a 0xFF scale as 2^127 where OCP (and libkk) read NaN; ggml's quantizer never
writes it, and a file that has one is refused rather than silently changed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from libkk.errors import UnsupportedModelError
from libkk.models.gguf.arch import TensorPlan

logger = logging.getLogger("libkk")

_BLOCK = 32  # elements per block
_BLOCK_BYTES = 17  # 1 scale byte + 16 bytes of nibbles
# The stacked float pieces that the packed parts replace (arch.py's gpt-oss pieces).
_GATE_UP = "mlp.experts.gate_up_proj"
_DOWN = "mlp.experts.down_proj"


def _mxfp4_type() -> Any:
    from gguf import GGMLQuantizationType

    return getattr(GGMLQuantizationType, "MXFP4", None)


def repack_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml block_mxfp4 bytes [rows, K/32 * 17] -> (weight [rows, K/2], weight_scale [rows, K/32]),
    both uint8, in libkk's MXFP4 layout."""
    rows = raw.shape[0]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES)
    scale = np.ascontiguousarray(blocks[..., 0])
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, K/32, 32], element order
    weight = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(weight.reshape(rows, -1)), scale


def _part(raw: np.ndarray, expert: int, rows: slice, part: str, name: str) -> np.ndarray:
    data = raw[expert, rows]
    if part == "weight":
        return repack_blocks(data)[0]
    scale = np.ascontiguousarray(data.reshape(data.shape[0], -1, _BLOCK_BYTES)[..., 0])
    if (scale == 0xFF).any():
        raise UnsupportedModelError(
            f"GGUF tensor {name!r} (expert {expert}) has an MXFP4 scale byte 0xFF, which ggml "
            "reads as 2^127 and libkk's MXFP4 as NaN; convert it with keep_mxfp4=False"
        )
    return scale


def _expert_sources(item: TensorPlan) -> tuple[Any, ...]:
    return (item.source, *item.more)


def packed_expert_plan(
    plan: Sequence[TensorPlan], config: dict[str, Any], path: Path
) -> list[TensorPlan] | None:
    """`plan` with gpt-oss's float expert weights replaced by per-expert MXFP4 parts, or None
    where the experts are not all MXFP4 (the float path then writes them as before)."""
    mxfp4 = _mxfp4_type()
    experts = [item for item in plan if item.hf_name.endswith((f".{_GATE_UP}", f".{_DOWN}"))]
    if mxfp4 is None or not experts:
        return None
    types = [t.tensor_type for item in experts for t in _expert_sources(item)]
    if not any(t == mxfp4 for t in types):
        return None
    if not all(t == mxfp4 for t in types):
        others = sorted({getattr(t, "name", str(t)) for t in types if t != mxfp4})
        logger.warning(
            "GGUF %s: gpt-oss expert weights are partly MXFP4 and partly %s; writing all of "
            "them dequantized to float32 instead of packed MXFP4",
            path,
            ", ".join(others),
        )
        return None
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    if hidden % _BLOCK or inter % _BLOCK:  # the GGUF could not hold them as MXFP4 otherwise
        return None
    replaced = {id(item) for item in experts}  # identity: plan items hold numpy arrays
    out: list[TensorPlan] = []
    for item in plan:
        if id(item) not in replaced:
            out.append(item)
            continue
        prefix = item.hf_name.rsplit(".", 1)[0]  # model.layers.N.mlp.experts
        if item.hf_name.endswith(_DOWN):
            projs = [("down_proj", item.source, slice(None), hidden, inter)]
        elif item.more:  # ffn_gate_exps and ffn_up_exps
            projs = [("gate_proj", item.source, slice(None), inter, hidden),
                     ("up_proj", item.more[0], slice(None), inter, hidden)]  # fmt: skip
        else:  # ffn_gate_up_exps, gate rows first
            projs = [("gate_proj", item.source, slice(0, inter), inter, hidden),
                     ("up_proj", item.source, slice(inter, None), inter, hidden)]  # fmt: skip
        for e in range(config["num_local_experts"]):
            for proj, source, rows, n, k in projs:
                for part, shape in (("weight", (n, k // 2)), ("weight_scale", (n, k // _BLOCK))):
                    raw = functools.partial(_part, expert=e, rows=rows, part=part, name=source.name)
                    out.append(
                        TensorPlan(f"{prefix}.{e}.{proj}.{part}", source, shape, 0,
                                   dtype="U8", raw=raw)
                    )  # fmt: skip
    return out
