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
    PRECOMPILED_FORWARD,
    ArtifactCache,
    ArtifactEntry,
    load_compile_artifacts,
    save_compile_artifacts,
)
from torch import nn

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CompiledForward:
    """`model.forward(input_ids, positions)` under torch.compile with dynamic token counts.

    The model traces as one graph with each attention call an opaque op, so Inductor (the
    default backend) fuses everything between attention calls; a `PiecewiseBackend` also cuts
    the graph there to capture the pieces (graphs/piecewise.py).

    The token count is an unbacked size: one compiled graph serves every count, 1 included. A
    backed size specializes counts 0 and 1, so one-token batches (decode at batch 1) would
    compile, and load from the artifact cache, a second graph. The price: the model's Python
    may not branch on the token count while traced (kernels choose by size inside their ops).

    With a named backend ("inductor") and `precompile`, the first call compiles ahead of time
    (torch's `aot_compile`): Dynamo's bytecode, guards and the backend's output become one
    serializable function. `dump` gives its bytes for the artifact cache and `load` restores
    it, so a warm start skips Dynamo's trace of the model (seconds for a large model). A model
    that cannot be precompiled (a graph break, a value torch cannot serialize) or a call its
    guards reject falls back to plain torch.compile, logged.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: str | Callable[..., Any] | None = None,
        precompile: bool = True,
    ) -> None:
        self.model = model
        self._backend = backend or "inductor"
        # Created at first use: torch.compile's imports take seconds, and a warm start that
        # loads the precompiled function never needs it.
        self._compiled: Forward | None = None
        self._can_precompile = precompile and isinstance(self._backend, str)
        self.precompiled: Any = None  # torch's AOTCompiledFunction, once compiled or loaded

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.precompiled is None and self._can_precompile:
            self._precompile(input_ids, positions)
        if self.precompiled is not None:
            if self.precompiled.guard_check(self.model, input_ids, positions):
                return self.precompiled.fn(self.model, input_ids, positions)
            self._give_up("its guards reject a call")
        if self._compiled is None:
            _allow_recompiles_per_session()
            self._compiled = torch.compile(self.model.forward, dynamic=True, backend=self._backend)
        with _floats_as_constants():  # read when a call traces (the first, or a recompile)
            return self._compiled(*_unbacked(input_ids, positions))

    def _precompile(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        start = time.perf_counter()
        # Precompiled from the unbound function, the model an argument: a module cannot be
        # serialized, and a fresh process passes its own. torch 2.10 and 2.11 offer
        # `aot_compile` only with the flag set (later versions by default).
        with torch._dynamo.config.patch(enable_aot_compile=True):
            whole = torch.compile(
                type(self.model).forward, fullgraph=True, dynamic=True, backend=self._backend
            )
        try:
            # Guards record the grad mode: compile as the runner calls (inference mode).
            with torch.inference_mode(), _floats_as_constants():
                example = (self.model, *_unbacked(input_ids, positions))
                self.precompiled = whole.aot_compile((example, {}))
        except Exception as e:  # torch internals: fall back to plain torch.compile
            self._give_up(f"{type(e).__name__}: {e}")
            return
        logger.info("precompiled the model forward in %.1f s", time.perf_counter() - start)

    def dump(self) -> bytes | None:
        """The precompiled function's bytes for the artifact cache (None: nothing to store)."""
        if self.precompiled is None:
            return None
        try:
            return type(self.precompiled).serialize(self.precompiled).serialized_data
        except Exception as e:  # torch internals: a cache must never crash a run
            logger.warning("cannot serialize the precompiled forward (%s: %s)", type(e).__name__, e)
            return None

    def load(self, data: bytes) -> bool:
        """Restores a precompiled function `dump` gave; False (logged) if torch rejects it."""
        if not self._can_precompile:
            return False
        from torch._dynamo.aot_compile import AOTCompiledFunction

        try:
            # Its guards are rebuilt here and compare against the grad mode of this moment.
            with torch.inference_mode():
                self.precompiled = AOTCompiledFunction.deserialize(
                    data, f_globals=type(self.model).forward.__globals__
                )
        except Exception as e:  # torch internals: compile instead
            logger.warning("cannot load the precompiled forward (%s: %s)", type(e).__name__, e)
            return False
        return True

    def _give_up(self, why: str) -> None:
        logger.warning("the model forward runs without precompile: %s", why)
        self.precompiled = None
        self._can_precompile = False


def _floats_as_constants() -> contextlib.AbstractContextManager[None]:
    """Traces with Python floats (the norms' eps, passed to custom ops) as constants. Made
    symbolic, Dynamo restarts its analysis from inside the backend to tensorify them: aot_compile
    cannot, and plain torch.compile traces the model again (the piecewise backend splitting and
    compiling pieces again): two thirds of a warm PIECEWISE compile on the CPU (RESULTS.md)."""
    return torch._dynamo.config.patch(specialize_float=True)


def _unbacked(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from torch._dynamo.decorators import mark_unbacked

    mark_unbacked(input_ids, 0)
    mark_unbacked(positions, 0)
    return input_ids, positions


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
    forward: CompiledForward | None = None,
) -> Iterator[str]:
    """Wraps the compile + capture of one model; yields how the entry was used:

    "loaded" (a ready entry was hot-loaded before compiling), "built" (this process compiled and
    will store the artifacts when the block ends), or "uncached" (no lock or an I/O problem:
    compile without the cache). The block must force every compile it wants stored (capture or
    warm-up calls), since torch.compile compiles lazily. `forward`'s precompiled function is
    loaded with the entry and stored with it.
    """
    entry = artifact_entry(device, model_config, graph_settings, cache)
    start = time.perf_counter()
    if _load_entry(entry, forward):
        yield "loaded"
        logger.info("compiled from cached artifacts in %.1f s", time.perf_counter() - start)
        return
    with entry.writer(model_name=model_name) as writer:
        if writer.reused:  # another process finished the entry while this one waited
            yield "loaded" if _load_entry(entry, forward) else "uncached"
            return
        yield "built" if writer.building else "uncached"
        if writer.building:
            save_compile_artifacts(writer)
            precompiled = forward.dump() if forward is not None else None
            if precompiled is not None:
                writer.put(PRECOMPILED_FORWARD, precompiled)
    logger.info("compiled and captured in %.1f s", time.perf_counter() - start)


def _load_entry(entry: ArtifactEntry, forward: CompiledForward | None) -> bool:
    """Loads a ready entry's torch.compile artifacts and `forward`'s precompiled function;
    True if either was there and loaded."""
    loaded = load_compile_artifacts(entry)
    if forward is not None and entry.manifest() is not None:
        data = entry.load_bytes(PRECOMPILED_FORWARD)
        if data is not None and forward.load(data):
            logger.info("loaded the precompiled model forward from %s", entry.key)
            loaded = True
    return loaded
