"""The step loop: admit requests, schedule, launch, append the tokens, speculate, report.

Every step goes one way: the scheduler's step is launched on the runner (forward and sampling
enqueued, counts advanced), and finished when its tokens reach the host (appended, stop-checked,
handed out). Synchronous scheduling finishes a step in the call that launched it; asynchronous
scheduling finishes it in the next call, after launching the next step, so the host's work hides
behind the device's. Whatever the host does while the device runs (the previous step's tokens,
deferred outputs, adaptive verification's learning) happens between a launch and its wait. A
step whose tokens the next one needs (it verified drafts; a request of it reads token values or
drafts next) is finished before the next is scheduled.

Not thread-safe by itself: the Session serializes calls into it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from libkk.cache.kv_cache import (
    KVGroups,
    determine_num_blocks,
    kv_blocks_per_seq,
    kv_cache_bytes_per_block,
)
from libkk.cache.kv_cache_manager import KVCacheManager
from libkk.cache.offload import HostKVTier
from libkk.config import EngineConfig
from libkk.engine.admission import make_request
from libkk.engine.executor import TensorParallelError, TPExecutor, start_executor
from libkk.engine.outputs import OutputProcessor, RequestOutput
from libkk.engine.rank import (
    KVPlan,
    StartupPhases,
    build_rank,
    kv_cache_dtype,
    resolve_device,
    resolve_dtype,
)
from libkk.engine.request import Request, RequestStatus
from libkk.engine.scheduler import Scheduler
from libkk.engine.speculation import build_speculation
from libkk.errors import (
    ConfigError,
    InvalidRequestError,
    UnknownRequestError,
)
from libkk.models.arch_config import ArchConfig
from libkk.models.default import resolve_model_path
from libkk.models.tokenizer import Tokenizer
from libkk.runtime.io import LaunchedStep, RunnerOutput, SchedulerOutput
from libkk.sample.grammar import GrammarCompiler, compute_next_masks
from libkk.sample.params import SamplingParams

logger = logging.getLogger("libkk")


@dataclasses.dataclass
class InFlightStep:
    """A launched step, until its tokens are appended."""

    sched_out: SchedulerOutput
    launched: LaunchedStep
    sampled: dict[str, Request]  # the requests that sample in it, as launched
    start: float  # perf_counter at launch

    def next_step_waits(
        self,
        live: dict[str, Request],
        grammars_wait: bool,
        drafts_next: Callable[[Request], bool],
    ) -> bool:
        """Whether its tokens must be known before the next step is scheduled: it verified
        drafts (how many were accepted places the next tokens), or a live request of it samples
        next from token values (penalties, min_tokens; a grammar where the runner cannot take
        masks after launch) or drafts for its next step (the proposer reads its tokens)."""
        if any(r.num_spec_tokens for r in self.sched_out.requests):
            return True
        return any(
            live.get(rid) is r
            and (
                r.reads_token_values()
                or (grammars_wait and r.grammar is not None)
                or drafts_next(r)
            )
            for rid, r in self.sampled.items()
        )


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        phases = StartupPhases()
        self.device = resolve_device(config.device)
        self.config = config = config.for_device(self.device.type)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        with phases.phase("model files and tokenizer"):
            self.model_dir: Path = resolve_model_path(config.model.model, progress=config.progress)
            self.tokenizer = Tokenizer.from_folder(self.model_dir)
            # Structured output: llguidance's tokenizer is built on the first constrained request.
            self.grammars = GrammarCompiler(
                self.model_dir / "tokenizer.json",
                self.tokenizer.vocab_size,
                self.tokenizer.eos_token_ids,
            )
        # Tensor parallelism: workers start and load their slices while this rank loads its own.
        with phases.phase("start tensor-parallel workers"):
            self.executor: TPExecutor | None = start_executor(config, self.model_dir, self.device)
        if self.executor is None:
            del phases.laps["start tensor-parallel workers"]
        rank = build_rank(
            config,
            self.device,
            self.model_dir,
            lambda model, arch, groups: self._plan_kv_cache(model, arch, groups, phases),
            phases,
            progress=config.progress,
        )
        self.model, self.arch, self.runner = rank.model, rank.arch, rank.runner
        self.num_blocks, self.max_model_len = rank.plan.num_blocks, rank.plan.max_model_len
        with phases.phase("allocate the KV cache"):
            self.host_tier = self._make_host_tier(rank.kv_caches)
            self.kv_cache_manager = KVCacheManager(
                self.num_blocks,
                config.cache.block_size,
                enable_caching=config.cache.enable_prefix_caching,
                host_tier=self.host_tier,
                windows=rank.kv_groups.windows,
            )
            self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        proposer = rank.proposer
        if self.executor is not None:  # steps and proposer calls go to every rank from here on
            with phases.phase("wait for the tensor-parallel workers' runners"):
                self.runner = self.executor.wrap(self.runner)
                if proposer is not None:
                    proposer = self.executor.wrap_proposer(proposer)
        with phases.phase("profile speculation costs"):  # adaptive verification, backoff
            self.speculation = build_speculation(
                config,
                proposer,
                self.runner,
                max_model_len=self.max_model_len,
                hidden_size=self.arch.hidden_size,
                vocab_size=self.arch.vocab_size,
                device=self.device,
                dtype=self.dtype,
            )
        if self.speculation.adaptive is None and self.speculation.backoff is None:
            del phases.laps["profile speculation costs"]
        self.outputs = OutputProcessor(self.tokenizer)
        self._stall_logged: set[str] = set()
        self.num_steps = 0
        self._in_flight: InFlightStep | None = None  # async scheduling: tokens not yet appended
        # Synchronous scheduling: requests whose last tokens are detokenized (and their outputs
        # made) while the device runs the next step.
        self._deferred: dict[str, Request] = {}
        # Seconds per start-up phase that ran, in order.
        self.startup_seconds = phases.laps
        logger.info("started in %.1f s: %s", phases.total, phases.summary())

    def _plan_kv_cache(
        self, model: nn.Module, arch: ArchConfig, groups: KVGroups, phases: StartupPhases
    ) -> KVPlan:
        """Sizes the KV cache from the memory the weights leave; every rank allocates it."""
        config = self.config
        max_model_len = self._resolve_max_model_len(arch)
        bytes_per_block = kv_cache_bytes_per_block(
            groups.group_size,
            config.cache.block_size,
            model.num_kv_heads,  # this rank's
            arch.head_dim,
            kv_cache_dtype(config, self.dtype),
        )
        self.kv_bytes_per_block = bytes_per_block
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Windowed groups: a request holds the blocks of its window and of its steps only (the
        # KV cache manager releases the rest), whatever its length.
        blocks_per_seq = kv_blocks_per_seq(
            groups,
            max_model_len,
            config.cache.block_size,
            config.scheduler.max_num_batched_tokens,
        )
        num_blocks = determine_num_blocks(
            config.cache,
            bytes_per_block,
            self.device,
            weights_bytes=self.weights_bytes,
            max_blocks_useful=config.scheduler.max_num_seqs * blocks_per_seq + 1,
            max_model_len=max_model_len,
            seq_blocks=blocks_per_seq,
        )
        self.kv_cache_bytes = num_blocks * bytes_per_block
        if self.executor is not None:  # every rank allocates the same blocks
            with phases.phase("wait for the tensor-parallel workers' weights"):
                self.executor.plan_kv_cache(num_blocks, max_model_len)
        return KVPlan(num_blocks, max_model_len)

    def _make_host_tier(self, kv_caches: list[torch.Tensor]) -> HostKVTier | None:
        cache_cfg = self.config.cache
        if cache_cfg.kv_offload_bytes is None:
            return None
        if not cache_cfg.enable_prefix_caching:
            raise ConfigError("kv_offload_bytes needs enable_prefix_caching=True")
        num_host_blocks = cache_cfg.kv_offload_bytes // self.kv_bytes_per_block
        if num_host_blocks < 1:
            raise ConfigError(
                f"kv_offload_bytes={cache_cfg.kv_offload_bytes} holds no KV block: expected at "
                f"least {self.kv_bytes_per_block} bytes"
            )
        return HostKVTier(kv_caches, num_host_blocks)

    def _resolve_max_model_len(self, arch: ArchConfig) -> int:
        limit = arch.max_position_embeddings
        asked = self.config.model.max_model_len
        if asked is not None and asked > limit:
            raise ConfigError(
                f"max_model_len={asked} exceeds the model's max_position_embeddings ({limit})"
            )
        length = asked or limit
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < length:
            raise ConfigError(
                f"max_num_batched_tokens={sched.max_num_batched_tokens} must be >= max_model_len "
                f"({length}) when enable_chunked_prefill is False"
            )
        return length

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (idempotent)."""
        if self.executor is not None:
            self.executor.shutdown()

    def stats(self) -> dict[str, int | float]:
        """Prefix-cache and host-tier counters (tokens for the prefix cache, blocks and bytes for
        the tier); with speculation, drafts verified and accepted and the mean acceptance length
        (tokens emitted per request-step that verified drafts)."""
        kv = self.kv_cache_manager
        stats: dict[str, int | float] = {
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
        }
        stats |= self.speculation.stats(self.scheduler)
        if self.host_tier is not None:
            stats |= {
                "offload_blocks_stored": self.host_tier.num_stored,
                "offload_blocks_restored": self.host_tier.num_restored,
                "offload_bytes_moved": self.host_tier.bytes_moved,
            }
        return stats

    # ---- requests -------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> Request:
        """Tokenizes and validates a request; touches no engine state (safe off the lock)."""
        return make_request(
            request_id,
            prompt,
            params,
            arrival_time,
            tokenizer=self.tokenizer,
            vocab_size=self.arch.vocab_size,
            max_model_len=self.max_model_len,
            grammars=self.grammars,
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.outputs.add(request)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput:
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            raise UnknownRequestError(
                f"unknown request id {request_id!r} (finished or never added)"
            )
        self.speculation.drop(request_id)
        return self._make_output(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns an output for every request that advanced (with
        async scheduling, those of the step the previous call launched: a request's tokens come
        back one call later)."""
        step_start = time.perf_counter()
        self._log_stalls()
        outputs: list[RequestOutput] = []
        previous, self._in_flight = self._in_flight, None
        # A request whose next step reads token values or drafts waits for its in-flight token.
        grammars_wait = not self.runner.defers_grammar_masks
        if previous is not None and previous.next_step_waits(
            self.scheduler.requests, grammars_wait, self.speculation.drafts_next
        ):
            outputs += self._finish(previous, step_start)
            previous = None
        sched_out = self.scheduler.schedule()
        launched = None
        if not sched_out.empty:
            self.num_steps += 1
            if self.host_tier is not None:
                self.host_tier.flush()  # the forward runs after this step's tier copies
            try:
                launched = self._launch(sched_out)
            except TensorParallelError:
                raise  # the ranks may be out of step: no retry, the session fails
            except Exception as e:  # noqa: BLE001 - one bad request must not take the others down
                _log_failed_step(e)
                if previous is not None:  # the requests' in-flight tokens, known first
                    outputs += self._finish(previous, step_start)
                    previous = None
                outputs += self._run_alone(sched_out)
        # While the device runs `launched`: the previous step, deferred outputs, learning.
        if previous is not None:
            outputs += self._finish(previous, step_start, retry=launched is None)
        if launched is not None and launched.launched.pending is not None:
            launched = self._sample_pending(launched, outputs)
        self.speculation.learn()
        outputs += self._emit_deferred()
        if launched is not None:
            if self.config.scheduler.async_scheduling:
                self._in_flight = launched
            else:
                outputs += self._finish(launched, step_start)
        return outputs

    def _launch(self, sched_out: SchedulerOutput) -> InFlightStep:
        start = time.perf_counter()
        launched = self.runner.launch(sched_out)
        sampled = self.scheduler.after_launch(sched_out)
        return InFlightStep(sched_out, launched, sampled, start)

    def _sample_pending(
        self, step: InFlightStep, outputs: list[RequestOutput]
    ) -> InFlightStep | None:
        """Samples a step launched before its grammar rows' previous tokens were in: their
        masks follow now. A failure runs the step again request by request (into `outputs`)."""
        pending = [
            step.sampled[s.request_id]
            for s in step.sched_out.requests
            if s.sampling is not None and s.sampling.grammar_pending
        ]
        compute_next_masks(r.grammar for r in pending if not r.finished)
        masks = {r.request_id: None if r.finished else r.grammar.next_mask() for r in pending}
        try:
            self.runner.sample_pending(step.launched, masks)
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - as a failed launch
            outputs += self._run_launched_alone(step, e)
            return None
        return step

    def _finish(
        self, step: InFlightStep, step_start: float, retry: bool = True
    ) -> list[RequestOutput]:
        """Appends a launched step's tokens, hands out what is due and drafts for the next step.
        A step that fails here is run again request by request (`retry`, when no later step was
        launched on top of it)."""
        try:
            runner_out = step.launched.wait()
        except TensorParallelError:
            raise
        except Exception as e:
            if not retry:
                raise
            return self._run_launched_alone(step, e)
        outputs = self._take_tokens(step, runner_out)
        self.speculation.record_step(step.sched_out, time.perf_counter() - step_start)
        return outputs

    def _run_launched_alone(self, step: InFlightStep, e: Exception) -> list[RequestOutput]:
        """A launched step that failed before its tokens came: its launch taken back, its
        requests run again one by one."""
        _log_failed_step(e)
        self.scheduler.undo_launch(step.sched_out, step.sampled)
        return self._run_alone(step.sched_out)

    def _take_tokens(self, step: InFlightStep, runner_out: RunnerOutput) -> list[RequestOutput]:
        """A finished step's tokens appended, its outputs handed out, the next drafts made."""
        elapsed = time.perf_counter() - step.start
        updated = self.scheduler.append(step.sched_out, step.sampled, runner_out, elapsed)
        outputs = self._emit(updated)
        self.speculation.after_step(step.sched_out, runner_out, updated, self.scheduler.requests)
        return outputs

    def _run_alone(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        """After a failed step: each of its requests alone, launched and finished at once; one
        that fails again ends with an error."""
        outputs: list[RequestOutput] = []
        for scheduled in sched_out.requests:
            rid = scheduled.request_id
            request = self.scheduler.requests.get(rid)
            if request is None:
                continue  # finished by the previous step
            if scheduled.last_token_in_flight:  # known now, and so is a grammar's mask
                start, n = scheduled.num_computed_tokens, scheduled.num_new_tokens
                scheduled = dataclasses.replace(
                    scheduled,
                    token_ids=request.all_token_ids[start : start + n],
                    sampling=request.sampling_row() if scheduled.sampling is not None else None,
                    last_token_in_flight=False,
                )
            single = SchedulerOutput(requests=[scheduled], kind=sched_out.kind)
            try:
                step = self._launch(single)
                runner_out = step.launched.wait()
            except Exception as e:  # noqa: BLE001
                logger.error("request %s failed: %s: %s", rid, type(e).__name__, e)
                request = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
                if request is not None:
                    request.error = f"{type(e).__name__}: {e}"
                    outputs.append(self._make_output(request))
                self.speculation.drop(rid)
                continue
            outputs += self._take_tokens(step, runner_out)
        return outputs

    # ---- outputs --------------------------------------------------------------------------

    def _emit(self, updated: list[Request]) -> list[RequestOutput]:
        """Outputs of the requests that received tokens. Synchronous scheduling defers a
        request that goes on, has no stop string (detokenizing finds those) and has its first
        token out: it is detokenized while the device runs the next step (`_emit_deferred`).
        Async scheduling already finishes a step while the next one runs: nothing is deferred."""
        defer = not self.config.scheduler.async_scheduling
        outputs = []
        for request in updated:
            if (
                defer
                and not request.finished
                and not request.params.stop
                and request.num_output_tokens > 1
            ):
                self._deferred[request.request_id] = request
            else:
                outputs.append(self._process_tokens(request))
        return outputs

    def _emit_deferred(self) -> list[RequestOutput]:
        deferred, self._deferred = self._deferred, {}
        return [self._process_tokens(request) for request in deferred.values()]

    def _process_tokens(self, request: Request) -> RequestOutput:
        self._deferred.pop(request.request_id, None)  # all its new tokens are detokenized here
        stop = self.outputs.detokenize(request)
        if stop is not None and not request.finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            request.stop_reason = stop
        elif stop is not None:
            # A stop token and a stop string in the same step: the string is the reason.
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop
        return self._make_output(request)

    def _make_output(self, request: Request) -> RequestOutput:
        if self._deferred.pop(request.request_id, None) is not None:
            self.outputs.detokenize(request)  # ended before its deferred step was finished
        if request.finished:
            self._stall_logged.discard(request.request_id)
        return self.outputs.output(request)

    def _log_stalls(self) -> None:
        now = time.monotonic()
        threshold = self.config.stall_threshold_s
        for rid, request in self.scheduler.requests.items():
            last = request.timeline.last_progress or request.timeline.arrival
            if now - last > threshold and rid not in self._stall_logged:
                self._stall_logged.add(rid)
                logger.warning(
                    "request %s made no progress for %.1fs (status %s): %s",
                    rid,
                    now - last,
                    request.status.name,
                    request.timeline.summary(now),
                )


def _log_failed_step(e: Exception) -> None:
    logger.warning(
        "step failed (%s: %s); retrying its requests one by one",
        type(e).__name__,
        e,
        exc_info=True,
    )
