"""How a step's forward runs: FULL graphs of uniform decode batches, FULL graphs of mixed batches,
piecewise graphs, or eager. Each backend says whether it can run a batch and runs it; the list
is built once from `cudagraph_mode` (with the compile, tile tuning and captures it needs), and a
step runs on the first backend that takes it, eager last.

    mode                 backends, in order
    NONE                 eager
    PIECEWISE            piecewise, eager
    FULL_DECODE_ONLY     decode graphs, eager
    FULL_AND_PIECEWISE   decode graphs, piecewise, eager
    FULL                 decode graphs, mixed graphs, eager

On the CPU, or with a model whose MoE reads routing counts on the host, every mode is eager.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from libkk.config import CompilationConfig
from libkk.distributed import get_tp_rank, get_tp_size, get_tp_state, lockstep, track_captured_graph
from libkk.graphs.capture import DEFAULT_CAPTURE_SIZES, DecodeGraphs, MixedGraphs, sizes_up_to
from libkk.graphs.compile import CompiledForward, artifact_cache_scope, artifact_entry
from libkk.graphs.moe_tiles import TileChoice, tune_moe_tiles
from libkk.graphs.piecewise import PiecewiseBackend, capturing_pieces, pieces_disabled
from libkk.layers.forward_context import null_prefill_metadata, set_forward_context
from libkk.layers.moe import FusedMoE
from libkk.layers.quant_moe import QuantFusedMoE
from libkk.runtime.input_batch import InputBatch

Forward = Callable[[Tensor, Tensor], Tensor]


class StepBackend(abc.ABC):
    """Runs the model forward of one step.

    Invariants: `run` is called only on a batch `can_run` accepted; it returns the hidden states
    of the batch's real rows [num_tokens, hidden], and the aux hidden states of those rows when
    the model keeps them (else None); padding rows write only the null block.
    """

    # Whether a replay runs attention with no Python (FP8 scale calibration must come first).
    replays_attention = False

    @abc.abstractmethod
    def can_run(self, batch: InputBatch) -> bool: ...

    @abc.abstractmethod
    def run(self, batch: InputBatch) -> tuple[Tensor, Tensor | None]: ...


class FullGraphStep(StepBackend):
    """Replays a FULL graph: DecodeGraphs (uniform decode and verification batches) or
    MixedGraphs (any batch of up to its largest token count)."""

    replays_attention = True

    def __init__(self, graphs: DecodeGraphs | MixedGraphs) -> None:
        self.graphs = graphs

    def can_run(self, batch: InputBatch) -> bool:
        return self.graphs.can_run(batch.attn_metadata, batch.input_ids.shape[0])

    def run(self, batch: InputBatch) -> tuple[Tensor, Tensor | None]:
        return self.graphs.run(batch.input_ids, batch.positions, batch.attn_metadata)


class EagerStep(StepBackend):
    """The forward as it is (compiled or not), any batch."""

    def __init__(self, model: nn.Module, forward: Forward, keeps_aux: bool) -> None:
        self.model, self.forward, self.keeps_aux = model, forward, keeps_aux

    def can_run(self, batch: InputBatch) -> bool:
        return True

    def run(self, batch: InputBatch) -> tuple[Tensor, Tensor | None]:
        with set_forward_context(batch.attn_metadata, self.model):
            hidden = self.forward(batch.input_ids, batch.positions)  # [num_tokens, hidden]
        return hidden, self.model.aux_hidden_states if self.keeps_aux else None


class PiecewiseStep(EagerStep):
    """The compiled forward padded to the next captured token count: its pieces between
    attention calls replay their graphs (padding writes the null slot)."""

    def __init__(
        self, model: nn.Module, forward: Forward, keeps_aux: bool, pieces: PiecewiseBackend
    ) -> None:
        super().__init__(model, forward, keeps_aux)
        self.pieces = pieces

    def can_run(self, batch: InputBatch) -> bool:
        return batch.input_ids.shape[0] <= self.pieces.max_size

    def run(self, batch: InputBatch) -> tuple[Tensor, Tensor | None]:
        n = batch.input_ids.shape[0]
        pad = self.pieces.pad_to[n] - n
        metadata = batch.attn_metadata
        metadata = metadata.with_slot_mappings(F.pad(metadata.slot_mappings, (0, pad)))
        with set_forward_context(metadata, self.model):
            hidden = self.forward(
                F.pad(batch.input_ids, (0, pad)), F.pad(batch.positions, (0, pad))
            )
        # Aux rows past n are padding, ignored by whoever reads them.
        return hidden[:n], self.model.aux_hidden_states if self.keeps_aux else None


@dataclasses.dataclass(frozen=True)
class GraphShape:
    """What the captured graphs must cover."""

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    query_lens: tuple[int, ...] = (1,)  # tokens per request of uniform batches (1 + K drafts)
    middle_lens_max_size: int | None = None  # lengths between: graphs of this many requests
    keeps_aux: bool = False  # the model keeps aux hidden states (a drafter reads them)
    num_kv_groups: int = 1  # block tables and slot mappings per step (docs/memory.md)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class StepBackends:
    """Builds the backends of `compilation.cudagraph_mode` for one model (compiling, tuning
    packed MoE tiles and capturing graphs as the mode needs) and picks one per step."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[Tensor],
        device: torch.device,
        compilation: CompilationConfig,
        shape: GraphShape,
        progress: bool = False,
    ) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.compilation, self.shape = compilation, shape
        self.compile_cache = "off"  # how the artifact cache served this model (graphs/compile.py)
        self.startup_seconds: dict[str, float] = {}  # tile tuning, compile + graph capture
        self.moe_tile_choices: list[TileChoice] = []  # measured or recorded
        # What was captured (None: not in this mode).
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.piecewise: PiecewiseBackend | None = None
        mode = compilation.cudagraph_mode
        # NOTE: the plain-torch MoE path reads routing counts on the host: not capturable
        # (packed 4-bit experts run host-sync-free kernels and are).
        capturable = not any(isinstance(m, FusedMoE) for m in model.modules())
        graphs = device.type == "cuda" and mode != "NONE" and capturable
        piecewise: PiecewiseBackend | None = None
        # model.forward(input_ids, positions), compiled on CUDA (the CPU stays eager: exact
        # parity with the reference and no compile time).
        self.forward: Forward = model.forward
        self.compiled = compilation.compiles(device.type, model)
        if self.compiled:
            if graphs and mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
                piecewise = PiecewiseBackend(self._sizes())
            self.forward = CompiledForward(model, backend=piecewise)
        if device.type == "cuda" and compilation.tune_moe_tiles:
            # Before anything compiles or captures: traces and graphs take the installed tiles.
            start = time.perf_counter()
            self._tune_moe_tiles(progress)
            self.startup_seconds["tune MoE tiles"] = time.perf_counter() - start
        self.eager = EagerStep(model, self.forward, shape.keeps_aux)
        self.backends: list[StepBackend] = []
        if graphs:
            self.backends = self._capture(piecewise, progress)
        self.backends.append(self.eager)

    def run(self, batch: InputBatch, replays_allowed: bool = True) -> tuple[Tensor, Tensor | None]:
        """The step's forward on the first backend that can run it (`replays_allowed` False:
        none that replays attention)."""
        for backend in self.backends:
            if (replays_allowed or not backend.replays_attention) and backend.can_run(batch):
                return backend.run(batch)
        raise AssertionError("the eager backend runs every batch")

    def _sizes(self) -> list[int]:
        return list(self.compilation.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES)

    def _decode_sizes(self) -> list[int]:
        """Capture sizes of the decode graphs: up to max_num_seqs requests."""
        limit = self.shape.max_num_seqs
        return [s for s in self._sizes() if s <= limit] or [limit]

    def artifact_inputs(self) -> tuple[dict, dict]:
        """(model config, graph settings) that key this model's artifact cache entry."""
        model, shape = self.model, self.shape
        graph_settings = {
            "model_class": type(model).__name__,
            "compilation": msgspec.to_builtins(self.compilation),
            "weight_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "kv_cache_dtype": str(self.kv_caches[0].dtype) if self.kv_caches else None,
            "block_size": shape.block_size,
            "capture_sizes": self._decode_sizes(),
            "max_blocks_per_seq": shape.max_blocks_per_seq,
            "query_lens": list(shape.query_lens),
            "middle_lens_max_size": shape.middle_lens_max_size,
            "stash_aux_hidden": shape.keeps_aux,
            # Each tensor-parallel rank compiles its own shard shapes: one cache entry per rank.
            "tensor_parallel": [get_tp_rank(), get_tp_size()],
            # A compiled collective names its process group: a precompiled forward stored under
            # one name must not run where the group has another.
            "tp_group": group.group_name if (group := get_tp_state().group) else None,
        }
        return dataclasses.asdict(model.config), graph_settings

    def _tune_moe_tiles(self, progress: bool) -> None:
        """Packed MoE tile choices for every token count a step can have, recorded in (or
        loaded from) the entry the compile artifacts use."""
        if not any(isinstance(m, QuantFusedMoE) for m in self.model.modules()):
            return
        largest_graph = max(self._decode_sizes()) * max(self.shape.query_lens)
        entry = artifact_entry(self.device, *self.artifact_inputs())
        self.moe_tile_choices = tune_moe_tiles(
            self.model,
            entry,
            max(largest_graph, self.shape.max_num_batched_tokens),
            progress=progress,
        )

    def _capture(self, piecewise: PiecewiseBackend | None, progress: bool) -> list[StepBackend]:
        """Compiles (through the artifact cache) and captures the mode's graphs."""
        mode = self.compilation.cudagraph_mode
        # PIECEWISE graphs pieces of the compiled forward; with nothing compiled it graphs the
        # decode steps whole instead.
        full = mode != "PIECEWISE" or not self.compiled
        decode = self._decode_graphs() if full else None
        mixed = self._mixed_graphs(decode) if mode == "FULL" else None
        start = time.perf_counter()
        if not self.compiled:
            # Lazy: the ranks of a tensor-parallel group would have to meet at each capture.
            lazy = self.compilation.cudagraph_capture == "lazy" and get_tp_size() == 1
            self._capture_full(decode, mixed, progress, lazy)
            self.startup_seconds["capture CUDA graphs"] = time.perf_counter() - start
        else:
            # Capturing runs the compiled forward, so it compiles the one graph every step
            # size uses; the artifact cache stores it for the next start.
            forward = self.forward
            assert isinstance(forward, CompiledForward)
            with artifact_cache_scope(self.device, *self.artifact_inputs(), forward=forward) as how:
                self.compile_cache = how
                # A ready entry is loaded before the block runs: mostly the import of
                # torch.compile's stack (benchmarks/RESULTS.md, 2026-12-02).
                loaded = time.perf_counter()
                self.startup_seconds["load the compile artifacts"] = loaded - start
                if piecewise is not None:
                    self._capture_pieces(piecewise, progress)
                with pieces_disabled():  # a FULL graph runs the pieces' compiled code inline
                    self._capture_full(decode, mixed, progress)
            # Compiling happens in the first captures (cache hits where artifacts were loaded).
            self.startup_seconds["compile and capture CUDA graphs"] = time.perf_counter() - loaded
        self.decode_graphs, self.mixed_graphs, self.piecewise = decode, mixed, piecewise
        backends: list[StepBackend] = [FullGraphStep(g) for g in (decode, mixed) if g is not None]
        if piecewise is not None:
            backends.append(
                PiecewiseStep(self.model, self.forward, self.shape.keeps_aux, piecewise)
            )
        return backends

    def _decode_graphs(self) -> DecodeGraphs:
        shape = self.shape
        return DecodeGraphs(
            self.forward,
            model=self.model,
            capture_sizes=self._decode_sizes(),
            max_blocks_per_seq=shape.max_blocks_per_seq,
            block_size=shape.block_size,
            device=self.device,
            query_lens=shape.query_lens,
            middle_lens_max_size=shape.middle_lens_max_size,
            stash=(lambda: self.model.aux_hidden_states) if shape.keeps_aux else None,
            num_kv_groups=shape.num_kv_groups,
        )

    def _mixed_graphs(self, decode: DecodeGraphs) -> MixedGraphs:
        shape = self.shape
        # No step holds more tokens than the budget, or every request verifying drafts, or
        # every request its whole length.
        largest_step = min(
            max(shape.max_num_batched_tokens, shape.max_num_seqs * max(shape.query_lens)),
            shape.max_num_seqs * shape.max_model_len,
        )
        return MixedGraphs(
            self.forward,
            model=self.model,
            capture_sizes=sizes_up_to(self._sizes(), largest_step),
            max_num_seqs=shape.max_num_seqs,
            max_blocks_per_seq=shape.max_blocks_per_seq,
            block_size=shape.block_size,
            device=self.device,
            stash=decode.stash,
            num_kv_groups=shape.num_kv_groups,
        )

    @staticmethod
    def _capture_full(
        decode: DecodeGraphs | None, mixed: MixedGraphs | None, progress: bool, lazy: bool = False
    ) -> None:
        """The decode graphs, then (mode "FULL") the mixed-batch graphs in the same pool (lazy:
        the largest of each; steps capture the others)."""
        if decode is not None:
            decode.capture(progress=progress, lazy=lazy)
        if mixed is not None:
            assert decode is not None
            mixed.capture(progress=progress, pool=decode.pool, lazy=lazy)

    @torch.inference_mode()  # as steps run: dynamo guards on the grad mode
    def _capture_pieces(self, piecewise: PiecewiseBackend, progress: bool) -> None:
        """Captures every piece at every token count, largest first, over a one-request batch
        in the null block (its K/V writes are skipped, its outputs ignored)."""
        sizes = sorted(piecewise.sizes, reverse=True)
        # One memory pool for every piece's graphs: replays never overlap, so the intermediates
        # of one graph may reuse another's (each graph's output stays referenced).
        piecewise.pool = torch.cuda.graph_pool_handle()
        ids = torch.zeros(sizes[0], dtype=torch.int64, device=self.device)
        positions = torch.arange(sizes[0], dtype=torch.int64, device=self.device)
        block_size = self.shape.block_size
        with capturing_pieces():
            for n in tqdm(sizes, desc="Capturing piecewise graphs", disable=not progress):
                # Every rank captures the same pieces in the same order (see DecodeGraphs).
                lockstep(f"piecewise graphs, {n} tokens")  # the first compiles the forward
                metadata = null_prefill_metadata(
                    n, block_size, self.device, self.shape.num_kv_groups
                )
                with set_forward_context(metadata, self.model):
                    self.forward(ids[:n], positions[:n])
        torch.cuda.synchronize()
        for piece in piecewise.pieces:  # released before a tensor-parallel group goes
            for graph, _, _ in piece.graphs.values():
                track_captured_graph(graph)
