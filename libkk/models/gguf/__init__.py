"""GGUF -> Hugging Face-layout folder.

A GGUF file is read once with `gguf.GGUFReader`, every tensor is dequantized to float32 (any type
`gguf.quants.dequantize` handles: F32/F16/BF16, Q4_0..Q8_0, the K-quants, the IQ types...),
renamed from llama.cpp's names to Hugging Face's, and written as one `model.safetensors` next to a
`config.json`, a `tokenizer.json` rebuilt from the GGUF metadata, a `tokenizer_config.json` and a
`generation_config.json`. The rest of libkk then only ever reads HF-layout folders.

The exception: gpt-oss experts stored in MXFP4 (all of them) are not dequantized but repacked
into libkk's per-expert MXFP4 parts (`experts.<e>.<gate|up|down>_proj.weight` uint8 [rows, K/2]
and `.weight_scale` uint8 [rows, K/32], 4.25 bits a weight) with `quantization_config` mxfp4, so
they reach the packed kernels on CUDA as the released checkpoint's do (`mxfp4.py`). A file whose
experts are only partly MXFP4 is written all float, with a warning.

Architectures: see `arch.py` (llama incl. Mistral and Mixtral-style experts, qwen2, qwen3,
qwen3moe, phi3, gemma3, gpt-oss); a tensor that llama.cpp fused, split, stacked or shifted on
export is put back in the layout the HF checkpoint has. Tokenizers: see `tokenizer.py`
(byte-level BPE and SentencePiece).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from libkk.errors import (
    CorruptCheckpointError,
    MissingDependencyError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from libkk.models.gguf.arch import (
    SUPPORTED_ARCHITECTURES,
    TensorPlan,
    build_config,
    resolve_family,
    tensor_plan,
    unpermute_qk,
)
from libkk.models.gguf.metadata import Metadata
from libkk.models.gguf.mxfp4 import packed_expert_plan
from libkk.models.gguf.tokenizer import SUPPORTED_TOKENIZER_MODELS, build_tokenizer

__all__ = [
    "CONVERTER_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TOKENIZER_MODELS",
    "convert_gguf",
    "unpermute_qk",
]

# NOTE: bump whenever the folder written for the same GGUF changes; cached conversions keyed on it
# are then redone instead of being trusted.
CONVERTER_VERSION = 4


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    keep_mxfp4: bool = True,
) -> None:
    """Convert a GGUF into an HF-layout folder (float32 safetensors + tokenizer files).

    `keep_mxfp4`: gpt-oss experts stored in MXFP4 are written packed (per-expert MXFP4 parts,
    `quantization_config` mxfp4); False dequantizes them to float32 like every other tensor.

    Raises ModelNotFoundError (no such file), CorruptCheckpointError (truncated or unreadable file,
    missing metadata or tensors, wrong shapes) and UnsupportedModelError (architecture, tokenizer,
    quantization type or feature that libkk cannot run).
    """
    gguf = _import_gguf()
    path = Path(gguf_path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/OSError on bad files
        raise CorruptCheckpointError(
            f"cannot read GGUF file {str(path)!r} (truncated or not a GGUF file): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    meta = Metadata(reader, path)

    # Validate everything before writing anything, so a refusal is fast and leaves no files.
    arch, family = resolve_family(meta)
    config = build_config(meta, reader, arch, family)
    plan = tensor_plan(reader, config, family, path)
    packed = packed_expert_plan(plan, config, path) if keep_mxfp4 else None
    if packed is not None:
        plan = packed
        config = config | {"quantization_config": {"quant_method": "mxfp4"}}
    _check_quant_types(plan, path)
    tokenizer, tokenizer_config, generation_config = build_tokenizer(meta, config)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_safetensors(out / "model.safetensors", plan, _TensorLoader(path), progress)


def _import_gguf() -> Any:
    try:
        import gguf
        import gguf.quants  # noqa: F401  (dequantize lives here)
    except ImportError as exc:
        raise MissingDependencyError(
            "reading GGUF files needs the `gguf` package: pip install 'gguf>=0.10'"
        ) from exc
    return gguf


def _dequantizable(qtype: Any) -> bool:
    """Whether the installed gguf can turn `qtype` into floats."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    return qtype in plain or qtype in _type_traits


def _check_quant_types(plan: Sequence[TensorPlan], path: Path) -> None:
    dequantized = (item for item in plan if item.raw is None)
    for tensor in (t for item in dequantized for t in (item.source, *item.more)):
        try:
            ok = _dequantizable(tensor.tensor_type)
        except ImportError:  # gguf without `_type_traits`: the loader reports it per tensor
            return
        if not ok:
            name = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
            raise UnsupportedModelError(
                f"GGUF {str(path)!r}: tensor {tensor.name!r} uses quantization {name}, which the "
                "installed gguf package cannot dequantize"
            )


class _TensorLoader:
    """Dequantizes plan items; a stacked expert tensor is dequantized once for all its experts."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._cached: tuple[str, np.ndarray] | None = None

    def _dequantize(self, tensor: Any) -> np.ndarray:
        from gguf.quants import dequantize

        if self._cached is not None and self._cached[0] == tensor.name:
            return self._cached[1]
        try:
            data = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which "
                f"the installed gguf package cannot dequantize: {exc}"
            ) from exc
        except ValueError as exc:
            raise CorruptCheckpointError(
                f"GGUF {str(self._path)!r}: tensor {tensor.name!r} cannot be decoded: {exc}"
            ) from exc
        data = np.asarray(data, dtype=np.float32)
        self._cached = (tensor.name, data)
        return data

    def __call__(self, item: TensorPlan) -> np.ndarray:
        if item.raw is not None:
            return item.raw(item.source.data)
        if item.build is not None:
            sources = (item.source, *item.more)
            parts = [
                self._dequantize(t).reshape(shape)
                for t, shape in zip(sources, item.source_shapes, strict=True)
            ]
            return item.build(parts).reshape(item.shape)
        data = self._dequantize(item.source)
        if item.expert >= 0:
            data = data.reshape(-1, *item.shape)[item.expert]
        data = data.reshape(item.shape)
        if item.unpermute_heads:
            data = unpermute_qk(data, item.unpermute_heads)
        return data


def _write_safetensors(
    path: Path,
    plan: Sequence[TensorPlan],
    load: Callable[[TensorPlan], np.ndarray],
    progress: bool,
) -> None:
    """Stream tensors (float32, or uint8 packed parts) into one safetensors file; peak memory is
    one tensor."""
    from tqdm import tqdm

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan:
        nbytes = _DTYPES[item.dtype].itemsize * math.prod(item.shape)
        header[item.hf_name] = {
            "dtype": item.dtype,
            "shape": list(item.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        bar = tqdm(
            plan,
            desc="Converting GGUF",
            unit="tensor",
            file=sys.stderr,
            disable=not progress,
            leave=False,
        )
        for item in bar:
            data = np.ascontiguousarray(load(item), dtype=_DTYPES[item.dtype])
            if data.shape != item.shape:  # the header already promised this many bytes
                raise CorruptCheckpointError(
                    f"GGUF tensor {item.source.name!r} gave {item.hf_name} of shape "
                    f"{list(data.shape)}, expected {list(item.shape)}"
                )
            f.write(memoryview(data).cast("B"))
        f.flush()
        os.fsync(f.fileno())


_DTYPES = {"F32": np.dtype("<f4"), "U8": np.dtype(np.uint8)}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
