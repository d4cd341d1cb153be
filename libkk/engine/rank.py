"""Start-up of one rank, written once: the engine (rank 0) and every tensor-parallel worker build
their model, KV caches, proposer and runner (with its compiled forward and graphs) here.

The ranks differ in two places, which they pass in: how the KV cache is planned (rank 0 sizes it
from the memory left and tells the workers; a worker waits for that plan) and how start-up
phases are reported (rank 0 times them; a worker tells rank 0 which one it is in).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from libkk.cache.host_tables import share_embedding
from libkk.cache.kv_cache import KVGroups, allocate_kv_caches, plan_kv_groups
from libkk.config import EngineConfig
from libkk.errors import ConfigError
from libkk.layers.attention import calibrate_kv_scales_on_first_prefill
from libkk.models import loader
from libkk.models.arch_config import ArchConfig
from libkk.runtime.model_runner import ModelRunner
from libkk.spec_decode import build_proposer, runner_speculation
from libkk.spec_decode.base import Proposer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8" else dtype


@dataclass(frozen=True)
class KVPlan:
    """The KV cache every rank allocates (the same block ids on every rank)."""

    num_blocks: int
    max_model_len: int


class StartupPhases:
    """Names the phases of a start-up as they run. This one times them (rank 0): `laps` holds
    the seconds of each phase that ran, in order."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._start = time.perf_counter()
        self._begun: dict[str, float] = {}

    def begin(self, name: str) -> None:
        self._begun[name] = time.perf_counter()

    def end(self, name: str, excluding: float = 0.0) -> None:
        """Ends a phase; `excluding`: seconds of it already recorded as phases of their own."""
        seconds = time.perf_counter() - self._begun.pop(name) - excluding
        self.laps[name] = self.laps.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        yield
        self.end(name)

    def add(self, laps: dict[str, float]) -> None:
        """Phases timed elsewhere (the runner's own)."""
        for name, seconds in laps.items():
            self.laps[name] = self.laps.get(name, 0.0) + seconds

    @property
    def total(self) -> float:
        return time.perf_counter() - self._start

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.laps.items())


@dataclass
class Rank:
    """What a rank runs steps with."""

    model: nn.Module
    arch: ArchConfig
    kv_caches: list[torch.Tensor]  # per attention layer (layers of a group's place share one)
    kv_groups: KVGroups
    plan: KVPlan
    proposer: Proposer | None
    runner: ModelRunner


def build_rank(
    config: EngineConfig,
    device: torch.device,
    model_dir: Path,
    plan_kv_cache: Callable[[nn.Module, ArchConfig, KVGroups], KVPlan],
    phases: StartupPhases,
    progress: bool = False,
) -> Rank:
    """Loads this rank's part of the model, allocates its KV cache as `plan_kv_cache` says,
    then builds its proposer and runner (compiling and capturing as the config asks)."""
    dtype = resolve_dtype(config.model.dtype, device)
    with phases.phase("load weights"):
        # NOTE: looked up when called, so that a process may stand in its own loader.
        model, arch = loader.load_model(
            model_dir,
            dtype,
            device,
            progress=progress,
            moe_weight_format=config.model.moe_weight_format,
            quantization=config.model.quantization,
            csf_prefetch=config.model.csf_prefetch,
            moe_prefill_activations=config.model.moe_prefill_activations,
        )
    if config.cache.calculate_kv_scales:
        calibrate_kv_scales_on_first_prefill(model)
    if config.model.shared_host_tables:
        sched, spec = config.scheduler, config.speculative
        # The staged rows of the largest step: a token budget, or a padded decode graph.
        rows_per_seq = 1 + (spec.num_speculative_tokens if spec.method else 0)
        max_step_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs * rows_per_seq)
        share_embedding(model, model_dir, device, max_step_tokens)
    # Separate KV groups for hybrid models, unless a host tier (which copies every layer of a
    # block) keeps the blocks: docs/memory.md.
    kv_groups = plan_kv_groups(
        [layer.sliding_window for layer in model.attention_layers()],
        separate=config.cache.kv_offload_bytes is None,
    )
    plan = plan_kv_cache(model, arch, kv_groups)
    with phases.phase("allocate the KV cache"):
        tensors = allocate_kv_caches(
            kv_groups.group_size,
            plan.num_blocks,
            config.cache.block_size,
            model.num_kv_heads,  # this rank's
            arch.head_dim,
            kv_cache_dtype(config, dtype),
            device,
        )
        kv_caches = [tensors[j] for j in kv_groups.layer_tensors]
    # The proposer first: the runner captures the forward that stashes its target layers.
    proposer = None
    if config.speculative.method is not None:
        with phases.phase("build the proposer"):
            proposer = build_proposer(
                config,
                model,
                target_dir=model_dir,
                device=device,
                dtype=dtype,
                num_target_blocks=plan.num_blocks,
                progress=progress,
            )
    phases.begin("build the runner")  # graph captures report their own phases
    runner = ModelRunner(
        model,
        kv_caches,
        config.cache.block_size,
        device,
        layer_kv_groups=kv_groups.layer_groups,
        compilation=config.compilation,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=plan.max_model_len,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        progress=progress,
        speculation=runner_speculation(config, proposer),
    )
    # The runner's own phases (tile tuning, compile and capture), then what its build left.
    phases.add(runner.startup_seconds)
    phases.end("build the runner", excluding=sum(runner.startup_seconds.values()))
    return Rank(model, arch, kv_caches, kv_groups, plan, proposer, runner)
