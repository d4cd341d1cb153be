"""4-bit experts kept packed on the GPU: NVFP4/MXFP4 weights run by the fused W4A16 kernels.

Parameters of a packed layer (E experts, hidden H, intermediate I, block size G = 16 or 32):
  w13_weight         uint8 [E, 2I, H/2]  gate rows then up rows, two E2M1 codes per byte
  w13_weight_scale   uint8 [E, 2I, H/G]  scale bytes (NVFP4: E4M3, MXFP4: E8M0)
  w13_weight_scale_2 fp32  [E, 2]        NVFP4 global scale of gate and of up (MXFP4: ones buffer)
  w13_input_scale    fp32  [E, 2]        calibrated activation scales; zeros = not calibrated
  w2_weight / w2_weight_scale / w2_weight_scale_2 [E, 1] / w2_input_scale [E, 1]: the down proj
  w13_bias           [E, 2I] / w2_bias [E, H]: expert biases (`bias=True`), activation dtype
Checkpoint parts (`experts.<e>.<proj>.weight|weight_scale|weight_scale_2|input_scale|
weight_scale_csf|bias`) load by shard id (expert, part) like the bf16 experts do; the biases also
load stacked ([E, 2I] gate then up, [E, H]; shard id None). Biases and the activation
(`ExpertActivation`: SiLU or gpt-oss's clamped SwiGLU) are FusedMoE's: added after each
projection, before the activation and before the routing weight; under tensor parallelism only
rank 0 holds the down projection's bias (the ranks' partial outputs are summed).

With `csf_prefetch`, a layer keeps its scales CSF-compressed on the device (libkk.quant.csf) and a
shared prefetcher expands them into one of two preallocated buffers on a side stream, started when
the same decoder layer's attention starts and joined with a CUDA event before the experts run.
Layer n uses buffer n % 2: the side stream only starts after the main stream reached layer n's
attention, so the MoE of layer n - 2, the last reader of that buffer, has already been issued
before it on the main stream. Nothing is allocated in the replayed path.

The forward never reads a count on the host, so a packed layer can be captured in a CUDA graph.

Row types. Decode and verification rows always run W4A16 (bf16/fp16 activations: exact against
the dequantized weights). With `prefill_activations="fp8"`, calibrated input scales and a CUDA
GPU of compute capability >= 8.9, prefill rows run W4A8 (kernels/moe/w4a8.py: FP8 e4m3 activations,
one per-tensor scale per projection; not for layers with biases or another activation than SiLU,
which the W4A8 kernels do not run). The layer cannot tell a prefill row from a verification row
by itself (both are requests with several query rows), so the caller declares it: a forward run
inside `prefill_only_step()` has only prefill rows. Mixed steps are not split: they run W4A16.
The choice is made at run time, outside torch.compile's trace (an opaque op, as attention does),
and never inside a CUDA graph capture: a replay runs no Python, and captured graphs serve decode.
Per-tensor FP8 scales: the largest calibrated input scale over the layer's experts (the input is
shared by every expert before routing), converted from the checkpoint's convention
(`FP8_SCALE_PER_INPUT_SCALE`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Hashable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from libkk.distributed import get_tp_rank, get_tp_size
from libkk.errors import CorruptCheckpointError, UnsupportedModelError
from libkk.kernels._jit import INTERPRETED
from libkk.kernels.csf import csf_expand
from libkk.kernels.moe import (
    GROUP,
    SILU,
    ExpertActivation,
    fused_moe_w4a8,
    fused_moe_w4a8_ref,
    fused_moe_w4a16,
    fused_moe_w4a16_ref,
    fused_moe_w4a16_routed,
)
from libkk.layers.forward_context import get_forward_context
from libkk.layers.linear import check_shape, tp_split
from libkk.layers.registry import IndexedLayer
from libkk.quant.csf import CSFTensor, decode_csf, encode_csf

logger = logging.getLogger("libkk")

# Checkpoint part suffix -> parameter suffix
_PARTS = {
    "weight_scale_csf": "weight_scale",
    "weight_scale_2": "weight_scale_2",
    "weight_scale": "weight_scale",
    "input_scale": "input_scale",
    "bias": "bias",
}


@dataclass(frozen=True)
class MoeOptions:
    """How the MoE layers of a model being built hold and run their experts."""

    weight_format: str | None = None  # "nvfp4" | "mxfp4": packed experts; None: dense
    csf_prefetch: bool = False
    prefill_activations: str | None = None  # None | "fp8" (opt-in; see `describe`)


_OPTIONS: ContextVar[MoeOptions | None] = ContextVar("libkk_moe_options", default=None)


@contextlib.contextmanager
def moe_options(options: MoeOptions) -> Iterator[None]:
    """MoE layers constructed inside this block follow `options` (the loader sets it)."""
    token = _OPTIONS.set(options)
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def current_moe_options() -> MoeOptions:
    return _OPTIONS.get() or MoeOptions()


# Per-tensor FP8 scale (amax / 448) per unit of the checkpoint's `input_scale`. ModelOpt's NVFP4
# input_scale is the NVFP4 activation global scale, amax / (6 * 448) (activations as E2M1 x E4M3);
# MXFP4 has no activation-scale convention of its own, so an MXFP4 input_scale is read as FP8's.
FP8_SCALE_PER_INPUT_SCALE = {"nvfp4": 6.0, "mxfp4": 1.0}
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: fp8 tensor-core dots

_PREFILL_STEP: ContextVar[bool] = ContextVar("libkk_moe_prefill_step", default=False)


@contextlib.contextmanager
def prefill_only_step() -> Iterator[None]:
    """Declares that every row of the forwards run inside is a prefill row (a prompt token of a
    request verifying no drafts): packed MoE layers may then run FP8 activations (see above)."""
    token = _PREFILL_STEP.set(True)
    try:
        yield
    finally:
        _PREFILL_STEP.reset(token)


def _fp8_hardware_unsupported(device: torch.device, what: str) -> str | None:
    """Why `what` (kernels built on the hardware fp8 conversion) cannot run on `device`, or None."""
    if device.type != "cuda":
        return f"{what} need a CUDA GPU (the layer is on {device.type})"
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return f"{what} need compute capability >= 8.9 (this GPU: {cap[0]}.{cap[1]})"
    return None


def fused_w4a16_unsupported(device: torch.device) -> str | None:
    """Why the fused W4A16 kernels cannot run on `device` (the layer then dequantizes and loops
    over experts in torch), or None when they can. They decode weights through the hardware fp8
    conversion; Triton's interpreter runs them on the CPU for tests."""
    return None if INTERPRETED else _fp8_hardware_unsupported(device, "the fused kernels")


