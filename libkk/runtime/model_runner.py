"""Runs one scheduled step: builds the flat batch, runs the forward on a step backend, samples or
verifies the next tokens, and starts their copy to the host.

`launch(sched)` enqueues all of it and returns a `LaunchedStep` whose `wait()` hands out the
tokens; the engine waits at once (synchronous scheduling) or after launching the next step
(asynchronous). Nothing in a launch reads the device back, except where sampling or verifying a
row with top-k or top-p finds its cut past the first candidates.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from libkk.config import CompilationConfig, SchedulerConfig
from libkk.distributed import get_tp_size
from libkk.layers.attention import kv_scale_calibration_pending
from libkk.layers.embedding import vocab_parallel_head
from libkk.layers.host_embedding import HostRowsEmbedding
from libkk.layers.quant_moe import prefill_only_step
from libkk.runtime.input_batch import InputBatch, build_input_batch, host_to_device
from libkk.runtime.io import PREFILL_STEP, LaunchedStep, ScheduledRequest, SchedulerOutput
from libkk.runtime.step_backends import GraphShape, StepBackends
from libkk.runtime.verify import VerifiedTokens, shards_cover, verify, verify_from_shards
from libkk.sample.sampler import LogprobTensors, Sampler, SamplingRow
from libkk.spec_decode import RunnerSpeculation
from libkk.spec_decode.vocab_parallel import tp_gather


class ModelRunner:
    # A step's grammar masks may follow its launch (`sample_pending`).
    defers_grammar_masks = True

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[Tensor],
        block_size: int,
        device: torch.device,
        *,
        layer_kv_groups: Sequence[int] | None = None,
        compilation: CompilationConfig | None = None,
        max_num_seqs: int = 1,
        max_model_len: int = 1,
        max_num_batched_tokens: int | None = None,
        progress: bool = False,
        speculation: RunnerSpeculation | None = None,
    ) -> None:
        """kv_caches: each attention layer's KV tensor; layer_kv_groups: each layer's KV group (None:
        one group; docs/memory.md); max_num_batched_tokens: the largest step (None: the
        scheduler's default), up to which graphs are captured and packed MoE tiles tuned;
        speculation: what verifying drafts needs (None: no speculation)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.speculation = spec = speculation or RunnerSpeculation()
        self.sampler = Sampler()
        self.kv_caches = kv_caches
        layers = model.attention_layers()
        if len(layers) != len(kv_caches):
            raise ValueError(f"{len(layers)} attention layers but {len(kv_caches)} KV caches")
        kv_groups = list(layer_kv_groups or [0] * len(layers))
        for layer, cache, group in zip(layers, kv_caches, kv_groups, strict=True):
            layer.kv_cache, layer.kv_group = cache, group
        self.attention_layers = layers
        self.num_kv_groups = max(kv_groups, default=0) + 1
        # FP8 scale calibration runs in the eager attention op of the first real store, and a
        # FULL graph replay runs no Python: no replay until every layer has calibrated.
        self._kv_scales_pending = kv_scale_calibration_pending(layers)
        self.host_embeddings = [m for m in model.modules() if isinstance(m, HostRowsEmbedding)]
        # Vocab-parallel verification: every rank verifies drafts from its vocabulary shard of
        # the target logits, q of sampled drafts from its proposer's kept shards.
        self.vocab_head = None
        if spec.shard_drafts is not None:
            self.vocab_head = vocab_parallel_head(model)
            if self.vocab_head is None or get_tp_size() == 1:
                raise ValueError(
                    "vocab-parallel verification needs tensor parallelism and a model whose LM "
                    "head gives every rank a vocabulary shard"
                )
        if spec.aux_layers:  # before anything is captured: graphs keep what the forward stashes
            model.set_aux_hidden_layers(spec.aux_layers)
        self.step_backends = StepBackends(
            model,
            kv_caches,
            device,
            compilation or CompilationConfig(),
            GraphShape(
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                max_num_batched_tokens=(
                    max_num_batched_tokens or SchedulerConfig().max_num_batched_tokens
                ),
                block_size=block_size,
                query_lens=spec.query_lens,
                middle_lens_max_size=spec.middle_lens_max_size,
                keeps_aux=bool(spec.aux_layers),
                num_kv_groups=self.num_kv_groups,
            ),
            progress,
        )
        # The last launched step's sampled ids [S] on the device and each request's row in them:
        # the next step's in-flight input tokens are gathered from there.
        self._in_flight_ids: Tensor | None = None
        self._in_flight_rows: dict[str, int] = {}

    # ---- what start-up made -----------------------------------------------------------------

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Seconds of this runner's start-up phases: tile tuning, compile + graph capture."""
        return self.step_backends.startup_seconds

    @property
    def compile_cache(self) -> str:
        return self.step_backends.compile_cache

    @property
    def moe_tile_choices(self) -> list:
        return self.step_backends.moe_tile_choices

    @property
    def forward(self):  # noqa: ANN201 - the model forward steps run (compiled or not)
        return self.step_backends.forward

    @property
    def graphs(self):  # noqa: ANN201 - DecodeGraphs or None
        return self.step_backends.decode_graphs

    def graph_shapes(self) -> list[tuple[int, int]]:
        """(size, query length) of every decode/verification graph (captured at start-up, or
        when first needed under a lazy capture)."""
        graphs = self.graphs
        return [(size, q) for q, size in graphs.planned] if graphs is not None else []

    @torch.inference_mode()
    def verify_on_graph(self, size: int, q: int) -> None:
        """The device work of a verification step the (q, size) graph runs, on padding rows:
        the replay and the logits of its size * q rows (for adaptive verification's costs)."""
        assert self.graphs is not None
        self.model.compute_logits(self.graphs.replay_padding(size, q))

    # ---- a step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, sched_out: SchedulerOutput) -> LaunchedStep:
        """Enqueues the step (forward, sampling or verification) and the copy of its tokens to
        the host. Tokens marked `last_token_in_flight` are read from the previous launched
        step's device ids. A step with a grammar row whose mask awaits its in-flight token is
        launched up to the logits' hidden states: `sample_pending` samples it."""
        batch = build_input_batch(sched_out, self.block_size, self.device, self.num_kv_groups)
        self._gather_in_flight_inputs(sched_out, batch)
        for embedding in self.host_embeddings:  # rows of host tables, gathered before the forward
            embedding.stage(batch.input_ids_cpu)
        if self._kv_scales_pending:
            self._kv_scales_pending = kv_scale_calibration_pending(self.attention_layers)
        with _row_types(sched_out):
            hidden, aux = self.step_backends.run(batch, replays_allowed=not self._kv_scales_pending)
        if aux is not None:  # a graph's stash, which the next replay (maybe launched first) reuses
            aux = aux.clone()
        launched = LaunchedStep(
            sched_out,
            list(batch.sampling_request_ids),
            aux=aux,
            query_starts=batch.attn_metadata.query_start_loc_cpu[:-1],
        )
        if any(row.grammar_pending for row in batch.sampling_rows):
            launched.pending = (batch, hidden)
            self._in_flight_ids, self._in_flight_rows = None, {}
        else:
            self._sample_into(launched, batch, hidden)
        return launched

    @torch.inference_mode()
    def sample_pending(self, launched: LaunchedStep, masks: dict[str, Tensor | None]) -> None:
        """Samples a step launched with grammar rows whose masks awaited their in-flight tokens,
        now known: `masks` by request id (None: sample the row unconstrained, for a request
        that finished meanwhile and whose token is dropped)."""
        assert launched.pending is not None
        batch, hidden = launched.pending
        launched.pending = None
        batch.sampling_rows = [
            dataclasses.replace(row, grammar_mask=masks[rid], grammar_pending=False)
            if row.grammar_pending
            else row
            for rid, row in zip(batch.sampling_request_ids, batch.sampling_rows, strict=True)
        ]
        self._sample_into(launched, batch, hidden)

    def _sample_into(self, launched: LaunchedStep, batch: InputBatch, hidden: Tensor) -> None:
        """Samples or verifies the step's rows and starts their tokens' copy to the host."""
        tokens, logprobs = self._sample(launched.sched, batch, hidden)  # [S, W] on the device
        if tokens.shape[1] == 1:  # each request's next input, for a step launched before wait
            self._in_flight_ids = tokens[:, 0]
            self._in_flight_rows = {rid: i for i, rid in enumerate(launched.request_ids)}
        else:
            self._in_flight_ids, self._in_flight_rows = None, {}
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
            tokens = host.copy_(tokens, non_blocking=True)
            if logprobs is not None:
                logprobs = logprobs.to_host(non_blocking=True)
            launched.copied = torch.cuda.Event()
            launched.copied.record()
        launched.tokens, launched.logprobs = tokens, logprobs

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

    def _sample(
        self, sched_out: SchedulerOutput, batch: InputBatch, hidden: Tensor
    ) -> tuple[Tensor, LogprobTensors | None]:
        """The step's tokens [S, W] (W = 1 without drafts) and their logprobs, on the device."""
        rows = batch.sampling_rows
        if not rows:
            return torch.empty((0, 1), dtype=torch.int64, device=hidden.device), None
        if any(batch.num_spec):
            return self._sample_with_drafts(sched_out, batch, hidden)
        if _argmax_from_shards(rows):
            # One [rows, 2] gather of each shard's (max, id) instead of whole logit rows.
            return self.model.greedy_tokens(hidden[batch.logits_indices])[:, None], None
        # At TP > 1 every rank gathers the same whole rows and samples the same tokens (keyed
        # noise): each keeps its own in-flight ids for the next step's inputs.
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S, vocab]
        sampled = self.sampler.sample(logits, rows)
        return sampled.token_ids[:, None], sampled.logprobs

    def _sample_with_drafts(
        self, sched_out: SchedulerOutput, batch: InputBatch, hidden: Tensor
    ) -> tuple[Tensor, LogprobTensors | None]:
        """Plain rows through the sampler, rows with drafts through verification: from this
        rank's vocab shard when this runner verifies vocab-parallel and the step allows it (the
        same decision on every rank: it reads only the step rank 0 sent), else on whole rows."""
        by_id = {r.request_id: r for r in sched_out.requests}
        plain_rows: list[SamplingRow] = []
        plain_at: list[int] = []  # each plain row's first logits row
        plain_idx: list[int] = []  # and its place among the sampling rows
        spec: list[ScheduledRequest] = []
        spec_at: list[int] = []
        spec_idx: list[int] = []
        offset = 0
        for i, (rid, row, n) in enumerate(
            zip(batch.sampling_request_ids, batch.sampling_rows, batch.num_spec, strict=True)
        ):
            if n == 0:
                plain_rows.append(row)
                plain_at.append(offset)
                plain_idx.append(i)
            else:
                spec.append(by_id[rid])
                spec_at.append(offset)
                spec_idx.append(i)
            offset += n + 1
        plain_logits, verified = self._verify(batch, hidden, spec, spec_at, plain_at)
        width = verified.tokens.shape[1]
        tokens = torch.full(
            (len(batch.sampling_rows), width), -1, dtype=torch.int64, device=hidden.device
        )
        tokens[_to_device(spec_idx, tokens.device)] = verified.tokens
        parts = [(verified.logprobs, [i * width + j for i in spec_idx for j in range(width)])]
        if plain_logits is not None:
            sampled = self.sampler.sample(plain_logits, plain_rows)
            tokens[_to_device(plain_idx, tokens.device), 0] = sampled.token_ids
            parts.append((sampled.logprobs, [i * width for i in plain_idx]))
        return tokens, _merge_logprobs(parts)

    def _verify(
        self,
        batch: InputBatch,
        hidden: Tensor,
        spec: list[ScheduledRequest],
        spec_at: list[int],
        plain_at: list[int],
    ) -> tuple[Tensor | None, VerifiedTokens]:
        """(whole logits of the plain rows or None, the verified drafts of `spec`)."""
        plain_logits = None
        head = self.vocab_head
        synthetic = self.speculation.synthetic_rates
        if head is not None and synthetic is None and shards_cover(spec, head.vocab_size):
            assert self.speculation.shard_drafts is not None
            logits = head(hidden[batch.logits_indices])  # [sum(1 + n), vocab / tp]
            if plain_at:  # whole rows for the sampler, of these rows only
                plain_logits = head.gather_logits(logits[_to_device(plain_at, logits.device)])
            own = head.vocab_shard
            spec_logits = [
                logits[at : at + r.num_spec_tokens + 1, : len(own)]
                for r, at in zip(spec, spec_at, strict=True)
            ]
            shard_drafts = self.speculation.shard_drafts
            verified = verify_from_shards(
                spec_logits, spec, own.start, shard_drafts, gather=tp_gather
            )
            return plain_logits, verified
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [rows, vocab]
        if plain_at:
            plain_logits = logits[_to_device(plain_at, logits.device)]
        if head is not None:
            spec = self._with_gathered_drafts(spec)
        spec_logits = [
            logits[at : at + r.num_spec_tokens + 1] for r, at in zip(spec, spec_at, strict=True)
        ]  # [1 + n, vocab] each
        return plain_logits, verify(spec_logits, spec, synthetic_rates=synthetic)

    def _with_gathered_drafts(self, spec: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The requests with the whole draft logits of sampled drafts that were drafted from
        vocab shards (their q, for verification on whole rows): one gather of the kept shards."""
        head, kept = self.vocab_head, self.speculation.shard_drafts
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


def _merge_logprobs(
    parts: Sequence[tuple[LogprobTensors | None, Sequence[int]]],
) -> LogprobTensors | None:
    """One LogprobTensors of several, each with its rows renumbered by its map (row j of a
    part becomes slot map[j]); top entries are padded to the widest (never read past num_top)."""
    present = [(lp, slots) for lp, slots in parts if lp is not None]
    if not present:
        return None
    if len(present) == 1:
        lp, slots = present[0]
        return dataclasses.replace(lp, rows=[slots[j] for j in lp.rows])
    width = max(lp.top_ids.shape[1] for lp, _ in present)

    def padded(t: Tensor, value: float) -> Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    return LogprobTensors(
        rows=[slots[j] for lp, slots in present for j in lp.rows],
        num_top=[n for lp, _ in present for n in lp.num_top],
        sampled=torch.cat([lp.sampled for lp, _ in present]),
        rank=torch.cat([lp.rank for lp, _ in present]),
        top_logprobs=torch.cat([padded(lp.top_logprobs, -torch.inf) for lp, _ in present]),
        top_ids=torch.cat([padded(lp.top_ids, 0) for lp, _ in present]),
    )


def _argmax_from_shards(rows: Sequence[SamplingRow]) -> bool:
    """Whether every rank takes these rows' tokens as the argmax from its vocabulary shard
    (`greedy_tokens`: one [rows, 2] gather) instead of gathering whole logit rows. Every rank
    decides alike: the rows are those of the step rank 0 sent."""
    return get_tp_size() > 1 and all(r.takes_raw_argmax() for r in rows)


def _row_types(sched_out: SchedulerOutput) -> contextlib.AbstractContextManager:
    """Declares a step of prompt tokens alone (no decode or verification rows): packed MoE
    layers may run such a step with FP8 activations (`moe_prefill_activations`)."""
    if sched_out.kind == PREFILL_STEP and not any(r.spec_token_ids for r in sched_out.requests):
        return prefill_only_step()
    return contextlib.nullcontext()


def _to_device(values: list[int], device: torch.device) -> Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)
