"""Tensor-parallel checkpoint reading: each rank reads only the parts of each tensor it holds.

The model says, per checkpoint name, which ranges along one dim this rank holds
(`model.weight_slices(name)`, from the parameters' `tp_slices`). `ShardedReader.read` reads those
ranges with safetensors' `get_slice`, so the bytes of other ranks' rows are never touched:

- plain tensors: the ranges as given;
- 4-bit expert weights (`hf_quant_config.json`): the packed `weight` (two values a byte) and the
  block `weight_scale` are cut at the matching byte / block columns; a row split of CSF scales
  (`weight_scale_csf`) reads whole 16-row slabs only, so the rank's rows must be a multiple of 16
  (rows not divisible by tp * 16 are rejected);
- what cannot be cut before decoding (a column split of CSF scales, FP8 block weights,
  quantization on load) is read whole and cut after, by `slice_rest`: same weights, more bytes.

Experts kept packed (`packed_experts`: the fused 4-bit kernels at any rank count) take their parts
as read: a column split cuts the packed weight and plain scales on read, and a CSF blob cut along
its columns arrives whole, for the layer to decode and cut (`QuantFusedMoE`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from libkk.distributed import get_tp_size
from libkk.errors import ConfigError
from libkk.quant.csf import (
    HEADER_BYTES,
    SLAB_ROWS,
    CSFTensor,
    csf_slice_rows,
    packed_row_bytes,
)

Slices = list[tuple[int, int, int]]
_QUANT_PARTS = ("weight_scale_csf", "weight_scale_2", "weight_scale", "input_scale", "weight")
_GROUP = {"nvfp4": 16, "mxfp4": 32}
_CSF_HEADER = struct.Struct("<4sHBBIIII Q")


def cut(tensor: torch.Tensor, slices: Slices) -> torch.Tensor:
    """The concatenation of `tensor`'s ranges (all along one dim)."""
    parts = [tensor.narrow(dim, start, stop - start) for dim, start, stop in slices]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=slices[0][0])


