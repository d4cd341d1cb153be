"""4-bit expert weights in a checkpoint: how they are named, written and read back.

A quantized checkpoint carries `hf_quant_config.json` ({"quant_algo": "NVFP4" | "MXFP4",
"group_size": 16 | 32, "csf": bool}) and, for each quantized `X.weight`:

- NVFP4 (ModelOpt names): `X.weight` uint8 [N, K/2], `X.weight_scale` float8_e4m3fn [N, K/16],
  `X.weight_scale_2` fp32 [];
- MXFP4: `X.weight` uint8 [N, K/2], `X.weight_scale` uint8 [N, K/32] (E8M0);
- with CSF, `X.weight_scale` is replaced by `X.weight_scale_csf`: the scale bytes as one CSF blob
  (docs/csf.md) in a uint8 [bytes] tensor. Decoding is bit-exact, so a CSF checkpoint loads the
  same weights as the uncompressed one.

Only expert weights (`...experts.<e>.<proj>.weight`) are quantized; everything else is stored as is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from libkk.errors import CorruptCheckpointError
from libkk.quant.csf import CSFTensor, decode_csf, encode_csf
from libkk.quant.formats import (
    FP8_BLOCK,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)

QUANT_CONFIG = "hf_quant_config.json"
FORMATS = ("nvfp4", "mxfp4", "nvfp4-csf", "mxfp4-csf")
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_GROUP = {"nvfp4": 16, "mxfp4": 32}
_LINEAR_WEIGHT = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
# config.json's quantization_config of an FP8 per-block checkpoint (the DeepSeek-V3 / Qwen3-FP8
# convention): `X.weight` float8_e4m3fn, `X.weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)],
# the value being weight * weight_scale_inv per block.
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK] * 2}


def is_fp8_block_config(config: Mapping[str, object]) -> bool:
    return config.get("quant_method") == "fp8" and list(
        config.get("weight_block_size") or []  # type: ignore[call-overload]
    ) == [FP8_BLOCK, FP8_BLOCK]


def fp8_block_quantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of an FP8 per-block checkpoint: every linear weight as e4m3 + block scales."""
    for name, tensor in tensors:
        if _LINEAR_WEIGHT.search(name) is None or tensor.dtype == torch.float8_e4m3fn:
            yield name, tensor
            continue
        weight, scale = quantize_fp8_block(tensor.float())
        yield name, weight
        yield f"{name}_scale_inv", scale


def fp8_block_dequantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Replaces each (e4m3 `X.weight`, `X.weight_scale_inv`) pair by the dequantized weight."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if name.endswith(".weight_scale_inv"):
            key, part = name.removesuffix("_scale_inv"), "scale"
        elif name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
            key, part = name, "weight"
        else:
            yield name, tensor
            continue
        parts = pending.setdefault(key, {})
        parts[part] = tensor
        if len(parts) == 2:
            del pending[key]
            yield key, dequantize_fp8_block(parts["weight"], parts["scale"], dtype=dtype)
    if pending:
        raise CorruptCheckpointError(
            f"FP8 weights without their scales (or scales without weights): "
            f"{', '.join(sorted(pending)[:5])}"
        )


def is_expert_weight(name: str) -> bool:
    return _EXPERT_WEIGHT.search(name) is not None


def quant_config(fmt: str) -> dict[str, object]:
    algo, _, csf = fmt.partition("-")
    return {"quant_algo": algo.upper(), "group_size": _GROUP[algo], "csf": csf == "csf"}


def quantize_tensor(name: str, weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors that stand for one weight [N, K] in format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    prefix = name.removesuffix("weight")
    algo, _, csf = fmt.partition("-")
    if algo == "nvfp4":
        q = quantize_nvfp4(weight)
        out = q.state_dict(prefix)
        scale_bytes = q.weight_scale.view(torch.uint8)
    else:
        q = quantize_mxfp4(weight)
        out = {f"{prefix}weight": q.weight, f"{prefix}weight_scale": q.scale}
        scale_bytes = q.scale
    if csf:
        del out[f"{prefix}weight_scale"]
        blob = encode_csf(scale_bytes[None], algo).to_bytes()  # one expert: [1, N, K / group]
        out[f"{prefix}weight_scale_csf"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out


def quantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a checkpoint quantized to `fmt` would hold: expert weights are replaced by
    their quantized parts (what `libkk quantize` writes), everything else passes through."""
    for name, tensor in tensors:
        if is_expert_weight(name):
            yield from quantize_tensor(name, tensor.float(), fmt).items()
        else:
            yield name, tensor


def dequantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: Mapping[str, object],
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the checkpoint's tensors with every quantized weight replaced by its dequantized
    [N, K] `dtype` tensor (under `X.weight`). The parts of one weight may come in any order."""
    algo = str(config.get("quant_algo", "")).lower()
    if algo not in _GROUP:
        raise ValueError(f"{QUANT_CONFIG}: unsupported quant_algo {config.get('quant_algo')!r}")
    needed = {"weight", "weight_scale"} | ({"weight_scale_2"} if algo == "nvfp4" else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, part = _split(name)
        if part is None or (part == "weight" and tensor.dtype != torch.uint8):
            yield name, tensor
            continue
        if part == "input_scale":
            continue  # activation scales: for quantized activations, not used by this path
        if part == "weight_scale_csf":
            part, tensor = "weight_scale", _decode_scale(name, tensor, algo)
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if needed <= parts.keys():
            del pending[prefix]
            yield f"{prefix}weight", _dequantize(algo, parts, dtype)
    if pending:
        raise CorruptCheckpointError(
            f"quantized weights with missing parts: {', '.join(sorted(pending)[:5])} "
            f"(each needs {', '.join(sorted(needed))})"
        )


def _split(name: str) -> tuple[str, str | None]:
    for part in ("weight_scale_csf", "weight_scale_2", "weight_scale", "input_scale", "weight"):
        if name.endswith("." + part):
            return name[: -len(part)], part
    return name, None


def _decode_scale(name: str, blob: torch.Tensor, algo: str) -> torch.Tensor:
    t = CSFTensor.from_bytes(blob.numpy().tobytes(), name)
    if t.kind != algo:
        raise CorruptCheckpointError(
            f"tensor {name!r}: CSF scales of kind {t.kind!r} in a {algo} checkpoint"
        )
    scales = decode_csf(t)[0]  # [N, K / group]
    return scales.view(torch.float8_e4m3fn) if algo == "nvfp4" else scales


def _dequantize(algo: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if algo == "nvfp4":
        return dequantize_nvfp4(
            parts["weight"], parts["weight_scale"], parts["weight_scale_2"], dtype=dtype
        )
    return dequantize_mxfp4(parts["weight"], parts["weight_scale"], dtype=dtype)
