"""Builds a model from a Hugging Face folder: config.json + safetensors (never pickle).

The checkpoint is one `model.safetensors` or shards listed by `model.safetensors.index.json`.
Every file is opened (header only, memory-mapped) and checked before the first weight is copied,
so a truncated file, a missing shard or an index that names absent tensors fails fast with the
file in the message. Tensors are cast to the requested dtype as they are copied into the model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from libkk.distributed import get_tp_size
from libkk.errors import (
    ConfigError,
    CorruptCheckpointError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from libkk.fsutil import read_json
from libkk.layers.quant_moe import MoeOptions, finalize_moe_layers, moe_options
from libkk.models.arch_config import ArchConfig, parse_arch_config
from libkk.models.registry import get_model_class
from libkk.models.sharded_read import ShardedReader, check_csf_split
from libkk.models.staged_read import StagedReader, TensorSpan, tensor_spans, worth_staging
from libkk.quant.checkpoint import (
    QUANT_CONFIG,
    dequantize_stream,
    fp8_block_dequantize_stream,
    fp8_block_quantize_stream,
    quant_config,
    quantize_stream,
)
from libkk.quant.csf import CorruptCSFError

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_LISTED = 20
_STACKED_HINTS = ("qkv_proj", "gate_up_proj", "w13_weight", "w2_weight")


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    moe_weight_format: str | None = None,
    quantization: str | None = None,
    csf_prefetch: bool = False,
    moe_prefill_activations: str | None = None,
) -> tuple[nn.Module, ArchConfig]:
    """Reads config.json, builds the model on `device` in `dtype` and fills every parameter.

    Raises ModelNotFoundError (folder, config.json or a shard missing; only pickle weights),
    CorruptCheckpointError (bad JSON, truncated/unreadable safetensors, shape mismatch, missing
    weights) or UnsupportedModelError (architecture or feature not implemented).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelNotFoundError(f"model folder {str(model_dir)!r} does not exist")
    config = read_arch_config(model_dir)
    shards = checkpoint_shards(model_dir)
    model_cls = get_model_class(config.architecture)
    quant = _read_quant_config(model_dir)
    if quant is not None and quant.get("csf") and config.is_moe:
        check_csf_split(config.moe_intermediate_size, "experts' gate/up projections")
    if config.mxfp4_experts and moe_weight_format is not None:
        raise ConfigError(
            f"moe_weight_format={moe_weight_format!r}: this checkpoint's experts are MXFP4 already "
            "(its quantization_config); load it without moe_weight_format"
        )
    native = "mxfp4" if config.mxfp4_experts else None
    moe = _moe_options(
        model_dir, device, moe_weight_format, csf_prefetch, moe_prefill_activations, native
    )
    with torch.device(device), _default_dtype(dtype), moe_options(moe):
        model = model_cls(config)
    model.eval()
    # Tensor parallelism: each rank reads only its part of each tensor (libkk.models.sharded_read).
    reader = None
    if get_tp_size() > 1:
        # Whole tensors for the streams that need them: FP8 blocks, and experts quantized on load
        # to be dequantized. Packed experts quantized on load quantize this rank's part.
        fp8_blocks = quantization is not None or config.fp8_block_weights
        packed = moe.weight_format is not None
        if packed and quant is None and fp8_blocks:
            raise ConfigError(
                "experts quantized on load cannot be split across tensor-parallel ranks together "
                "with FP8 block weights: quantize the checkpoint first (`libkk quantize`)"
            )
        presplit = not fp8_blocks and (moe_weight_format is None or packed)
        reader = ShardedReader(model.weight_slices, quant, presplit, packed_experts=packed)

    if config.mxfp4_experts:  # per-expert MXFP4 parts once the model converted its stacked ones
        quant = quant_config("mxfp4")
    # The streams that work on the tensors on the host before the model takes them.
    quantize_on_load = quant is None and moe_weight_format is not None
    if quantize_on_load:  # through the same path a quantized checkpoint takes
        quant = quant_config(moe_weight_format)
    dequantize = quant is not None and moe.weight_format is None  # 4-bit experts, dequantized
    fp8_dequantize = quantization == "fp8_per_block" or config.fp8_block_weights
    # Otherwise the tensors go to the device as they are read (staged_read.py), unless a rank
    # reads only its part.
    host_streams = quantize_on_load or dequantize or fp8_dequantize
    stage = torch.device(device).type == "cuda" and reader is None and not host_streams
    staged_files = stageable(shards) if stage else None
    current: list[Path] = []  # the file being read, for error messages
    total = sum(len(s.names) for s in shards)
    with (
        tqdm(
            total=total,
            desc="Loading weights",
            unit="tensor",
            file=sys.stderr,
            disable=not progress,
        ) as bar,
        StagedReader(device) if staged_files else contextlib.nullcontext() as staged,
    ):
        if staged_files:
            tensors = _staged_tensors(staged, staged_files, shards, current, bar)
        else:
            tensors = _iter_tensors(shards, current, bar, None if reader is None else reader.read)
        tensors = model.convert_checkpoint(tensors)
        if quantize_on_load:
            tensors = quantize_stream(tensors, moe_weight_format)
        if dequantize:
            tensors = dequantize_stream(tensors, quant, dtype)
        if quantization == "fp8_per_block":  # linears quantized on load, as a checkpoint holds them
            tensors = fp8_block_quantize_stream(tensors)
        if fp8_dequantize:
            tensors = fp8_block_dequantize_stream(tensors, dtype)
        if reader is not None:
            tensors = reader.slice_rest(tensors)
        kv_scales: dict[int, dict[str, float]] = {}
        tensors = _divert_kv_scales(tensors, kv_scales)
        taking: list[str] = []  # the tensor the model is taking, for error messages
        try:
            loaded = model.load_weights(_taking(tensors, taking))
        except CorruptCheckpointError as e:
            message = str(e)
            # A CSF blob is decoded where the model takes it, by code that has no tensor name.
            if isinstance(e, CorruptCSFError) and taking and repr(taking[0]) not in message:
                message = f"tensor {taking[0]!r}: {message}"
            if current and str(current[0]) not in message:
                message = f"{message} (in {current[0]})"
            if message != str(e):
                raise type(e)(message) from None
            raise

    # Optional parameters (calibrated activation scales) may be absent from a checkpoint.
    expected = {n for n, p in model.named_parameters() if not getattr(p, "optional", False)}
    missing = sorted(expected - loaded)
    if missing:
        listed = ", ".join(missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        stacked = any(s in n for n in missing for s in _STACKED_HINTS)
        hint = (
            " (a stacked parameter is missing one of its parts: qkv_proj <- q/k/v_proj, "
            "gate_up_proj <- gate/up_proj, experts.w13_weight/w2_weight <- per-expert weights)"
            if stacked
            else ""
        )
        raise CorruptCheckpointError(
            f"checkpoint in {str(model_dir)!r} lacks {len(missing)} weight(s) the model needs: "
            f"{listed}{more}{hint}"
        )
    if kv_scales:
        _apply_kv_scales(model, kv_scales, model_dir)
    finalize_moe_layers(model, moe)
    return model, config


# Per-layer FP8 KV-cache scales as vLLM / ModelOpt checkpoints name them:
# `model.layers.N.self_attn.{k,v}_scale`, `...self_attn.{k,v}_proj.{k,v}_scale`,
# `...self_attn.attn.{k,v}_scale`, and the older `...self_attn.kv_scale` (one scale for both).
_KV_SCALE = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\."
    r"(?:(?:k_proj|v_proj|attn)\.)?(?P<which>k|v|kv)_scale$"
)


