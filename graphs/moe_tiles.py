"""Measured tile choices for the fused MoE kernels, kept in the artifact cache's autotune store.

kernels/moe/ runs a static tile table unless a choice is installed for a layer shape (format,
activation kind, experts, hidden, intermediate, top_k) and token bucket (a power of two). Before
the runner captures graphs, so that the graphs record the chosen tiles, `tune_moe_tiles`:

1. finds one packed MoE layer per distinct shape (W4A8 shapes too where prefill rows run FP8);
2. for every bucket from 1 up to the largest token count the runner can see, takes the choice
   recorded in the artifact entry, or the one an earlier runner of this process installed (copied
   into this entry), or else times a short candidate list (the static choice first,
   then its neighbours along one tile axis each) on that layer's real weights with synthetic
   routing, and records the fastest (one checksummed line per choice, as it finishes: a crash
   mid-tune keeps the finished ones, see autotune_store.py);
3. installs every choice.

A warm start therefore times nothing. It lives in graphs/ because it needs both the packed layers
(layers/) and the artifact entry, and graphs/ sits above layers/ and kernels/ in the import order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
from libkk.graphs.artifacts import ArtifactEntry
from libkk.kernels._jit import next_pow2
from libkk.kernels.moe import (
    DECODE_CONFIG,
    GROUP,
    PAIR_DECODE_CONFIG,
    PAIR_DECODE_NARROW,
    PAIR_MAJOR,
    PAIR_MAJOR_MAX_TOKENS,
    W4A8_PREFILL_CONFIG,
    MoeKernelError,
    MoeShape,
    MoeTileConfig,
    TileConfig,
    W4A8TileConfig,
    check_tile_config,
    default_tile_config,
    fused_moe_w4a8,
    fused_moe_w4a16,
    install_tile_choice,
    installed_tile_choices,
    token_bucket,
)
from torch import nn
from tqdm import tqdm

from libkk.layers.moe import SparseMoeBlock
from libkk.layers.quant_moe import QuantFusedMoE

logger = logging.getLogger("libkk")

# Kernel names in the autotune store (one per activation kind).
STORE_KERNELS = {"w4a16": "libkk.fused_moe_w4a16", "w4a8": "libkk.fused_moe_w4a8"}


@dataclass(frozen=True)
class TuneProblem:
    """One (layer shape, token bucket) to choose tiles for, with the layer whose weights run."""

    shape: MoeShape
    num_tokens: int
    layer: QuantFusedMoE
    dtype: torch.dtype  # the activations'


# Seconds per call of `problem` with `config`; raises if the config cannot run (compiler, memory),
# TileMismatch if it runs but computes something else.
Timer = Callable[[TuneProblem, TileConfig], float]


class TileMismatch(RuntimeError):
    """A candidate tile's output differs from the static choice's."""


@dataclass(frozen=True)
class TileChoice:
    shape: MoeShape
    bucket: int
    config: TileConfig
    # recorded: loaded from the entry; installed: already chosen by an earlier runner of this
    # process (same GPU; copied into this entry); measured: timed now.
    source: Literal["recorded", "installed", "measured"]
    seconds: float | None = None  # measured time of the choice
    static_seconds: float | None = None  # measured time of the static table's choice


def tuning_buckets(max_tokens: int) -> list[int]:
    """Token buckets to tune: every power of two from 1 up to the bucket of `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    top = token_bucket(max_tokens)
    return [1 << i for i in range(top.bit_length())]


def static_config(activations: str, num_tokens: int) -> TileConfig:
    """What kernels/moe/ runs with nothing installed."""
    return default_tile_config(num_tokens) if activations == "w4a16" else W4A8_PREFILL_CONFIG


def candidate_configs(shape: MoeShape, num_tokens: int) -> list[TileConfig]:
    """The static choice first, then its neighbours: one tile axis halved or doubled (M tiles no
    taller than the bucket needs, K steps no longer than the shorter reduction, or on the
    pair-major path each kernel's own reduction), the other warp count, one pipeline stage more
    or fewer; for W4A16 decode buckets, whose static choice is the pair-major path, gate_up
    split along K in 2 or 4, the other static pair-major tile, and the sorted path's decode
    tiles, which win once pairs share experts."""
    base = static_config(shape.activations, num_tokens)
    pair_major = isinstance(base, MoeTileConfig) and base.block_m == PAIR_MAJOR
    max_m = max(16, min(128, next_pow2(num_tokens * shape.top_k)))
    max_k = min(256, next_pow2(min(shape.hidden, shape.intermediate)))
    min_k = max(32, GROUP[shape.fmt])
    limits = {
        "block_m": (16, max_m),
        "block_n": (4 if pair_major else 16, 256),
        "block_k": (min_k, max_k),
    }
    if pair_major:  # gate_up's K is the hidden size; down has a tile of its own
        limits["block_k"] = (min_k, min(2048, next_pow2(shape.hidden)))
        limits["down_block_n"] = (4, 256)
    out: list[TileConfig] = [base]

    def fitted(config: TileConfig) -> dict[str, int]:
        """The config's fields with each K step no longer than the K it steps along."""
        fields = asdict(config)
        for name, (low, high) in limits.items():
            if fields.get(name, 0) > high:
                fields[name] = max(low, high)
        if pair_major and (fields["down_block_k"] or fields["block_k"]) > max_k:
            fields["down_block_k"] = max(min_k, max_k)
        return fields

    fields = fitted(base)

    def add(**change: int) -> None:
        cfg = type(base)(**{**fields, **change})
        if cfg not in out:
            out.append(cfg)

    add()  # the static choice fitted to K, when that differs
    for name, (low, high) in limits.items():
        if not fields.get(name):  # absent, or a down field that follows gate_up's
            continue
        for value in (fields[name] // 2, fields[name] * 2):
            if low <= value <= high:
                add(**{name: value})
    add(num_warps=8 if base.num_warps == 4 else 4)
    if pair_major and fields["down_num_warps"]:
        add(down_num_warps=8 if base.down_num_warps == 4 else 4)
    for stages in (base.num_stages - 1, base.num_stages + 1):
        if 1 <= stages <= 4 and (stages > 1 or pair_major):  # the sorted path pipelines
            add(num_stages=stages)
    if pair_major:  # a few pairs: more programs along gate_up's K
        for splits in (2, 4):
            add(split_k=splits)
        # the other token range's static pair-major tile (few rows and long K steps for gate_up
        # at one or two tokens, 32-row tiles above), which may win on either side of the line
        other = PAIR_DECODE_CONFIG if base == PAIR_DECODE_NARROW else PAIR_DECODE_NARROW
        add(**fitted(other))
    if shape.activations == "w4a16" and num_tokens <= PAIR_MAJOR_MAX_TOKENS:
        k_step = max(min_k, min(DECODE_CONFIG.block_k, max_k))
        out.append(replace(DECODE_CONFIG, block_k=k_step))
    return out


def packed_moe_problems(model: nn.Module) -> dict[MoeShape, tuple[QuantFusedMoE, torch.dtype]]:
    """One packed layer (and its activation dtype) per distinct shape; W4A8 shapes only for layers
    whose prefill rows run FP8."""
    found: dict[MoeShape, tuple[QuantFusedMoE, torch.dtype]] = {}
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock) or not isinstance(block.experts, QuantFusedMoE):
            continue
        layer = block.experts
        kinds = ("w4a16", "w4a8") if layer.fp8_prefill else ("w4a16",)
        for kind in kinds:
            shape = MoeShape(layer.weight_format, kind, layer.num_experts, layer.hidden_size,
                             layer.intermediate_size, block.top_k)  # fmt: skip
            found.setdefault(shape, (layer, _activation_dtype(model, block)))
    return found


def _activation_dtype(model: nn.Module, block: SparseMoeBlock) -> torch.dtype:
    """The dtype the experts' input has: the router's weights', unless those are quantized, then
    the model's first floating-point parameter's."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    weight = getattr(block.gate, "weight", None)
    if weight is not None and weight.dtype in dtypes:
        return weight.dtype
    return next((p.dtype for p in model.parameters() if p.dtype in dtypes), torch.bfloat16)


def store_key(shape: MoeShape, bucket: int) -> str:
    """The autotune store's key of one choice (the kernel name carries the activation kind)."""
    return (
        f"{shape.fmt}/e{shape.num_experts}/h{shape.hidden}/i{shape.intermediate}"
        f"/top{shape.top_k}/t{bucket}"
    )


def config_from_record(activations: str, record: Mapping[str, Any]) -> TileConfig | None:
    """A recorded config, or None if it does not describe a valid one (then it is re-tuned)."""
    kind = MoeTileConfig if activations == "w4a16" else W4A8TileConfig
    try:
        config = kind(**record)
        check_tile_config(activations, config)
    except (TypeError, MoeKernelError):
        return None
    return config


def tune_moe_tiles(
    model: nn.Module,
    entry: ArtifactEntry | None,
    max_tokens: int,
    *,
    timer: Timer | None = None,
    progress: bool = False,
) -> list[TileChoice]:
    """Chooses, records (in `entry`, if any) and installs tiles for every packed MoE shape of
    `model` and every bucket up to `max_tokens`; see the module docstring. `timer` defaults to
    CUDA-graph timing on the layer's device."""
    problems = packed_moe_problems(model)
    if not problems:
        return []
    buckets = tuning_buckets(max_tokens)
    recorded = entry.load_autotune() if entry is not None else {}
    installed = installed_tile_choices()
    pending: list[TuneProblem] = []
    choices: list[TileChoice] = []
    for shape, (layer, dtype) in problems.items():
        kept = recorded.get(STORE_KERNELS[shape.activations], {})
        for bucket in buckets:
            record = kept.get(store_key(shape, bucket))
            config = config_from_record(shape.activations, record) if record is not None else None
            if config is not None:
                choice = TileChoice(shape, bucket, config, "recorded")
            elif bucket in installed.get(shape, {}):
                # Another runner of this process measured it: the same GPU, so no need to time
                # it again (and a second Session runs the same tiles as the first).
                choice = TileChoice(shape, bucket, installed[shape][bucket], "installed")
                _record(entry, choice)
            else:
                pending.append(TuneProblem(shape, bucket, layer, dtype))
                continue
            choices.append(choice)
            install_tile_choice(shape, bucket, choice.config)
            _log_choice(choice)
    if pending:
        timer = timer or CudaTileTimer()
        start = time.perf_counter()
        for problem in tqdm(pending, desc="Tuning MoE tiles", disable=not progress):
            choice = _measure(problem, timer)
            if choice is None:
                continue
            _record(entry, choice)
            install_tile_choice(choice.shape, choice.bucket, choice.config)
            choices.append(choice)
            _log_choice(choice)
        logger.info(
            "tuned MoE tiles for %d (shape, token bucket) pairs in %.1f s",
            len(pending),
            time.perf_counter() - start,
        )
    return choices


def _record(entry: ArtifactEntry | None, choice: TileChoice) -> None:
    if entry is not None:
        entry.record_autotune(
            STORE_KERNELS[choice.shape.activations],
            store_key(choice.shape, choice.bucket),
            asdict(choice.config),
        )


def _measure(problem: TuneProblem, timer: Timer) -> TileChoice | None:
    """The fastest candidate of `problem`; None (logged) if none of them runs."""
    times: dict[TileConfig, float] = {}
    for config in candidate_configs(problem.shape, problem.num_tokens):
        try:
            times[config] = timer(problem, config)
        except TileMismatch as e:  # a kernel bug at this tile: never chosen, and said loudly
            logger.warning("MoE tile rejected at %d tokens: %s", problem.num_tokens, e)
        except Exception as e:  # a tile the compiler or the device refuses (shared memory)
            logger.debug("MoE tile %s fails at %d tokens: %s", config, problem.num_tokens, e)
    if not times:
        logger.warning(
            "no MoE tile candidate ran for %s at %d tokens; keeping the static table",
            problem.shape,
            problem.num_tokens,
        )
        return None
    best = min(times, key=times.__getitem__)  # ties keep the earlier (the static choice first)
    static = times.get(static_config(problem.shape.activations, problem.num_tokens))
    return TileChoice(problem.shape, problem.num_tokens, best, "measured", times[best], static)


def _log_choice(choice: TileChoice) -> None:
    s = choice.shape
    tiles = " ".join(f"{k}={v}" for k, v in asdict(choice.config).items())
    if choice.source == "recorded":
        how = "recorded"
    elif choice.source == "installed":
        how = "chosen earlier in this process"
    else:
        static = "n/a" if choice.static_seconds is None else f"{choice.static_seconds * 1e6:.1f}"
        how = f"measured {choice.seconds * 1e6:.1f} us, static choice {static} us"
    logger.info(
        "MoE tiles %s %s e%d h%d i%d top%d, %d tokens: %s (%s)",
        s.fmt, s.activations, s.num_experts, s.hidden, s.intermediate, s.top_k,
        choice.bucket, tiles, how,
    )  # fmt: skip


class CudaTileTimer:
    """Times one candidate on synthetic routing (each token picks top_k distinct experts
    uniformly, so a bucket touches about as many experts as real traffic does). W4A16 runs as
    CUDA-graph replays of `calls` back-to-back layer calls, as captured steps run it (no Python
    launch overhead); W4A8 runs eagerly, as it does in prefill steps (never graphed)."""

    def __init__(self, calls: int = 10, replays: int = 3, seed: int = 0) -> None:
        self.calls = calls
        self.replays = replays
        self.seed = seed
        self._inputs: dict[tuple[int, MoeShape, int], tuple[torch.Tensor, ...]] = {}
        self._references: dict[tuple[int, MoeShape, int], torch.Tensor] = {}

    @torch.inference_mode()
    def __call__(self, problem: TuneProblem, config: TileConfig) -> float:
        run = self._runner(problem, config)
        out = run()  # compiles the kernels; raises here for a tile that cannot run
        self._check(problem, config, out)
        torch.cuda.synchronize()

        def calls() -> None:
            for _ in range(self.calls):
                run()

        step = calls
        if problem.shape.activations == "w4a16":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                calls()
            step = graph.replay
        step()  # warm
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(self.replays):
            step()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / (self.replays * self.calls)

    def _runner(self, problem: TuneProblem, config: TileConfig) -> Callable[[], torch.Tensor]:
        layer, shape = problem.layer, problem.shape
        x, topk_weights, topk_ids, s13, s2 = self._problem_inputs(problem)
        weights = (layer.w13_weight, s13, layer.w13_weight_scale_2, layer.w2_weight, s2,
                   layer.w2_weight_scale_2)  # fmt: skip
        if shape.activations == "w4a8":
            x_scale, a_scale = layer.fp8_scales()
            return lambda: fused_moe_w4a8(x, *weights, x_scale, a_scale, topk_weights, topk_ids,
                                          shape.fmt, config)  # fmt: skip
        return lambda: fused_moe_w4a16(x, *weights, topk_weights, topk_ids, shape.fmt, config)

    def _check(self, problem: TuneProblem, config: TileConfig, out: torch.Tensor) -> None:
        """Raises TileMismatch unless `out` is the static choice's output up to the rounding a
        different summation order makes: a tile is timed only once it computes the layer."""
        key = (id(problem.layer), problem.shape, problem.num_tokens)
        if key not in self._references:
            static = static_config(problem.shape.activations, problem.num_tokens)
            self._references[key] = self._runner(problem, static)().float()
        want = self._references[key]
        error = (out.float() - want).abs().max().item() if want.numel() else 0.0
        if not error <= 2e-2 * want.abs().max().item():  # NaN fails too
            raise TileMismatch(f"{config} differs from the static choice's output by {error}")

    def _problem_inputs(self, problem: TuneProblem) -> tuple[torch.Tensor, ...]:
        key = (id(problem.layer), problem.shape, problem.num_tokens)
        if key not in self._inputs:
            self._inputs[key] = tuple(_synthetic_inputs(problem, self.seed))
        return self._inputs[key]


def _synthetic_inputs(problem: TuneProblem, seed: int) -> Iterator[torch.Tensor]:
    layer, shape, n = problem.layer, problem.shape, problem.num_tokens
    dev = layer.w13_weight.device
    gen = torch.Generator(device=dev).manual_seed(seed + n)
    yield torch.randn(n, shape.hidden, device=dev, generator=gen).to(problem.dtype)
    scores = torch.rand(n, shape.num_experts, device=dev, generator=gen)
    weights, ids = torch.topk(scores, shape.top_k, dim=-1)
    yield (weights / weights.sum(dim=-1, keepdim=True)).float()
    yield ids.to(torch.int32)
    yield from layer.scales()  # with CSF prefetch: expanded once here, not in every timed call
