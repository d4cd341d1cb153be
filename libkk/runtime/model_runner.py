"""Runs one scheduled step: builds the flat batch, calls the model, samples the next tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from libkk.config import CompilationConfig, SchedulerConfig
from libkk.distributed import get_tp_rank, get_tp_size, get_tp_state, lockstep, track_captured_graph
from libkk.graphs.capture import (
    DEFAULT_CAPTURE_SIZES,
    DecodeGraphs,
    MixedGraphs,
    sizes_up_to,
)
from libkk.graphs.compile import CompiledForward, artifact_cache_scope, artifact_entry
from libkk.graphs.moe_tiles import TileChoice, tune_moe_tiles
from libkk.graphs.piecewise import PiecewiseBackend, capturing_pieces, pieces_disabled
from libkk.layers.attention import kv_scale_calibration_pending
from libkk.layers.embedding import LMHead, vocab_parallel_head
from libkk.layers.forward_context import null_prefill_metadata, set_forward_context
from libkk.layers.host_embedding import HostRowsEmbedding
from libkk.layers.moe import FusedMoE
from libkk.layers.quant_moe import QuantFusedMoE, prefill_only_step
from libkk.runtime.input_batch import InputBatch, build_input_batch, host_to_device
from libkk.runtime.io import (
    PREFILL_STEP,
    LaunchedStep,
    LogprobTensors,
    ModelRunnerOutput,
    SchedulerOutput,
)
from libkk.runtime.verify import shards_cover, verify, verify_from_shards
from libkk.sample.gumbel import gumbel_argmax
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import Sampler, SamplingRow, apply_penalties, sample_random
from libkk.spec_decode.vocab_parallel import ShardDrafts, tp_gather


class ModelRunner:
    # Speculative decoding (set_speculation): target layers whose hidden states steps return,
    # and synthetic acceptance rates (None: exact verification).
    aux_hidden_layers: tuple[int, ...] = ()
    synthetic_rates: list[float] | None = None
    # Vocab-parallel verification (use_vocab_parallel): the LM head whose shard logits every
    # rank verifies from, and the proposer's kept shards of sampled drafts.
    vocab_head: LMHead | None = None
    shard_drafts: dict[str, ShardDrafts] | None = None

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        *,
        compilation: CompilationConfig | None = None,
        max_num_seqs: int = 1,
        max_model_len: int = 1,
        progress: bool = False,
        query_lens: Sequence[int] = (1,),
        middle_lens_max_size: int | None = None,
        stash_aux_hidden: bool = False,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """query_lens: tokens per request of the uniform batches to capture (1, and 1 + K to
        verify K drafts); middle_lens_max_size: the lengths between those are captured for
        batches of up to this many requests only; stash_aux_hidden: graphs keep the model's aux
        hidden states;
        max_num_batched_tokens: the largest step (None: the scheduler's default), up to which
        packed MoE tiles are tuned."""
        self.model = model
        self.query_lens = tuple(query_lens)
        self.middle_lens_max_size = middle_lens_max_size
        self.stash_aux_hidden = stash_aux_hidden
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.kv_caches = kv_caches
        layers = model.attention_layers()
        if len(layers) != len(kv_caches):
            raise ValueError(f"{len(layers)} attention layers but {len(kv_caches)} KV caches")
        for layer, cache in zip(layers, kv_caches, strict=True):
            layer.kv_cache = cache
        self.attention_layers = layers
        # FP8 scale calibration runs in the eager attention op of the first real store, and a
        # FULL graph replay runs no Python: no replay until every layer has calibrated.
        self._kv_scales_pending = kv_scale_calibration_pending(layers)
        self.host_embeddings = [m for m in model.modules() if isinstance(m, HostRowsEmbedding)]
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None  # cudagraph_mode "FULL"
        # The last launched step's sampled ids [S] on the device and each request's row in them:
        # the next step's in-flight input tokens are gathered from there.
        self._in_flight_ids: torch.Tensor | None = None
        self._in_flight_rows: dict[str, int] = {}
        self.compile_cache = "off"  # how the artifact cache served this runner (graphs/compile.py)
        # Seconds of this runner's start-up phases: tile tuning, compile + graph capture.
        self.startup_seconds: dict[str, float] = {}
        self.moe_tile_choices: list[TileChoice] = []  # measured or recorded (graphs/moe_tiles.py)
        compilation = compilation or CompilationConfig()
        # model.forward(input_ids, positions), compiled on CUDA (CPU stays eager: exact parity
        # with the reference and no compile time).
        self.forward = model.forward
        # PIECEWISE modes: the compiled graph is split at attention and its pieces are graphed
        # per token count (graphs/piecewise.py), for batches no FULL graph covers.
        self.piecewise: PiecewiseBackend | None = None
        mode = compilation.cudagraph_mode
        # NOTE: the plain-torch MoE path reads routing counts on the host: not capturable
        # (packed 4-bit experts run host-sync-free kernels and are).
        capturable = not any(isinstance(m, FusedMoE) for m in model.modules())
        graphs = device.type == "cuda" and mode != "NONE" and capturable
        if compilation.compiles_on(device.type):
            if graphs and mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
                self.piecewise = PiecewiseBackend(
                    compilation.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES
                )
            self.forward = CompiledForward(model, backend=self.piecewise)
        budget = max_num_batched_tokens or SchedulerConfig().max_num_batched_tokens
        if device.type == "cuda" and compilation.tune_moe_tiles:
            # Before anything compiles or captures: traces and graphs take the installed tiles.
            start = time.perf_counter()
            self._tune_moe_tiles(compilation, max_num_seqs, max_model_len, budget, progress)
            self.startup_seconds["tune MoE tiles"] = time.perf_counter() - start
        if graphs:
            self._capture_graphs(compilation, max_num_seqs, max_model_len, budget, progress)

    def _capture_sizes(self, compilation: CompilationConfig, max_num_seqs: int) -> list[int]:
        return [
            s
            for s in (compilation.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES)
            if s <= max_num_seqs
        ] or [max_num_seqs]

    def _artifact_inputs(
        self, compilation: CompilationConfig, sizes: list[int], max_blocks_per_seq: int
    ) -> tuple[dict, dict]:
        """(model config, graph settings) that key this runner's artifact cache entry."""
        graph_settings = {
            "model_class": type(self.model).__name__,
            "compilation": msgspec.to_builtins(compilation),
            "weight_dtypes": sorted({str(p.dtype) for p in self.model.parameters()}),
            "kv_cache_dtype": str(self.kv_caches[0].dtype) if self.kv_caches else None,
            "block_size": self.block_size,
            "capture_sizes": sizes,
            "max_blocks_per_seq": max_blocks_per_seq,
            "query_lens": list(self.query_lens),
            "middle_lens_max_size": self.middle_lens_max_size,
            "stash_aux_hidden": self.stash_aux_hidden,
            # Each tensor-parallel rank compiles its own shard shapes: one cache entry per rank.
            "tensor_parallel": [get_tp_rank(), get_tp_size()],
            # A compiled collective names its process group: a precompiled forward stored under
            # one name must not run where the group has another.
            "tp_group": group.group_name if (group := get_tp_state().group) else None,
        }
        return dataclasses.asdict(self.model.config), graph_settings

    def _tune_moe_tiles(
        self,
        compilation: CompilationConfig,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        progress: bool,
    ) -> None:
        """Packed MoE tile choices for every token count a step can have, recorded in (or
        loaded from) the entry the compile artifacts use."""
        if not any(isinstance(m, QuantFusedMoE) for m in self.model.modules()):
            return
        sizes = self._capture_sizes(compilation, max_num_seqs)
        largest_graph = max(sizes) * max(self.query_lens)
        entry = artifact_entry(
            self.device,
            *self._artifact_inputs(compilation, sizes, -(-max_model_len // self.block_size)),
        )
        self.moe_tile_choices = tune_moe_tiles(
            self.model, entry, max(largest_graph, max_num_batched_tokens), progress=progress
        )

    def _capture_graphs(
        self,
        compilation: CompilationConfig,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        progress: bool,
    ) -> None:
        sizes = self._capture_sizes(compilation, max_num_seqs)
        max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(
            self.forward,
            model=self.model,
            capture_sizes=sizes,
            max_blocks_per_seq=max_blocks_per_seq,
            block_size=self.block_size,
            device=self.device,
            query_lens=self.query_lens,
            middle_lens_max_size=self.middle_lens_max_size,
            stash=(lambda: self.model.aux_hidden_states) if self.stash_aux_hidden else None,
        )
        if compilation.cudagraph_mode == "FULL":
            # No step holds more tokens than the budget, or every request verifying drafts, or
            # every request its whole length.
            largest_step = min(
                max(max_num_batched_tokens, max_num_seqs * max(self.query_lens)),
                max_num_seqs * max_model_len,
            )
            self.mixed_graphs = MixedGraphs(
                self.forward,
                model=self.model,
                capture_sizes=sizes_up_to(
                    compilation.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES, largest_step
                ),
                max_num_seqs=max_num_seqs,
                max_blocks_per_seq=max_blocks_per_seq,
                block_size=self.block_size,
                device=self.device,
                stash=self.graphs.stash,
            )
        start = time.perf_counter()
        if not compilation.torch_compile:
            self._capture_full_graphs(progress)
            self.startup_seconds["capture CUDA graphs"] = time.perf_counter() - start
            return
        # Capturing runs the compiled forward, so it compiles the one graph every step size uses;
        # the artifact cache stores it for the next start.
        model_config, graph_settings = self._artifact_inputs(compilation, sizes, max_blocks_per_seq)
        with artifact_cache_scope(
            self.device, model_config, graph_settings, forward=self.forward
        ) as how:
            self.compile_cache = how
            # A ready entry is loaded before the block runs: mostly the import of torch.compile's
            # stack (benchmarks/RESULTS.md, 2026-12-02).
            loaded = time.perf_counter()
            self.startup_seconds["load the compile artifacts"] = loaded - start
            if self.piecewise is not None:
                self._capture_pieces(progress)
            if compilation.cudagraph_mode != "PIECEWISE":
                with pieces_disabled():  # a FULL graph runs the pieces' compiled code inline
                    self._capture_full_graphs(progress)
            else:
                self.graphs = None
        # Compiling happens in the first captures (cache hits where the artifacts were loaded).
        self.startup_seconds["compile and capture CUDA graphs"] = time.perf_counter() - loaded

    def _capture_full_graphs(self, progress: bool) -> None:
        """The decode graphs, then (mode "FULL") the mixed-batch graphs in the same pool."""
        self.graphs.capture(progress=progress)
        if self.mixed_graphs is not None:
            self.mixed_graphs.capture(progress=progress, pool=self.graphs.pool)

    @torch.inference_mode()  # as `execute` runs: dynamo guards on the grad mode
    def _capture_pieces(self, progress: bool) -> None:
        """Captures every piece at every token count, largest first, over a one-request batch
        in the null block (its K/V writes are skipped, its outputs ignored)."""
        sizes = sorted(self.piecewise.sizes, reverse=True)
        # One memory pool for every piece's graphs: replays never overlap, so the intermediates
        # of one graph may reuse another's (each graph's output stays referenced).
        self.piecewise.pool = torch.cuda.graph_pool_handle()
        ids = torch.zeros(sizes[0], dtype=torch.int64, device=self.device)
        positions = torch.arange(sizes[0], dtype=torch.int64, device=self.device)
        with capturing_pieces():
            for n in tqdm(sizes, desc="Capturing piecewise graphs", disable=not progress):
                # Every rank captures the same pieces in the same order (see DecodeGraphs).
                lockstep(f"piecewise graphs, {n} tokens")  # the first compiles the forward
                with set_forward_context(
                    null_prefill_metadata(n, self.block_size, self.device), self.model
                ):
                    self.forward(ids[:n], positions[:n])
        torch.cuda.synchronize()
        for piece in self.piecewise.pieces:  # released before a tensor-parallel group goes
            for graph, _, _ in piece.graphs.values():
                track_captured_graph(graph)

    def _run_piecewise(self, batch: InputBatch) -> torch.Tensor:
        """The forward padded to the next captured token count (padding writes the null slot)."""
        n = batch.input_ids.shape[0]
        pad = self.piecewise.pad_to[n] - n
        metadata = dataclasses.replace(
            batch.attn_metadata, slot_mapping=F.pad(batch.attn_metadata.slot_mapping, (0, pad))
        )
        with set_forward_context(metadata, self.model):
            hidden = self.forward(
                F.pad(batch.input_ids, (0, pad)), F.pad(batch.positions, (0, pad))
            )
        return hidden[:n]

    def graph_shapes(self) -> list[tuple[int, int]]:
        """(size, query length) of every captured decode/verification graph."""
        return [(size, q) for q, size in self.graphs.graphs] if self.graphs is not None else []

    @torch.inference_mode()
    def verify_on_graph(self, size: int, q: int) -> None:
        """The device work of a verification step the (q, size) graph runs, on padding rows:
        the replay and the logits of its size * q rows (for adaptive verification's costs)."""
        assert self.graphs is not None
        self.model.compute_logits(self.graphs.replay_padding(size, q))

    def set_speculation(
        self, aux_hidden_layers: tuple[int, ...] = (), synthetic_rates: list[float] | None = None
    ) -> None:
        """Speculative settings: target layers whose hidden states each step returns (for
        model-based proposers), and synthetic acceptance rates (benchmarks; None: exact)."""
        self.aux_hidden_layers = tuple(aux_hidden_layers)
        self.synthetic_rates = synthetic_rates
        if self.aux_hidden_layers:
            self.model.set_aux_hidden_layers(self.aux_hidden_layers)

    def use_vocab_parallel(self, shard_drafts: dict[str, ShardDrafts]) -> None:
        """Tensor parallelism with vocab-parallel drafting: every rank's runner verifies drafts
        from its vocab shard of the target logits, with q of sampled drafts from
        `shard_drafts` (the proposer's, on this rank). Every rank must run the same steps."""
        head = vocab_parallel_head(self.model)
        if head is None or get_tp_size() == 1:
            raise ValueError(
                "vocab-parallel verification needs tensor parallelism and a model whose LM head "
                "gives every rank a vocabulary shard"
            )
        self.vocab_head = head
        self.shard_drafts = shard_drafts

    @torch.inference_mode()
    def execute(
        self, sched_out: SchedulerOutput, while_device_runs: Callable[[], None] | None = None
    ) -> ModelRunnerOutput:
        """Runs the step and reads its tokens back. `while_device_runs` is host work that does
        not feed this step: it runs once the forward is enqueued, before the first read."""
        batch = build_input_batch(sched_out, self.block_size, self.device)
        with _row_types(sched_out):
            hidden, aux = self._forward(batch)
        if while_device_runs is not None:
            while_device_runs()
        out = ModelRunnerOutput()
        if batch.sampling_rows:
            if any(batch.num_spec):
                self._sample_with_drafts(sched_out, batch, hidden, out)
            elif _argmax_from_shards(batch.sampling_rows):
                tokens = self.model.greedy_tokens(hidden[batch.logits_indices]).tolist()
                for rid, token in zip(batch.sampling_request_ids, tokens, strict=True):
                    out.sampled_token_ids[rid] = [token]
                    out.logprobs[rid] = [None]
            else:
                logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S, vocab]
                sampled = self.sampler(logits, batch.sampling_rows)
                for rid, token, lp in zip(
                    batch.sampling_request_ids, sampled.token_ids, sampled.logprobs, strict=True
                ):
                    out.sampled_token_ids[rid] = [token]
                    out.logprobs[rid] = [lp]
        # A synchronous step's tokens are known on the host: nothing in flight to gather from.
        self._in_flight_ids, self._in_flight_rows = None, {}
        if aux is not None:
            self._collect_aux_hidden(sched_out, batch, aux, out)
        return out

    @torch.inference_mode()
    def launch(self, sched_out: SchedulerOutput) -> LaunchedStep:
        """Enqueues the step (forward and sampling) and the copy of its sampled ids to the host,
        without waiting for them (async scheduling; no drafts, no aux hidden states).

        Tokens marked `last_token_in_flight` are read from the previous launched step's device
        ids. On CUDA the host waits only where sampling itself reads device values (rows with
        top-k, top-p or min-p); greedy and plain temperature rows and logprobs never wait.
        """
        batch = build_input_batch(sched_out, self.block_size, self.device)
        self._gather_in_flight_inputs(sched_out, batch)
        with _row_types(sched_out):
            hidden, _ = self._forward(batch)
        request_ids = batch.sampling_request_ids
        if not request_ids:
            self._in_flight_ids, self._in_flight_rows = None, {}
            return LaunchedStep([], torch.empty(0, dtype=torch.int64), None)
        rows = batch.sampling_rows
        if _argmax_from_shards(rows):
            token_ids = self.model.greedy_tokens(hidden[batch.logits_indices])  # [S] int64
            logprobs = None
        else:
            # At TP > 1 every rank gathers the same whole rows and samples the same tokens
            # (keyed noise): each keeps its own in-flight ids for the next step's inputs.
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S, vocab]
            token_ids = sample_token_ids(logits, rows)  # [S] int64, on the device
            logprobs = logprob_tensors(logits, token_ids, rows)
        self._in_flight_ids = token_ids
        self._in_flight_rows = {rid: i for i, rid in enumerate(request_ids)}
        copied = None
        host = token_ids
        if token_ids.is_cuda:
            host = torch.empty(token_ids.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(token_ids, non_blocking=True)
            if logprobs is not None:
                logprobs = logprobs.to("cpu", non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return LaunchedStep(list(request_ids), host, copied, logprobs)

    def _gather_in_flight_inputs(self, sched_out: SchedulerOutput, batch: InputBatch) -> None:
        """Replaces placeholder input ids with the previous launched step's sampled ids, on the
        device (no host round trip)."""
        dst, src = [], []
        starts = batch.attn_metadata.query_start_loc_cpu
        for i, r in enumerate(sched_out.requests):
            if not r.last_token_in_flight:
                continue
            row = self._in_flight_rows.get(r.request_id)
            if row is None or self._in_flight_ids is None:
                raise RuntimeError(
                    f"request {r.request_id!r} has a token in flight but the previous launched "
                    "step did not sample it"
                )
            dst.append(starts[i + 1] - 1)
            src.append(row)
        if not dst:
            return
        if self.host_embeddings:
            raise RuntimeError(
                "host-table embeddings gather rows from host token ids: they cannot take tokens "
                "still in flight (async scheduling)"
            )
        rows = _to_device(src, self.device)
        places = _to_device(dst, self.device)
        batch.input_ids.index_copy_(0, places, self._in_flight_ids.index_select(0, rows))

    def _forward(self, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [num_tokens, hidden], aux hidden [num_tokens, len(aux) * hidden] or None)."""
        num_tokens = batch.input_ids.shape[0]
        for embedding in self.host_embeddings:  # rows of host tables, gathered before the forward
            embedding.stage(batch.input_ids_cpu)
        aux_layers = self.aux_hidden_layers
        aux: torch.Tensor | None = None
        if self._kv_scales_pending:
            self._kv_scales_pending = kv_scale_calibration_pending(self.attention_layers)
        if (
            self.graphs is not None
            and not self._kv_scales_pending
            # Graphs keep aux hidden states only when captured with the stash.
            and (not aux_layers or self.graphs.stash is not None)
            and self.graphs.can_run(batch.attn_metadata, num_tokens)
        ):
            hidden, aux = self.graphs.run(batch.input_ids, batch.positions, batch.attn_metadata)
        elif (
            self.mixed_graphs is not None
            and not self._kv_scales_pending
            and (not aux_layers or self.mixed_graphs.stash is not None)
            and self.mixed_graphs.can_run(batch.attn_metadata, num_tokens)
        ):
            hidden, aux = self.mixed_graphs.run(
                batch.input_ids, batch.positions, batch.attn_metadata
            )
        elif self.piecewise is not None and num_tokens <= self.piecewise.max_size:
            hidden = self._run_piecewise(batch)  # [num_tokens, hidden]
            if aux_layers:
                aux = self.model.aux_hidden_states  # padded rows past num_tokens are ignored
        else:
            with set_forward_context(batch.attn_metadata, self.model):
                hidden = self.forward(batch.input_ids, batch.positions)  # [num_tokens, hidden]
            if aux_layers:
                aux = self.model.aux_hidden_states
        return hidden, aux

    def _sample_with_drafts(
        self, sched_out: SchedulerOutput, batch: InputBatch, hidden: torch.Tensor,
        out: ModelRunnerOutput,
    ) -> None:  # fmt: skip
        """Plain rows through the sampler, rows with drafts through verification: from this
        rank's vocab shard when this runner verifies vocab-parallel and the step allows it (the
        same decision on every rank: it reads only the step rank 0 sent), else on whole rows."""
        by_id = {r.request_id: r for r in sched_out.requests}
        plain, plain_rows, plain_at = [], [], []
        spec, spec_at = [], []
        offset = 0
        for rid, row, n in zip(
            batch.sampling_request_ids, batch.sampling_rows, batch.num_spec, strict=True
        ):
            if n == 0:
                plain.append(rid)
                plain_rows.append(row)
                plain_at.append(offset)
            else:
                spec.append(by_id[rid])
                spec_at.append(offset)
            offset += n + 1
        plain_logits = None
        head = self.vocab_head
        shards = (
            head is not None
            and self.synthetic_rates is None
            and shards_cover(spec, head.vocab_size)
        )
        if shards:
            assert head is not None and self.shard_drafts is not None
            logits = head(hidden[batch.logits_indices])  # [sum(1 + n), vocab / tp]
            if plain:  # whole rows for the sampler, of these rows only
                plain_logits = head.gather_logits(logits[_to_device(plain_at, logits.device)])
            own = head.vocab_shard
            spec_logits = [
                logits[at : at + r.num_spec_tokens + 1, : len(own)]
                for r, at in zip(spec, spec_at, strict=True)
            ]
            results = verify_from_shards(
                spec_logits, spec, own.start, self.shard_drafts, gather=tp_gather
            )
        else:
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [rows, vocab]
            if plain:
                plain_logits = logits[_to_device(plain_at, logits.device)]
            if head is not None:
                spec = self._with_gathered_drafts(spec)
            spec_logits = [
                logits[at : at + r.num_spec_tokens + 1] for r, at in zip(spec, spec_at, strict=True)
            ]  # [1 + n, vocab] each
            results = verify(spec_logits, spec, synthetic_rates=self.synthetic_rates)
        if plain_logits is not None:
            sampled = self.sampler(plain_logits, plain_rows)
            for rid, token, lp in zip(plain, sampled.token_ids, sampled.logprobs, strict=True):
                out.sampled_token_ids[rid] = [token]
                out.logprobs[rid] = [lp]
        for r, (tokens, lps) in zip(spec, results, strict=True):
            out.sampled_token_ids[r.request_id] = tokens
            out.logprobs[r.request_id] = lps

    def _with_gathered_drafts(self, spec: list) -> list:
        """The requests with the whole draft logits of sampled drafts that were drafted from
        vocab shards (their q, for verification on whole rows): one gather of the kept shards."""
        head, kept = self.vocab_head, self.shard_drafts
        assert head is not None and kept is not None
        stored = [(i, r, kept[r.request_id]) for i, r in enumerate(spec) if r.request_id in kept]
        if not stored:
            return spec
        width = head.weight.shape[0]  # every rank's columns, padding included
        parts = []
        for _, r, s in stored:
            s.check_drafts(r.request_id, r.spec_token_ids)
            part = s.logits[: r.num_spec_tokens]
            parts.append(F.pad(part, (0, width - part.shape[1])))
        whole = head.gather_logits(torch.cat(parts)).split(
            [r.num_spec_tokens for _, r, _ in stored]
        )
        spec = list(spec)
        for (i, r, _), logits in zip(stored, whole, strict=True):
            spec[i] = dataclasses.replace(r, draft_logits=logits)
        return spec

    def _collect_aux_hidden(
        self,
        sched_out: SchedulerOutput,
        batch: InputBatch,
        aux: torch.Tensor,  # [num_tokens, len(ids) * hidden]
        out: ModelRunnerOutput,
    ) -> None:
        """Hidden states of the rows whose KV is final after this step, per request."""
        starts = batch.attn_metadata.query_start_loc_cpu
        for i, r in enumerate(sched_out.requests):
            num_final = r.num_new_tokens - r.num_spec_tokens
            sampled = out.sampled_token_ids.get(r.request_id)
            if r.num_spec_tokens and sampled:
                num_final += len(sampled) - 1  # the accepted drafts
            out.aux_hidden[r.request_id] = (
                r.num_computed_tokens,
                aux[starts[i] : starts[i] + num_final],
            )


def _argmax_from_shards(rows: Sequence[SamplingRow]) -> bool:
    """Whether every rank takes these rows' tokens as the argmax from its vocabulary shard
    (`greedy_tokens`: one [rows, 2] gather) instead of gathering whole logit rows. Every rank
    decides alike: the rows are those of the step rank 0 sent."""
    return get_tp_size() > 1 and all(r.takes_raw_argmax() for r in rows)


def sample_token_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The tokens `Sampler` picks for `rows` (same ops, same results), left on the device.

    logits [S, vocab] -> [S] int64. NOTE: Sampler returns host lists; async scheduling needs
    the ids as a device tensor, so this follows Sampler.__call__ up to its host copy. Random rows
    without top-k, top-p or min-p take the keyed Gumbel-max directly: Sampler's filter path
    reads device values on the host (a wait for the step), and with no filter it is the same
    argmax over the same temperature-scaled logits. Rows are independent, so the split does not
    change any row's token.
    """
    x = logits.float()
    x = apply_penalties(x, rows, inplace=x is not logits)  # [S, vocab]
    num_rows, vocab_size = x.shape
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if len(random_rows) < num_rows:
        token_ids = x.argmax(dim=-1)  # [S]; ties go to the lowest id
    else:
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    unfiltered = [i for i in random_rows if not _filters(rows[i].params, vocab_size)]
    filtered = [i for i in random_rows if _filters(rows[i].params, vocab_size)]
    for group, sample in ((unfiltered, _sample_unfiltered), (filtered, sample_random)):
        if not group:
            continue
        picked = [rows[i] for i in group]
        seeds = _to_device([row.seed for row in picked], x.device)
        positions = _to_device([row.position for row in picked], x.device)
        params = [row.params for row in picked]
        if len(group) == num_rows:
            xr = x.clone() if x is logits else x  # sampling works in place
            token_ids = sample(xr, params, seeds, positions)
        else:
            idx = _to_device(group, x.device)
            token_ids[idx] = sample(x[idx], params, seeds, positions)
    return token_ids


def _filters(params: SamplingParams, vocab_size: int) -> bool:
    """Whether a random row has top-k, top-p or min-p (as Sampler decides)."""
    return 0 < params.top_k < vocab_size or params.top_p < 1.0 or params.min_p > 0.0


def _sample_unfiltered(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Temperature, then the keyed Gumbel-max, for rows with no filter; modifies logits."""
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        scale = torch.tensor(temps, dtype=torch.float32)
        logits.div_(host_to_device(scale, logits.device)[:, None])
    return gumbel_argmax(logits, seeds, positions)


def logprob_tensors(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> LogprobTensors | None:
    """Sampler's logprobs (of the raw logits [S, vocab], for the rows that ask for them) as
    device tensors, so that reading them waits for nothing but the step's own copy; None when no
    row asks."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return None
    idx = _to_device(wanted, logits.device)
    lp = logits[idx].float().log_softmax(dim=-1)  # [W, vocab]
    sampled = lp.gather(1, token_ids[idx][:, None])  # [W, 1]
    rank = (lp > sampled).sum(dim=-1) + 1  # [W]
    num_top = [rows[i].params.logprobs or 0 for i in wanted]
    top_lp, top_ids = lp.topk(min(max(num_top), lp.shape[1]), dim=-1)  # [W, n], best first
    return LogprobTensors(wanted, num_top, sampled[:, 0], rank, top_lp, top_ids)


def _row_types(sched_out: SchedulerOutput) -> contextlib.AbstractContextManager:
    """Declares a step of prompt tokens alone (no decode or verification rows): packed MoE
    layers may run such a step with FP8 activations (`moe_prefill_activations`)."""
    if sched_out.kind == PREFILL_STEP and not any(r.spec_token_ids for r in sched_out.requests):
        return prefill_only_step()
    return contextlib.nullcontext()


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)