def _divert_kv_scales(
    tensors: Iterator[tuple[str, torch.Tensor]], into: dict[int, dict[str, float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes tensors through, except KV-cache scales: those go to `into[layer]["k" / "v"]`."""
    for name, tensor in tensors:
        m = _KV_SCALE.search(name)
        if m is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise UnsupportedModelError(
                f"KV-cache scale {name!r} has shape {tuple(tensor.shape)}: only one scale per "
                "tensor (per layer) is supported"
            )
        value = float(tensor.float().item())
        if not (math.isfinite(value) and value > 0.0):
            raise CorruptCheckpointError(
                f"KV-cache scale {name!r} is {value!r}: it must be finite and positive"
            )
        layer = into.setdefault(int(m["layer"]), {})
        for which in ("k", "v") if m["which"] == "kv" else (m["which"],):
            layer[which] = value


def _apply_kv_scales(
    model: nn.Module, scales: dict[int, dict[str, float]], model_dir: Path
) -> None:
    """Sets each attention layer's FP8 cache scales from the checkpoint (1.0 where absent)."""
    layers = model.attention_layers()
    beyond = sorted(i for i in scales if i >= len(layers))
    if beyond:
        raise CorruptCheckpointError(
            f"checkpoint in {str(model_dir)!r} has KV-cache scales for layer(s) {beyond}, but "
            f"the model has {len(layers)} attention layers"
        )
    for i, found in scales.items():
        layers[i].set_kv_scales(found.get("k", 1.0), found.get("v", 1.0))
    logger.info(
        "KV-cache scales for %d of %d layers from the checkpoint (used by FP8 caches)",
        len(scales),
        len(layers),
    )


def _read_quant_config(model_dir: Path) -> dict | None:
    path = model_dir / QUANT_CONFIG
    if not path.is_file():
        return None
    config = read_json(path)
    if str(config.get("quant_algo", "")).upper() not in ("NVFP4", "MXFP4"):
        raise UnsupportedModelError(
            f"{str(path)!r}: quant_algo {config.get('quant_algo')!r} is not supported "
            "(supported: NVFP4, MXFP4)"
        )
    return config


def _moe_options(
    model_dir: Path,
    device: torch.device,
    moe_weight_format: str | None,
    csf_prefetch: bool,
    prefill_activations: str | None,
    native_format: str | None = None,
) -> MoeOptions:
    """4-bit experts stay packed (fused kernels) on CUDA; elsewhere they are dequantized on
    load and run the plain torch path. CSF prefetch needs one rank: a rank's down-projection
    scales are cut from decoded blobs. `native_format`: the experts' format in a checkpoint
    whose model family stores them 4-bit itself (gpt-oss: MXFP4); the model converts them."""
    quant = _read_quant_config(model_dir)
    fmt = str(quant["quant_algo"]).lower() if quant is not None else moe_weight_format
    fmt = fmt or native_format
    packed = fmt is not None and torch.device(device).type == "cuda"
    if packed and csf_prefetch and get_tp_size() > 1:
        logger.info("csf_prefetch: ignored at tensor_parallel_size > 1")
        csf_prefetch = False
    return MoeOptions(fmt if packed else None, csf_prefetch, prefill_activations)


def read_arch_config(model_dir: Path) -> ArchConfig:
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{str(path)!r} not found: a model folder needs a config.json")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{str(path)!r} must hold a JSON object")
    return parse_arch_config(raw, source=str(path))


@dataclass(frozen=True)
class Shard:
    path: Path
    names: tuple[str, ...]  # tensors to read from this file, in file order


def checkpoint_shards(model_dir: Path) -> list[Shard]:
    """Finds and validates the safetensors files of a folder; reads headers only."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    wanted: dict[Path, set[str] | None]  # None: every tensor in the file
    if index_path.is_file():
        wanted = _read_index(index_path)
    elif (model_dir / SINGLE_FILE).is_file():
        wanted = {model_dir / SINGLE_FILE: None}
    else:
        # Unindexed shards; `consolidated*` files are Mistral's own naming, not HF's.
        files = sorted(
            p for p in model_dir.glob("*.safetensors") if not p.name.startswith("consolidated")
        )
        if not files:
            pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
            found = f"; found {', '.join(pickles)}" if pickles else ""
            raise ModelNotFoundError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {str(model_dir)!r}{found} "
                "(libkk reads only safetensors weights, never pickle files)"
            )
        wanted = dict.fromkeys(files)

    shards = []
    for path, names in wanted.items():
        keys = _read_keys(path)
        if names is None:
            shards.append(Shard(path, tuple(keys)))
            continue
        absent = sorted(names - set(keys))
        if absent:
            raise CorruptCheckpointError(
                f"{str(path)!r} lacks tensor(s) that {INDEX_FILE} assigns to it: "
                f"{', '.join(absent[:_MAX_LISTED])}"
            )
        shards.append(Shard(path, tuple(k for k in keys if k in names)))
    return shards


def _read_index(index_path: Path) -> dict[Path, set[str] | None]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{str(index_path)!r} is not a valid index: {e!r}") from None
    wanted: dict[Path, set[str] | None] = {}
    for name, file in weight_map.items():
        path = index_path.parent / str(file)
        names = wanted.setdefault(path, set())
        assert names is not None
        names.add(name)
    for path in wanted:
        if not path.is_file():
            raise ModelNotFoundError(f"shard {str(path)!r} named by {INDEX_FILE} does not exist")
    return wanted


def _read_keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise CorruptCheckpointError(
            f"{str(path)!r} is not a readable safetensors file (truncated or corrupt?): {e}"
        ) from None


def stageable(shards: list[Shard]) -> list[tuple[Path, list[TensorSpan]]] | None:
    """Each file with its tensors' byte ranges, if the staged reader maps every dtype and the
    checkpoint is large enough to gain from it; else None (memory-mapped reads)."""
    spans = [tensor_spans(s.path, s.names) for s in shards]
    if any(s is None for s in spans) or not worth_staging(sum(t.nbytes for s in spans for t in s)):
        return None
    return [(s.path, sp) for s, sp in zip(shards, spans, strict=True)]


def _staged_tensors(
    staged: StagedReader,
    files: list[tuple[Path, list[TensorSpan]]],
    shards: list[Shard],
    current: list[Path],
    bar: tqdm,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, device tensor) read through `staged`; `current` names the file."""
    try:
        for f, name, tensor in staged.read(files):
            current[:] = [shards[f].path]
            yield name, tensor
            bar.update(1)
    except OSError as e:  # names the file
        raise CorruptCheckpointError(f"cannot read the checkpoint: {e}") from None
    current.clear()


def _iter_tensors(
    shards: list[Shard],
    current: list[Path],
    bar: tqdm,
    read: Callable[[Any, str], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, CPU tensor) memory-mapped from each file; `current` names the open file.
    `read(file, name)`, when given, reads a tensor instead of `get_tensor` (a rank's part)."""
    for shard in shards:
        current[:] = [shard.path]
        try:
            with safe_open(str(shard.path), framework="pt", device="cpu") as f:
                for name in shard.names:
                    try:
                        tensor = f.get_tensor(name) if read is None else read(f, name)
                    except (SafetensorError, OSError, RuntimeError) as e:
                        raise CorruptCheckpointError(
                            f"cannot read tensor {name!r} from {str(shard.path)!r}: {e}"
                        ) from None
                    except CorruptCSFError as e:  # a rank's rows of a CSF blob (sharded_read)
                        raise CorruptCSFError(
                            f"tensor {name!r} in {str(shard.path)!r}: {e}"
                        ) from None
                    yield name, tensor
                    bar.update(1)
        except (SafetensorError, OSError) as e:
            raise CorruptCheckpointError(f"cannot read {str(shard.path)!r}: {e}") from None
    current.clear()


def _taking(
    tensors: Iterator[tuple[str, torch.Tensor]], taking: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `tensors`; `taking` holds the name of the last one yielded while the model takes
    it, and is empty while the next one is read (a read error names its own tensor)."""
    iterator = iter(tensors)
    while True:
        taking.clear()
        try:
            name, tensor = next(iterator)
        except StopIteration:
            return
        taking.append(name)
        yield name, tensor


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters are created directly in `dtype` (no fp32 copy of a large model first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