def fp8_activations_unsupported(device: torch.device) -> str | None:
    """Why FP8-activation kernels cannot run on `device`, or None when they can."""
    return _fp8_hardware_unsupported(device, "FP8 activations")


def map_expert_part_name(
    name: str, expert_weights: dict[str, tuple[str, int]]
) -> tuple[str, Hashable] | None:
    """`...experts.<e>.<proj>.<part>` -> (`...experts.<w13|w2>_<part>`, (e, part index)), for the
    quantized parts and the bias of a per-expert weight; None for any other name."""
    stem, sep, part = name.rpartition(".")
    if not sep or part not in _PARTS:
        return None
    head, _, proj = stem.rpartition(".")
    prefix, _, expert = head.rpartition(".")
    if not expert.isdigit() or not prefix.endswith(".experts") or proj not in expert_weights:
        return None
    param, index = expert_weights[proj]
    return f"{prefix}.{param.removesuffix('_weight')}_{_PARTS[part]}", (int(expert), index)


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader, shard_ids, zero: bool = False):
    data = torch.zeros(shape, dtype=dtype) if zero else torch.empty(shape, dtype=dtype)
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    p.shard_ids = shard_ids  # type: ignore[attr-defined]
    return p


def expert_biases(
    num_experts: int, hidden_size: int, intermediate_size: int, full_intermediate_size: int
) -> tuple[nn.Parameter, nn.Parameter]:
    """The experts' biases, w13_bias [E, 2I] (gate rows then up rows) and w2_bias [E, H], in the
    activation dtype (the default dtype while the model is built), for the packed and the plain
    expert layers alike. They load per expert (shard id (expert, part), as the weights do) or
    stacked; under tensor parallelism each rank reads its rows of the gate/up biases, and only
    rank 0 holds the down projection's (the ranks' partial outputs are summed)."""
    e, i = num_experts, intermediate_size
    dtype = torch.get_default_dtype()
    w13_shards = frozenset((x, j) for x in range(e) for j in (0, 1))
    w2_shards = frozenset((x, 0) for x in range(e))
    w13 = _param((e, 2 * i), dtype, functools.partial(_load_expert_bias, rows=i), w13_shards)
    w2 = _param((e, hidden_size), dtype, functools.partial(_load_expert_bias, rows=0), w2_shards)
    if get_tp_size() > 1:
        w13.tp_slices = functools.partial(_w13_bias_slices, full_intermediate_size)  # type: ignore[attr-defined]
    return w13, w2


