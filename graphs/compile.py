"""torch.compile of the model forward, backed by the on-disk artifact cache.

A start with a ready entry hot-loads its torch.compile artifacts (Inductor's compiled graphs,
AOTAutograd entries, autotune results) before anything compiles, so compiling becomes cache hits.
A start without one compiles, captures, then stores what this process compiled. The entry is
keyed by the model's config.json, the graph-relevant settings and the software/GPU versions
(`artifact_key.ArtifactKey`); see artifacts.py for the locking and READY protocol.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from libkk.graphs.artifact_key import ArtifactKey, device_name_of
from libkk.graphs.artifacts import (
    ArtifactCache,
    ArtifactEntry,
    load_compile_artifacts,
    save_compile_artifacts,
)

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compile_forward(forward: Forward, backend: Callable[..., Any] | None = None) -> Forward:
    """The model forward under torch.compile with dynamic token counts.

    The model traces as one graph with each attention call an opaque op, so Inductor (the
    default backend) fuses everything between attention calls; a `PiecewiseBackend` also cuts
    the graph there to capture the pieces (graphs/piecewise.py).

    The token count is an unbacked size: one compiled graph serves every count, 1 included. A
    backed size specializes counts 0 and 1, so one-token batches (decode at batch 1) would
    compile, and load from the artifact cache, a second graph. The price: the model's Python
    may not branch on the token count while traced (kernels choose by size inside their ops).
    """
    from torch._dynamo.decorators import mark_unbacked

    _allow_recompiles_per_session()
    compiled = torch.compile(forward, dynamic=True, backend=backend or "inductor")

    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        mark_unbacked(input_ids, 0)
        mark_unbacked(positions, 0)
        return compiled(input_ids, positions)

    return run


# Compiled entries Dynamo keeps per code object. Every Session in a process compiles the same
# `forward` code again for its own model: past Dynamo's default of 8, later Sessions would run
# their forward eagerly (with a warning) instead of compiled.
MIN_RECOMPILE_LIMIT = 64


def _allow_recompiles_per_session() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if hasattr(config, name) and getattr(config, name) < MIN_RECOMPILE_LIMIT:
            setattr(config, name, MIN_RECOMPILE_LIMIT)


def artifact_entry(
    device: torch.device,
    model_config: Mapping[str, Any],
    graph_settings: Mapping[str, Any],
    cache: ArtifactCache | None = None,
) -> ArtifactEntry:
    """The entry `artifact_cache_scope` uses for these inputs (for its autotune store, which is
    usable before and whatever the compile artifacts' state)."""
    return (cache or ArtifactCache()).entry(
        ArtifactKey.build(model_config, graph_settings, device_name_of(device))
    )


@contextlib.contextmanager
def artifact_cache_scope(
    device: torch.device,
    model_config: Mapping[str, Any],
    graph_settings: Mapping[str, Any],
    model_name: str | None = None,
    cache: ArtifactCache | None = None,
) -> Iterator[str]:
    """Wraps the compile + capture of one model; yields how the entry was used:

    "loaded" (a ready entry was hot-loaded before compiling), "built" (this process compiled and
    will store the artifacts when the block ends), or "uncached" (no lock or an I/O problem:
    compile without the cache). The block must force every compile it wants stored (capture or
    warm-up calls), since torch.compile compiles lazily.
    """
    entry = artifact_entry(device, model_config, graph_settings, cache)
    start = time.perf_counter()
    if load_compile_artifacts(entry):
        yield "loaded"
        logger.info("compiled from cached artifacts in %.1f s", time.perf_counter() - start)
        return
    with entry.writer(model_name=model_name) as writer:
        if writer.reused:  # another process finished the entry while this one waited
            loaded = load_compile_artifacts(entry)
            yield "loaded" if loaded else "uncached"
            return
        yield "built" if writer.building else "uncached"
        if writer.building:
            save_compile_artifacts(writer)
    logger.info("compiled and captured in %.1f s", time.perf_counter() - start)