class ShardedReader:
    """Reads this rank's part of each checkpoint tensor; remembers which weights were cut."""

    def __init__(
        self,
        slices_of: Callable[[str], Slices | None],
        quant: dict | None,
        presplit: bool = True,
        packed_experts: bool = False,
    ) -> None:
        self.slices_of = slices_of
        self.algo = str(quant.get("quant_algo", "")).lower() if quant else None
        self.csf = bool(quant.get("csf")) if quant else False
        # False when a later stream needs whole tensors (quantization on load, FP8 blocks).
        self.presplit = presplit
        self.packed_experts = packed_experts
        self.cut_names: set[str] = set()  # logical weight names already read as this rank's part

    def read(self, f: Any, name: str) -> torch.Tensor:
        """Reads `name` from an open safetensors file (`safe_open`): this rank's part of it."""
        logical, part = name, None
        if self.algo is not None:
            for suffix in _QUANT_PARTS:
                if name.endswith("." + suffix):
                    logical, part = name[: -len(suffix)] + "weight", suffix
                    break
        # Packed experts' parts are cut on read even when other streams need whole tensors.
        if not self.presplit and not (self.packed_experts and part is not None):
            return f.get_tensor(name)
        slices = self.slices_of(logical)
        if slices is None:
            return f.get_tensor(name)
        view = f.get_slice(name)
        if part is None or (part == "weight" and view.get_dtype() != "U8"):
            self.cut_names.add(logical)
            return _read_ranges(view, slices)
        if part in ("weight_scale_2", "input_scale") or not self._can_cut(slices, part):
            return f.get_tensor(name)  # per-tensor scalars, or cut after decoding
        self.cut_names.add(logical)
        if part == "weight_scale_csf":
            return _read_csf_rows(view, slices, name)
        if slices[0][0] == 0:  # rows of the packed weight [N, K/2] or the scales [N, K/group]
            return _read_ranges(view, slices)
        per = 2 if part == "weight" else _GROUP[self.algo]  # type: ignore[index]
        return _read_ranges(view, [(d, a // per, b // per) for d, a, b in slices])

    def _can_cut(self, slices: Slices, part: str) -> bool:
        """Whether a part of a 4-bit weight can be read cut: a row split always (CSF by whole
        slabs); a column split on scale-block boundaries, except a CSF blob's, and except any
        part of a CSF weight that a stream decodes (its parts must arrive alike)."""
        if slices[0][0] == 0:
            return True
        group = _GROUP[self.algo]  # type: ignore[index]
        aligned = all(a % group == 0 and b % group == 0 for _, a, b in slices)
        if self.packed_experts:
            return aligned and part != "weight_scale_csf"
        return aligned and not self.csf

    def slice_rest(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Cuts the weights that were read whole (decoded or quantized by a stream since); packed
        expert parts pass as they are (cut on read, or by their layer)."""
        for name, tensor in tensors:
            if self.packed_experts and _is_expert_part(name):
                yield name, tensor
                continue
            slices = None if name in self.cut_names else self.slices_of(name)
            yield name, tensor if slices is None else cut(tensor, slices).contiguous()


def _is_expert_part(name: str) -> bool:
    """A part of a per-expert 4-bit weight (`...experts.<e>.<proj>.<part>`)."""
    return ".experts." in name and name.rpartition(".")[2] in _QUANT_PARTS


def csf_split_message(what: str, rows: int, size: int) -> str:
    return (
        f"{what}: CSF scales of {rows} rows cannot be split across tensor_parallel_size={size} "
        f"ranks: each rank reads whole 16-row slabs, so the rows must be divisible by "
        f"{size}*{SLAB_ROWS}={size * SLAB_ROWS}"
    )


def check_csf_split(rows: int, what: str) -> None:
    """Rejects a tensor-parallel split of CSF scales that would cut a 16-row slab."""
    size = get_tp_size()
    if size > 1 and rows % (size * SLAB_ROWS):
        raise ConfigError(csf_split_message(what, rows, size))


def _read_ranges(view: Any, slices: Slices) -> torch.Tensor:
    parts = []
    for dim, start, stop in slices:
        index = (slice(None),) * dim + (slice(start, stop),)
        parts.append(view[index])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=slices[0][0])


def _read_csf_rows(view: Any, slices: Slices, name: str) -> torch.Tensor:
    """This rank's rows of a CSF blob (docs/csf.md), read slab by slab, as a CSF blob itself."""
    header = _CSF_HEADER.unpack(view[0:HEADER_BYTES].numpy().tobytes())
    _, _, code, _, e, r, c, _, m = header
    for _, start, stop in slices:
        if start % SLAB_ROWS or stop % SLAB_ROWS:
            raise ConfigError(csf_split_message(name, r, get_tp_size()))
    if len(slices) != 1:
        raise ConfigError(f"{name}: a CSF blob cannot be cut into several row ranges")
    if e != 1:  # several experts in one blob: read it whole, keep whole slabs
        blob = CSFTensor.from_bytes(view[:].numpy().tobytes())
        _, start, stop = slices[0]
        part = csf_slice_rows(blob, start, stop).to_bytes()
        return torch.frombuffer(bytearray(part), dtype=torch.uint8)
    _, start, stop = slices[0]
    kind = "mxfp4" if code == 0 else "nvfp4"
    p = packed_row_bytes(kind, c)
    s = r // SLAB_ROWS
    s0, s1 = start // SLAB_ROWS, stop // SLAB_ROWS
    slab_bytes = SLAB_ROWS * (1 + p)
    plane_bytes = s * slab_bytes
    plane = view[HEADER_BYTES + s0 * slab_bytes : HEADER_BYTES + s1 * slab_bytes]
    off_start = HEADER_BYTES + plane_bytes + (-(HEADER_BYTES + plane_bytes) % 8)
    prefix = np.frombuffer(view[off_start + 8 * s0 : off_start + 8 * (s1 + 1)].numpy(), "<u8")
    rec_start = off_start + 8 * (s + 1)
    first, last = int(prefix[0]), int(prefix[-1])
    if not 0 <= first <= last <= m:
        raise ConfigError(f"{name}: CSF record offsets out of range")
    words = np.frombuffer(view[rec_start + 4 * first : rec_start + 4 * last].numpy(), "<u4")
    # Records keep their value byte; positions move down by the dropped rows.
    words = (words.astype(np.int64) - start * c).astype("<u4")
    new_plane = s1 - s0
    out_plane = HEADER_BYTES + new_plane * slab_bytes
    parts = [
        _CSF_HEADER.pack(b"KCSF", 1, code, SLAB_ROWS, 1, stop - start, c, 0, last - first),
        plane.numpy().tobytes(),
        b"\0" * (-out_plane % 8),
        (prefix.astype(np.int64) - first).astype("<u8").tobytes(),
        words.tobytes(),
    ]
    blob = b"".join(parts)
    CSFTensor.from_bytes(blob)  # validates the shard as a reader of the full blob would
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
