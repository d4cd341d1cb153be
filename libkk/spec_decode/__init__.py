"""Speculative decoding proposers and their registry.

`make_proposer(config, target_model, ...)` picks the proposer class by `config.method`. Entries are
imported lazily, so a drafter whose module is missing (or needs a missing dependency) fails with a
ConfigError that names it, only when it is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from libkk.errors import ConfigError
from libkk.spec_decode.adaptive import MAX_PROFILED_REQUESTS

if TYPE_CHECKING:
    from libkk.config import EngineConfig
    from libkk.spec_decode.base import Proposer
    from libkk.spec_decode.vocab_parallel import ShardDrafts

# method -> "module:factory". Factories in this module take (config, target_model, **context);
# the DFlash proposer takes (config, target_model, device, dtype).
_REGISTRY: dict[str, str] = {
    "ngram": "libkk.spec_decode:_make_ngram",
    "draft_model": "libkk.spec_decode:_make_draft_model",
    "dflash": "libkk.spec_decode.dflash:DFlashProposer",
}


def register_proposer(method: str, target: str) -> None:
    """Adds or replaces a registry entry ("package.module:factory")."""
    _REGISTRY[method] = target


def make_proposer(
    config: EngineConfig,
    target_model: nn.Module,
    *,
    target_dir: Path | None = None,
    draft_dir: Path | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    num_blocks: int = 256,
    progress: bool = False,
) -> Proposer:
    """The proposer for `config.speculative.method` (which must be set).

    target_dir: the target's checkpoint folder (tokenizer checks); draft_dir: the resolved drafter
    folder (config.draft_model after GGUF conversion); num_blocks/block_size: the drafter's own
    KV pool.
    """
    method = config.speculative.method
    if method is None:
        raise ConfigError("make_proposer needs a speculative method, got method=None")
    target = _REGISTRY.get(method)
    if target is None:
        raise ConfigError(
            f"unknown speculative method {method!r}; known methods: {', '.join(sorted(_REGISTRY))}"
        )
    module_name, attr = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"speculative method {method!r} needs {module_name} ({attr}), which cannot be "
            f"imported: {e}"
        ) from None
    factory: Callable[..., Proposer] | None = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"speculative method {method!r}: {module_name} has no {attr}")
    device = device or torch.device("cpu")
    if method == "dflash":
        # The DFlash drafter builds itself from the engine config (speculative.draft_model,
        # cache.block_size), sharing the target's embedding and LM head.
        return factory(config, target_model, device, dtype)
    return factory(
        config,
        target_model,
        target_dir=target_dir,
        draft_dir=draft_dir,
        device=device,
        dtype=dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        progress=progress,
    )


def build_proposer(
    config: EngineConfig,
    target_model: nn.Module,
    *,
    target_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    num_target_blocks: int,
    progress: bool = False,
) -> Proposer | None:
    """The engine's proposer, None without speculation. Every tensor-parallel rank builds the
    same one (a model drafter's forward runs collectives, so all ranks draft in step)."""
    spec = config.speculative
    if spec.method is None:
        return None
    draft_dir = None
    if spec.method == "draft_model" and spec.draft_model is not None:
        from libkk.models.default import resolve_model_path

        draft_dir = resolve_model_path(spec.draft_model, progress=progress)
    block_size = config.cache.block_size
    lookahead_blocks = -(-spec.num_speculative_tokens // block_size) + 1
    return make_proposer(
        config,
        target_model,
        target_dir=target_dir,
        draft_dir=draft_dir,
        device=device,
        dtype=dtype,
        block_size=block_size,
        # The drafter holds what the target holds, plus each request's draft lookahead.
        num_blocks=num_target_blocks + config.scheduler.max_num_seqs * lookahead_blocks,
        progress=progress,
    )


# The drafts of a look: the draft backoff's probe of a request whose drafts did not pay
# (libkk/engine/speculation.py, DraftBackoff).
LOOK_DRAFTS = 1


@dataclass(frozen=True)
class RunnerSpeculation:
    """What the target's model runner needs to verify a proposer's drafts (the defaults: no
    speculation)."""

    aux_layers: tuple[int, ...] = ()  # target layers whose hidden states each step returns
    query_lens: tuple[int, ...] = (1,)  # tokens per request of the captured graphs
    # Lengths between the shortest and the longest: graphs of up to this many requests only.
    middle_lens_max_size: int | None = None
    synthetic_rates: list[float] | None = None  # benchmarks: accept at these rates
    # Vocab-parallel drafting: this rank's proposer's kept shards of sampled drafts' logits, by
    # request; the runner then verifies from its vocabulary shard (every rank alike).
    shard_drafts: dict[str, ShardDrafts] | None = None


def runner_speculation(config: EngineConfig, proposer: Proposer | None) -> RunnerSpeculation:
    if proposer is None:
        return RunnerSpeculation()
    spec = config.speculative
    synthetic = spec.rejection_sample_method == "synthetic"
    # The backoff runs in one process only (engine/speculation.py, build_speculation).
    backs_off = spec.draft_backoff and config.parallel.tensor_parallel_size == 1
    looks = {1 + LOOK_DRAFTS} if backs_off else set()
    return RunnerSpeculation(
        aux_layers=tuple(proposer.target_layer_ids),
        # Verification batches (up to 1 + K tokens per request) replay graphs too; adaptive
        # verification shortens them, so every length gets a graph; the draft backoff's looks
        # verify LOOK_DRAFTS (a batch of looks would pad to 1 + K otherwise).
        query_lens=(
            tuple(range(1, 2 + spec.num_speculative_tokens))
            if spec.adaptive_verification
            else tuple(sorted({1, 1 + spec.num_speculative_tokens} | looks))
        ),
        middle_lens_max_size=MAX_PROFILED_REQUESTS,
        synthetic_rates=spec.synthetic_acceptance_rates if synthetic else None,
        shard_drafts=proposer.shard_drafts if getattr(proposer, "vocab_parallel", False) else None,
    )


def _make_ngram(config: EngineConfig, target_model: nn.Module, **_: Any) -> Proposer:
    from libkk.spec_decode.ngram import NgramProposer

    spec = config.speculative
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _make_draft_model(
    config: EngineConfig,
    target_model: nn.Module,
    *,
    target_dir: Path | None,
    draft_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    num_blocks: int,
    progress: bool,
) -> Proposer:
    from libkk.spec_decode.draft_model import DraftModelProposer

    spec = config.speculative
    if draft_dir is None:
        if spec.draft_model is None:
            raise ConfigError("speculative method 'draft_model' needs draft_model")
        draft_dir = Path(spec.draft_model)
    return DraftModelProposer.load(
        draft_dir,
        target_dir=target_dir,
        target_vocab_size=target_model.vocab_size,
        num_speculative_tokens=spec.num_speculative_tokens,
        probabilistic=spec.draft_sampling == "probabilistic",
        num_blocks=num_blocks,
        block_size=block_size,
        device=device,
        dtype=dtype,
        progress=progress,
    )
