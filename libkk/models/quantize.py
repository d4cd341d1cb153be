"""Writes a copy of a checkpoint with its expert weights in a 4-bit format (`libkk quantize`)."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from libkk.models.loader import INDEX_FILE, checkpoint_shards
from libkk.quant.checkpoint import (
    FORMATS,
    QUANT_CONFIG,
    is_expert_weight,
    quant_config,
    quantize_tensor,
)

# Files of a model folder other than the weights, copied as they are.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class QuantizeReport:
    num_quantized: int  # weights written in the 4-bit format
    src_bytes: int  # weight files, before
    dst_bytes: int  # weight files, after
    scale_bytes: int  # the block scales as plain bytes
    stored_scale_bytes: int  # the block scales as stored (smaller with CSF)


def quantize_checkpoint(
    src: str | Path, dst: str | Path, fmt: str, progress: bool = True
) -> QuantizeReport:
    """Quantizes every expert weight of `src` into `dst` (a new folder), shard by shard."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    src, dst = Path(src), Path(dst)
    shards = checkpoint_shards(src)  # validates the source folder
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"destination {str(dst)!r} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    count = scale_bytes = stored_scale_bytes = 0
    weight_map: dict[str, str] = {}
    total = sum(len(s.names) for s in shards)
    with tqdm(total=total, desc="Quantizing", unit="tensor", file=sys.stderr,
              disable=not progress) as bar:  # fmt: skip
        for shard in shards:
            out: dict[str, torch.Tensor] = {}
            with safe_open(str(shard.path), framework="pt", device="cpu") as f:
                for name in shard.names:
                    tensor = f.get_tensor(name)
                    if is_expert_weight(name):
                        parts = quantize_tensor(name, tensor.float(), fmt)
                        count += 1
                        scale_bytes += tensor.numel() // quant_config(fmt)["group_size"]
                        stored_scale_bytes += sum(
                            t.numel() * t.element_size()
                            for n, t in parts.items()
                            if n.endswith((".weight_scale", ".weight_scale_csf"))
                        )
                        out.update(parts)
                    else:
                        out[name] = tensor
                    bar.update(1)
            save_file(out, str(dst / shard.path.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, shard.path.name))
    if (src / INDEX_FILE).exists():
        (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in _SIDE_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    (dst / QUANT_CONFIG).write_text(json.dumps(quant_config(fmt), indent=2))
    return QuantizeReport(
        num_quantized=count,
        src_bytes=sum(s.path.stat().st_size for s in shards),
        dst_bytes=sum((dst / s.path.name).stat().st_size for s in shards),
        scale_bytes=scale_bytes,
        stored_scale_bytes=stored_scale_bytes,
    )