def _load_expert_bias(
    param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: Hashable = None, *, rows: int
) -> None:
    """One bias part (shard id (expert, part); `rows` per part for gate/up, 0 for down) or the
    stacked tensor (shard id None)."""
    if not loaded.is_floating_point():
        raise CorruptCheckpointError(f"bias {name!r} is {loaded.dtype}, expected floats")
    target = param.data
    if shard_id is not None:
        expert, part = shard_id  # type: ignore[misc]
        target = target[expert]
        if rows:  # gate (part 0) or up (part 1) rows of this expert
            target = target.narrow(0, part * rows, rows)
    check_shape(name, target.shape, loaded.shape)
    if not rows and get_tp_rank() != 0:
        loaded = torch.zeros_like(loaded)  # one rank adds the down projection's bias
    target.copy_(loaded)


def _w13_bias_slices(full: int, shard_id: Hashable) -> list[tuple[int, int, int]]:
    """This rank's rows of a gate/up bias part [I] (or of a stacked [E, 2I] one: its gate rows
    and its up rows)."""
    part = tp_split(full, "moe_intermediate_size")
    if shard_id is None:
        return [(1, part.start, part.stop), (1, full + part.start, full + part.stop)]
    return [(0, part.start, part.stop)]


class QuantFusedMoE(IndexedLayer):
    """The experts of one MoE layer as packed 4-bit weights (same forward contract as FusedMoE)."""

    layer_kind = "packed_moe"

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        weight_format: str,
        options: MoeOptions | None = None,
        full_intermediate_size: int | None = None,
        bias: bool = False,
        activation: ExpertActivation = SILU,
    ) -> None:
        """intermediate_size: this rank's part of every expert's intermediate dimension (the
        whole of it at one rank); full_intermediate_size: the whole (default: the same)."""
        super().__init__()
        if weight_format not in GROUP:
            raise UnsupportedModelError(
                f"expert weight format {weight_format!r} is not supported (nvfp4, mxfp4)"
            )
        g = GROUP[weight_format]
        for what, size in (
            ("hidden_size", hidden_size),
            ("moe_intermediate_size", intermediate_size),
        ):
            if size % g or size % 32:
                raise UnsupportedModelError(
                    f"{what}={size} must be a multiple of {max(g, 32)} for {weight_format} experts"
                )
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.full_intermediate_size = full_intermediate_size or intermediate_size
        self.weight_format = weight_format
        self.activation = activation
        self.options = options or current_moe_options()
        e, h, i = num_experts, hidden_size, intermediate_size
        w13_shards = frozenset((x, j) for x in range(e) for j in (0, 1))
        w2_shards = frozenset((x, 0) for x in range(e))
        load = self._load
        self.w13_weight = _param((e, 2 * i, h // 2), torch.uint8, load, w13_shards)
        self.w13_weight_scale = _param((e, 2 * i, h // g), torch.uint8, load, w13_shards)
        self.w2_weight = _param((e, h, i // 2), torch.uint8, load, w2_shards)
        self.w2_weight_scale = _param((e, h, i // g), torch.uint8, load, w2_shards)
        if weight_format == "nvfp4":
            self.w13_weight_scale_2 = _param((e, 2), torch.float32, load, w13_shards)
            self.w2_weight_scale_2 = _param((e, 1), torch.float32, load, w2_shards)
        else:  # MXFP4 has no global scale; the kernels ignore these
            self.register_buffer(
                "w13_weight_scale_2", torch.ones(e, 2, dtype=torch.float32), persistent=False
            )
            self.register_buffer(
                "w2_weight_scale_2", torch.ones(e, 1, dtype=torch.float32), persistent=False
            )
        # Stored only when calibrated (ModelOpt writes input_scale then): optional parameters.
        self.w13_input_scale = _param((e, 2), torch.float32, load, w13_shards, zero=True)
        self.w2_input_scale = _param((e, 1), torch.float32, load, w2_shards, zero=True)
        self.w13_input_scale.optional = True  # type: ignore[attr-defined]
        self.w2_input_scale.optional = True  # type: ignore[attr-defined]
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.w13_bias, self.w2_bias = expert_biases(e, h, i, self.full_intermediate_size)
        self._prefetch: _CsfLayer | None = None
        # Settled by `settle_row_kernels` after loading: whether the fused kernels run (else the
        # torch path), and whether prefill-only steps run W4A8.
        self.fused_kernels = False
        self.fp8_prefill = False
        # With csf_prefetch: the checkpoint's CSF blobs, by (param, expert, part), so the layer's
        # compressed scales are assembled from them instead of encoded again at load.
        self._csf_blobs: dict[tuple[str, int, int], CSFTensor] = {}

    # -- loading ------------------------------------------------------------------------------

    def _load(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: Hashable = None
    ) -> None:
        if shard_id is None:
            raise UnsupportedModelError(
                f"{name!r}: stacked expert tensors cannot load into 4-bit experts; quantized "
                "experts load from per-expert checkpoint tensors (experts.<e>.<proj>.weight)"
            )
        expert, part = shard_id  # type: ignore[misc]
        is_w13 = any(param is p for p in (self.w13_weight, self.w13_weight_scale,
                                          self.w13_weight_scale_2, self.w13_input_scale))  # fmt: skip
        if param.dim() == 2:  # a per-tensor scalar: global or input scale
            if loaded.numel() != 1:
                raise CorruptCheckpointError(
                    f"tensor {name!r} has shape {tuple(loaded.shape)}, expected one value"
                )
            param.data[expert, part if is_w13 else 0] = loaded.reshape(()).float()
            return
        if name.endswith("_csf"):
            blob = CSFTensor.from_bytes(loaded.cpu().numpy().tobytes())
            if blob.kind != self.weight_format:
                raise CorruptCheckpointError(
                    f"{name!r}: CSF scales of kind {blob.kind!r} in {self.weight_format} experts"
                )
            if self.options.csf_prefetch:
                key = "w13" if is_w13 else "w2"
                self._csf_blobs[(key, expert, part)] = blob
            loaded = decode_csf(blob)[0]
        elif loaded.dtype == torch.float8_e4m3fn:
            loaded = loaded.view(torch.uint8)
        if loaded.dtype != torch.uint8:
            raise CorruptCheckpointError(
                f"tensor {name!r} is {loaded.dtype}; packed {self.weight_format} expert weights "
                "and scales are uint8 (or float8_e4m3fn scales)"
            )
        target = param.data[expert]
        if is_w13:
            rows = self.intermediate_size
            target = target.narrow(0, part * rows, rows)
        else:
            per_column = 2 if param is self.w2_weight else GROUP[self.weight_format]
            loaded = self._own_columns(loaded, per_column)
        check_shape(name, target.shape, loaded.shape)
        target.copy_(loaded)

    def _own_columns(self, loaded: torch.Tensor, per_column: int) -> torch.Tensor:
        """This rank's columns of a down-projection part that arrived whole (`per_column`
        intermediate elements a column: 2 for packed bytes, the block size for scales). Under
        tensor parallelism the reader cannot cut a CSF blob along its columns; the layer cuts
        it once decoded."""
        full, local = self.full_intermediate_size, self.intermediate_size
        if full == local or loaded.shape[-1] != full // per_column:
            return loaded
        return loaded.narrow(-1, get_tp_rank() * local // per_column, local // per_column)

    # -- running ------------------------------------------------------------------------------

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 scales, w2 scales) for this forward: the parameters, or the prefetched buffers."""
        if self._prefetch is None:
            return self.w13_weight_scale, self.w2_weight_scale
        return self._prefetch.take()

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if not self.fp8_prefill:
            return self.run_experts(hidden, topk_weights, topk_ids, fp8=False)
        if torch.compiler.is_compiling():  # decide per step at run time, not at trace time
            return torch.ops.libkk.packed_moe_by_row_type(
                hidden, topk_weights, topk_ids, self.layer_key
            )
        return self.run_experts(hidden, topk_weights, topk_ids, fp8=self.step_runs_fp8(hidden))

    def step_runs_fp8(self, hidden: torch.Tensor) -> bool:
        """W4A8 for this forward: enabled for the layer, a declared prefill-only step, and not
        being captured into a CUDA graph (a replay could be any step)."""
        if not (self.fp8_prefill and _PREFILL_STEP.get()):
            return False
        return not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())

    def leaves_topk_sum(self) -> bool:
        """Whether `routed_outputs` serves this forward: the fused W4A16 kernels, nothing else
        (no torch fallback, no W4A8 prefill rows)."""
        return self.fused_kernels and not self.fp8_prefill

    def routed_outputs(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # [num_tokens, top_k, hidden]
        """forward before its top-k sum, for a consumer that sums the terms itself (the next
        residual add and norm: `add_rms_norm`); only where `leaves_topk_sum`."""
        return fused_moe_w4a16_routed(
            hidden, *self._weights(), topk_weights, topk_ids, self.weight_format,
            **self._expert_options(),
        )  # fmt: skip

    def _expert_options(self) -> dict:
        """The W4A16 ops' keyword options: biases and activation."""
        return dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias, activation=self.activation)

    def _weights(self) -> tuple[torch.Tensor, ...]:
        s13, s2 = self.scales()
        return (self.w13_weight, s13, self.w13_weight_scale_2, self.w2_weight, s2,
                self.w2_weight_scale_2)  # fmt: skip

    def run_experts(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        fp8: bool,
    ) -> torch.Tensor:
        weights = self._weights()
        kernels = self.fused_kernels  # else: dequantize and loop over experts in torch
        if fp8:
            x_scale, a_scale = self.fp8_scales()
            args = (hidden, *weights, x_scale, a_scale, topk_weights, topk_ids, self.weight_format)
            return fused_moe_w4a8(*args) if kernels else fused_moe_w4a8_ref(*args)
        args = (hidden, *weights, topk_weights, topk_ids, self.weight_format)
        w4a16 = fused_moe_w4a16 if kernels else fused_moe_w4a16_ref
        return w4a16(*args, **self._expert_options())

    def fp8_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tensor FP8 scales ([1] fp32 each, on the device) of the experts' input and of the
        down projection's input: the largest calibrated scale over the experts."""
        factor = FP8_SCALE_PER_INPUT_SCALE[self.weight_format]
        return (
            (self.w13_input_scale.amax() * factor).reshape(1),
            (self.w2_input_scale.amax() * factor).reshape(1),
        )

    def input_scales_calibrated(self) -> bool:
        return bool((self.w13_input_scale > 0).all()) and bool((self.w2_input_scale > 0).all())

    def prefill_fp8_blocker(self) -> str | None:
        """Why prefill rows cannot run FP8 activations, or None when they can."""
        if self.options.prefill_activations != "fp8":
            return "FP8 activations not requested"
        if self.w13_bias is not None or self.activation != SILU:
            return (
                "FP8 activations requested but the W4A8 kernels run neither expert biases nor "
                f"another activation than SiLU (this layer: bias={self.w13_bias is not None}, "
                f"activation={self.activation.kind})"
            )
        if not self.input_scales_calibrated():
            return "FP8 activations requested but the layer has no calibrated input scales"
        return fp8_activations_unsupported(self.w13_weight.device)

    def settle_row_kernels(self) -> None:
        """After loading (scales in place, layer on its device): whether the fused kernels run and
        whether prefill-only steps may run W4A8. Reads the input scales on the host, so it runs
        once, not per forward."""
        self.fused_kernels = fused_w4a16_unsupported(self.w13_weight.device) is None
        self.fp8_prefill = self.fused_kernels and self.prefill_fp8_blocker() is None

    def describe(self) -> str:
        """What each row type runs, for the start-up log."""
        fmt = self.weight_format.upper()
        w4 = f"W4A16 ({fmt} weights, bf16/fp16 activations)"
        unsupported = fused_w4a16_unsupported(self.w13_weight.device)
        if unsupported is not None:
            return f"all rows: {fmt} experts dequantized in torch ({unsupported})"
        blocker = self.prefill_fp8_blocker()
        if blocker is not None:
            prefill = f"{w4}; {blocker}"
        else:
            prefill = (
                f"W4A8 ({fmt} weights, FP8 e4m3 activations with per-tensor input scales) in "
                f"steps declared prefill-only, outside CUDA graphs; {w4} otherwise"
            )
        csf = ", scales CSF-prefetched" if self._prefetch is not None else ""
        return f"decode/verify rows: {w4}; prefill rows: {prefill}{csf}"

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, format={self.weight_format}, "
            f"bias={self.w13_bias is not None}, activation={self.activation.kind}"
        )


@torch.library.custom_op("libkk::packed_moe_by_row_type", mutates_args=())
def _packed_moe_by_row_type(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_key: int
) -> torch.Tensor:
    layer = get_forward_context().layers.get(QuantFusedMoE.layer_kind, layer_key)
    fp8 = layer.step_runs_fp8(hidden)
    return layer.run_experts(hidden, topk_weights, topk_ids, fp8=fp8)


@_packed_moe_by_row_type.register_fake
def _(hidden, topk_weights, topk_ids, layer_key):
    return torch.empty_like(hidden)


# --------------------------------------------------------------------------------------------------
# CSF prefetch


@dataclass
class _CsfPlanes:
    kind: str
    base: torch.Tensor
    offsets: torch.Tensor
    records: torch.Tensor
    record_offsets: torch.Tensor

    @classmethod
    def from_tensor(cls, t: CSFTensor, device: torch.device) -> _CsfPlanes:
        return cls(
            t.kind,
            t.base.to(device),
            t.offsets.to(device),
            t.records.to(device),
            t.record_offsets.to(device),
        )

    def expand(self, out: torch.Tensor) -> None:
        csf_expand(self.kind, self.base, self.offsets, self.records, self.record_offsets, out)


def _merge_csf(blocks_by_expert: list[list[CSFTensor]], kind: str) -> CSFTensor:
    """One [E, R, C] CSF tensor from per-expert row blocks ([1, r_i, C] each, in row order):
    planes concatenate, each block's record positions move down by the rows before it."""
    bases, offsets, records, counts = [], [], [], []
    rows = 0
    cols = blocks_by_expert[0][0].shape[2]
    for blocks in blocks_by_expert:
        rows = 0
        for t in blocks:
            if t.shape[0] != 1 or t.shape[2] != cols or t.kind != kind:
                raise CorruptCheckpointError(
                    f"CSF expert scales of shape {t.shape} / kind {t.kind!r} do not stack with "
                    f"[1, rows, {cols}] {kind!r} blocks"
                )
            bases.append(t.base[0])
            offsets.append(t.offsets[0])
            word = (t.records.to(torch.int64) & 0xFFFFFFFF) + rows * cols  # position field only
            records.append(torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32))
            counts.append(t.record_offsets[1:] - t.record_offsets[:-1])
            rows += t.shape[1]
    e = len(blocks_by_expert)
    if rows * cols > 1 << 24:
        raise UnsupportedModelError(f"CSF: {rows} x {cols} scales exceed the 24-bit positions")
    cnt = torch.cat(counts)
    record_offsets = torch.zeros(cnt.numel() + 1, dtype=torch.int64)
    torch.cumsum(cnt, 0, out=record_offsets[1:])
    return CSFTensor(
        1,
        kind,
        (e, rows, cols),
        torch.cat(bases).reshape(e, rows),
        torch.cat(offsets).reshape(e, rows, -1),
        torch.cat(records),
        record_offsets,
    )


def layer_csf_planes(layer: QuantFusedMoE, device: torch.device) -> tuple[_CsfPlanes, _CsfPlanes]:
    """The layer's (w13, w2) compressed scales on `device`: assembled from the checkpoint's CSF
    blobs when it had them for every (expert, projection), otherwise encoded from the scales."""
    kind = layer.weight_format
    planes = []
    for key, parts, scales in (
        ("w13", 2, layer.w13_weight_scale),
        ("w2", 1, layer.w2_weight_scale),
    ):
        blobs = layer._csf_blobs
        keys = [[(key, x, j) for j in range(parts)] for x in range(layer.num_experts)]
        if all(k in blobs for row in keys for k in row):
            t = _merge_csf([[blobs[k] for k in row] for row in keys], kind)
        else:
            t = encode_csf(scales.data.cpu(), kind)
        planes.append(_CsfPlanes.from_tensor(t, device))
    layer._csf_blobs = {}
    return planes[0], planes[1]


class _CsfLayer:
    """One packed layer's compressed scales and its pair of events."""

    def __init__(self, owner: CsfPrefetcher, layer: QuantFusedMoE, slot: int) -> None:
        dev = layer.w13_weight.device
        self.owner = owner
        self.slot = slot
        self.w13, self.w2 = layer_csf_planes(layer, dev)
        self.ready = torch.cuda.Event()
        self.done = torch.cuda.Event()
        self.pending = False

    def start(self) -> None:
        """Expand this layer's scales on the side stream once the main stream gets here."""
        main = torch.cuda.current_stream()
        self.ready.record(main)
        side = self.owner.stream
        side.wait_event(self.ready)
        b13, b2 = self.owner.buffers[self.slot]
        with torch.cuda.stream(side):
            self.w13.expand(b13)
            self.w2.expand(b2)
            self.done.record(side)
        self.pending = True

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        b13, b2 = self.owner.buffers[self.slot]
        if self.pending:
            torch.cuda.current_stream().wait_event(self.done)
            self.pending = False
        else:  # no prefetch was started (no hook ran): expand in line, on this stream
            self.w13.expand(b13)
            self.w2.expand(b2)
        return b13, b2


class CsfPrefetcher:
    """The side stream and the two scale buffers shared by every packed layer of a model."""

    def __init__(self, layers: list[QuantFusedMoE]) -> None:
        first = layers[0]
        dev = first.w13_weight.device
        shapes = {(tuple(m.w13_weight_scale.shape), tuple(m.w2_weight_scale.shape)) for m in layers}
        if len(shapes) != 1:
            raise UnsupportedModelError(
                f"csf_prefetch needs every MoE layer to have the same scale shapes, got {shapes}"
            )
        ((s13, s2),) = shapes
        self.stream = torch.cuda.Stream(device=dev)
        self.buffers = [
            (torch.empty(s13, dtype=torch.uint8, device=dev),
             torch.empty(s2, dtype=torch.uint8, device=dev))
            for _ in range(2)
        ]  # fmt: skip
        for n, layer in enumerate(layers):
            prefetch = _CsfLayer(self, layer, n % 2)
            # Checked once at load: the compressed scales expand to exactly the loaded ones.
            b13, b2 = self.buffers[prefetch.slot]
            prefetch.w13.expand(b13)
            prefetch.w2.expand(b2)
            if not (
                torch.equal(b13, layer.w13_weight_scale) and torch.equal(b2, layer.w2_weight_scale)
            ):
                raise CorruptCheckpointError("CSF scales do not expand to the loaded scales")
            layer._prefetch = prefetch
            # The expanded scales now live in the shared buffers only.
            empty = torch.empty(0, dtype=torch.uint8, device=dev)
            layer.w13_weight_scale.data = empty
            layer.w2_weight_scale.data = empty.clone()


def finalize_moe_layers(model: nn.Module, options: MoeOptions) -> list[str]:
    """After loading: set up CSF prefetch (CUDA, packed experts), settle which kernels each row
    type runs, and log one line per MoE layer naming them. Returns the logged lines."""
    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantFusedMoE)]
    if options.csf_prefetch and packed:
        if packed[0][1].w13_weight.device.type == "cuda":
            CsfPrefetcher([m for _, m in packed])
            _install_prefetch_hooks(model)
        else:
            logger.info("csf_prefetch: ignored on %s (CUDA only)", packed[0][1].w13_weight.device)
            for _, m in packed:
                m._csf_blobs = {}
    lines = []
    for name, module in model.named_modules():
        if isinstance(module, QuantFusedMoE):
            module.settle_row_kernels()
            lines.append(f"MoE {name}: {module.describe()}")
        elif type(module).__name__ == "FusedMoE":
            dtype = module.w13_weight.dtype
            extra = ""
            if options.prefill_activations == "fp8":
                extra = "; FP8 activations need packed 4-bit experts on CUDA"
            lines.append(
                f"MoE {name}: all rows run {str(dtype).removeprefix('torch.')} experts "
                f"(plain torch path){extra}"
            )
    for line in lines:
        logger.info("%s", line)
    return lines


def _install_prefetch_hooks(model: nn.Module) -> None:
    """Start each packed layer's scale expansion when its decoder layer's attention starts."""
    for module in model.modules():
        experts = getattr(getattr(module, "mlp", None), "experts", None)
        attn = getattr(module, "self_attn", None)
        if isinstance(experts, QuantFusedMoE) and attn is not None and experts._prefetch:
            prefetch = experts._prefetch
            attn.register_forward_pre_hook(lambda _m, _a, _p=prefetch: _p.start())
