"""The step loop: load the model, admit requests, schedule, run, sample, detokenize, report.

Not thread-safe by itself: the Session serializes calls into it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from libkk.cache.host_tables import share_embedding
from libkk.cache.kv_cache import allocate_kv_caches, determine_num_blocks, kv_cache_bytes_per_block
from libkk.cache.kv_cache_manager import KVCacheManager
from libkk.cache.offload import HostKVTier
from libkk.config import EngineConfig
from libkk.engine.admission import make_request
from libkk.engine.executor import TensorParallelError, TPExecutor, start_executor
from libkk.engine.outputs import OutputProcessor, RequestOutput
from libkk.engine.request import Request, RequestStatus
from libkk.engine.scheduler import Scheduler
from libkk.engine.speculation import AdaptiveDrafts, profile_costs
from libkk.errors import (
    ConfigError,
    InvalidRequestError,
    UnknownRequestError,
)
from libkk.layers.attention import calibrate_kv_scales_on_first_prefill
from libkk.models.default import resolve_model_path
from libkk.models.loader import load_model
from libkk.models.tokenizer import Tokenizer
from libkk.runtime.io import LaunchedStep, ModelRunnerOutput, SchedulerOutput
from libkk.runtime.model_runner import ModelRunner
from libkk.sample.params import SamplingParams
from libkk.spec_decode import build_proposer, runner_speculation
from libkk.spec_decode.base import ProposeRequest

logger = logging.getLogger("libkk")

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


@dataclasses.dataclass
class InFlightStep:
    """A launched step of async scheduling, until its tokens are appended."""

    sched_out: SchedulerOutput
    launched: LaunchedStep
    sampled: dict[str, Request]  # the requests that sample in it, as launched
    start: float  # perf_counter at launch

    def live_requests(self, live: dict[str, Request]) -> list[Request]:
        """Its sampling requests that are still unfinished (the same objects)."""
        return [r for rid, r in self.sampled.items() if live.get(rid) is r]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        clock = _StartupClock()
        self.device = resolve_device(config.device)
        self.config = config = config.for_device(self.device.type)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.model_dir: Path = resolve_model_path(config.model.model, progress=config.progress)
        self.tokenizer = Tokenizer.from_folder(self.model_dir)
        clock.lap("model files and tokenizer")
        # Tensor parallelism: workers start and load their slices while this rank loads its own.
        self.executor: TPExecutor | None = start_executor(config, self.model_dir, self.device)
        if self.executor is not None:
            clock.lap("start tensor-parallel workers")
        self.model, self.arch = load_model(
            self.model_dir,
            self.dtype,
            self.device,
            progress=config.progress,
            moe_weight_format=config.model.moe_weight_format,
            quantization=config.model.quantization,
            csf_prefetch=config.model.csf_prefetch,
            moe_prefill_activations=config.model.moe_prefill_activations,
        )
        clock.lap("load weights")
        if config.cache.calculate_kv_scales:
            calibrate_kv_scales_on_first_prefill(self.model)
        if config.model.shared_host_tables:
            sched = config.scheduler
            # The staged rows of the largest step: a token budget, or a padded decode graph.
            spec = config.speculative
            rows_per_seq = 1 + (spec.num_speculative_tokens if spec.method else 0)
            max_step_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs * rows_per_seq)
            share_embedding(self.model, self.model_dir, self.device, max_step_tokens)
        self.max_model_len = self._resolve_max_model_len()
        cache_cfg = config.cache
        block_size = cache_cfg.block_size
        self.kv_dtype = torch.float8_e4m3fn if cache_cfg.kv_cache_dtype == "fp8" else self.dtype
        bytes_per_block = kv_cache_bytes_per_block(
            self.arch.num_layers,
            block_size,
            self.model.num_kv_heads,  # this rank's
            self.arch.head_dim,
            self.kv_dtype,
        )
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        blocks_per_seq = -(-self.max_model_len // block_size)
        self.num_blocks = determine_num_blocks(
            cache_cfg,
            bytes_per_block,
            self.device,
            weights_bytes=self.weights_bytes,
            max_blocks_useful=config.scheduler.max_num_seqs * blocks_per_seq + 1,
            max_model_len=self.max_model_len,
        )
        self.kv_cache_bytes = self.num_blocks * bytes_per_block
        kv_caches = allocate_kv_caches(
            self.arch.num_layers,
            self.num_blocks,
            block_size,
            self.model.num_kv_heads,  # this rank's
            self.arch.head_dim,
            self.kv_dtype,
            self.device,
        )
        self.host_tier = self._make_host_tier(kv_caches, bytes_per_block)
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            block_size,
            enable_caching=cache_cfg.enable_prefix_caching,
            host_tier=self.host_tier,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        clock.lap("allocate the KV cache")
        if self.executor is not None:  # every rank allocates the same blocks
            self.executor.plan_kv_cache(self.num_blocks, self.max_model_len)
            clock.lap("wait for the tensor-parallel workers' weights")
        # The proposer first: its target layers are stashed by the forward the runner captures.
        self.proposer = build_proposer(
            config,
            self.model,
            target_dir=self.model_dir,
            device=self.device,
            dtype=self.dtype,
            num_target_blocks=self.num_blocks,
            progress=config.progress,
        )
        if self.proposer is not None:
            clock.lap("build the proposer")
        spec = config.speculative
        runner_spec = runner_speculation(config, self.proposer)
        aux_layers = runner_spec.aux_layers
        if aux_layers:
            self.model.set_aux_hidden_layers(aux_layers)
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            block_size,
            self.device,
            compilation=config.compilation,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            progress=config.progress,
            query_lens=runner_spec.query_lens,
            middle_lens_max_size=runner_spec.middle_lens_max_size,
            stash_aux_hidden=bool(aux_layers),
        )
        clock.add(self.runner.startup_seconds)
        clock.lap("build the runner")  # what its own phases leave
        if self.proposer is not None:
            self.runner.set_speculation(aux_layers, runner_spec.synthetic_rates)
        self.adaptive: AdaptiveDrafts | None = None
        if self.proposer is not None and spec.adaptive_verification:
            cost = profile_costs(
                self.runner,
                self.proposer,
                num_speculative_tokens=spec.num_speculative_tokens,
                max_num_seqs=config.scheduler.max_num_seqs,
                block_size=block_size,
                hidden_size=self.arch.hidden_size,
                vocab_size=self.arch.vocab_size,
                device=self.device,
                dtype=self.dtype,
            )
            self.adaptive = AdaptiveDrafts(
                cost,
                spec.num_speculative_tokens,
                autoregressive_sampling=(
                    spec.method == "draft_model" and spec.draft_sampling == "probabilistic"
                ),
            )
            clock.lap("profile speculation costs")
        if self.executor is not None:  # steps go to every rank from here on
            self.runner = self.executor.wrap(self.runner)
            if self.proposer is not None:  # its calls are made on every rank
                self.proposer = self.executor.wrap_proposer(self.proposer)
            clock.lap("wait for the tensor-parallel workers' runners")
        self.outputs = OutputProcessor(self.tokenizer)
        self._stall_logged: set[str] = set()
        self.num_steps = 0
        # Async scheduling: the launched step whose tokens are not yet on the host.
        self._in_flight: InFlightStep | None = None
        # Synchronous scheduling: running requests whose last step's tokens are detokenized (and
        # their outputs made) while the device runs the next step.
        self._deferred: dict[str, Request] = {}
        # Seconds per start-up phase that ran, in order.
        self.startup_seconds = clock.laps
        logger.info("started in %.1f s: %s", clock.total, clock.summary())

    def _make_host_tier(
        self, kv_caches: list[torch.Tensor], bytes_per_block: int
    ) -> HostKVTier | None:
        cache_cfg = self.config.cache
        if cache_cfg.kv_offload_bytes is None:
            return None
        if not cache_cfg.enable_prefix_caching:
            raise ConfigError("kv_offload_bytes needs enable_prefix_caching=True")
        num_host_blocks = cache_cfg.kv_offload_bytes // bytes_per_block
        if num_host_blocks < 1:
            raise ConfigError(
                f"kv_offload_bytes={cache_cfg.kv_offload_bytes} holds no KV block: expected at "
                f"least {bytes_per_block} bytes"
            )
        return HostKVTier(kv_caches, num_host_blocks)

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
        if self.proposer is not None:
            sched = self.scheduler
            stats |= {
                "spec_num_draft_tokens": sched.num_draft_tokens,
                "spec_num_accepted_tokens": sched.num_accepted_tokens,
                "spec_num_verify_steps": sched.num_verify_rows,
                "spec_mean_acceptance_length": (
                    sched.num_verified_emitted / sched.num_verify_rows
                    if sched.num_verify_rows
                    else 0.0
                ),
            }
        if self.host_tier is not None:
            stats |= {
                "offload_blocks_stored": self.host_tier.num_stored,
                "offload_blocks_restored": self.host_tier.num_restored,
                "offload_bytes_moved": self.host_tier.bytes_moved,
            }
        return stats

    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
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
        self._drop_draft_state(request_id)
        return self._make_output(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns an output for every request that advanced."""
        if self.config.scheduler.async_scheduling:
            return self._step_async()
        step_start = time.perf_counter()
        self._log_stalls()
        sched_out = self.scheduler.schedule()
        if sched_out.empty:
            return self._finish_deferred()
        self.num_steps += 1
        if self.host_tier is not None:
            self.host_tier.flush()  # the forward runs after this step's tier copies
        start = time.perf_counter()
        outputs: list[RequestOutput] = []

        def finish_deferred() -> None:
            outputs.extend(self._finish_deferred())

        try:
            runner_out = self.runner.execute(sched_out, while_device_runs=finish_deferred)
        except TensorParallelError:
            raise  # the ranks may be out of step: no retry, the session fails
        except Exception as e:  # noqa: BLE001 - one bad request must not take the others down
            logger.warning(
                "step failed (%s: %s); retrying its requests one by one",
                type(e).__name__,
                e,
                exc_info=True,
            )
            runner_out = self._execute_isolated(sched_out, outputs)
        finish_deferred()  # when the step failed before the runner called it (else a no-op)
        elapsed = time.perf_counter() - start
        updated = self.scheduler.update(sched_out, runner_out, elapsed)
        if self.adaptive is not None:
            self.adaptive.observe(sched_out, runner_out)
        for request in updated:
            # A request that goes on, has no stop string (detokenizing finds those) and has its
            # first token out is detokenized with the next step, under its forward.
            if request.finished or request.params.stop or request.num_output_tokens == 1:
                outputs.append(self._process_tokens(request))
            else:
                self._deferred[request.request_id] = request
        if self.proposer is not None:
            self._propose(sched_out, runner_out, updated)
        if self.adaptive is not None:
            self.adaptive.record_step(sched_out, time.perf_counter() - step_start)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """Launches this step, then finishes the previous one while the device runs this one.

        The outputs returned are those of the previous launched step (a request's tokens come
        back one step() call later than in synchronous mode). A request whose next sampling
        reads token values (penalties, min_tokens) waits for its in-flight token first, as does
        a call with nothing new to launch, so the last step is always finished.
        """
        self._log_stalls()
        outputs: list[RequestOutput] = []
        previous = self._in_flight
        if previous is not None and any(
            r.reads_token_values() for r in previous.live_requests(self.scheduler.requests)
        ):
            outputs += self._finish_in_flight()
        sched_out = self.scheduler.schedule()
        if sched_out.empty:
            return outputs + self._finish_in_flight()
        self.num_steps += 1
        if self.host_tier is not None:
            self.host_tier.flush()  # the forward runs after this step's tier copies
        try:
            launched = self._launch(sched_out)
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad request must not take the others down
            logger.warning(
                "step failed (%s: %s); retrying its requests one by one",
                type(e).__name__,
                e,
                exc_info=True,
            )
            outputs += self._finish_in_flight()
            return outputs + self._launch_isolated(sched_out)
        outputs += self._finish_in_flight()  # while the device runs `launched`
        self._in_flight = launched
        return outputs

    def _finish_in_flight(self) -> list[RequestOutput]:
        step, self._in_flight = self._in_flight, None
        return [] if step is None else self._finish_launched(step)

    def _launch(self, sched_out: SchedulerOutput) -> InFlightStep:
        start = time.perf_counter()
        launched = self.runner.launch(sched_out)
        self.scheduler.after_launch(sched_out)
        live = self.scheduler.requests
        sampled = {rid: live[rid] for rid in launched.request_ids}
        return InFlightStep(sched_out, launched, sampled, start)

    def _finish_launched(self, step: InFlightStep) -> list[RequestOutput]:
        runner_out = step.launched.wait()
        elapsed = time.perf_counter() - step.start
        updated = self.scheduler.resolve(step.sampled, runner_out, step.sched_out, elapsed)
        return [self._process_tokens(request) for request in updated]

    def _launch_isolated(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        """After a failed launch (and with the previous step finished): each request alone,
        finished at once; one that fails again ends with an error."""
        outputs: list[RequestOutput] = []
        for scheduled in sched_out.requests:
            rid = scheduled.request_id
            request = self.scheduler.requests.get(rid)
            if request is None:
                continue  # finished by the previous step
            if scheduled.last_token_in_flight:  # known now
                start, n = scheduled.num_computed_tokens, scheduled.num_new_tokens
                scheduled = dataclasses.replace(
                    scheduled,
                    token_ids=request.all_token_ids[start : start + n],
                    last_token_in_flight=False,
                )
            single = SchedulerOutput(requests=[scheduled], kind=sched_out.kind)
            try:
                step = self._launch(single)
            except Exception as e:  # noqa: BLE001
                logger.error("request %s failed: %s: %s", rid, type(e).__name__, e)
                request = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
                if request is not None:
                    request.error = f"{type(e).__name__}: {e}"
                    outputs.append(self._make_output(request))
                continue
            outputs += self._finish_launched(step)
        return outputs

    def _drop_draft_state(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.remove(request_id)
        if self.adaptive is not None:
            self.adaptive.forget(request_id)

    def _propose(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput, updated: list[Request]
    ) -> None:
        """Drafts for the next step of every request that sampled and goes on."""
        proposer = self.proposer
        assert proposer is not None
        for rid in sched_out.preempted_request_ids:
            self._drop_draft_state(rid)
        live = self.scheduler.requests
        for rid, (start, hidden) in runner_out.aux_hidden.items():
            request = live.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                proposer.add_context(rid, start, hidden)
        k = self.config.speculative.num_speculative_tokens
        asks: list[tuple[Request, ProposeRequest]] = []
        for request in updated:
            if request.finished:
                self._drop_draft_state(request.request_id)
                continue
            max_drafts = min(
                k,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if max_drafts <= 0:
                continue
            # The live token list, not a copy (O(length) per request and step): proposers read
            # it during the call only.
            ask = ProposeRequest(
                request.request_id, request.all_token_ids, request.sampling_row(), max_drafts
            )
            asks.append((request, ask))
        if not asks:
            return
        proposal = proposer.propose([ask for _, ask in asks])
        vocab = self.arch.vocab_size
        for (request, ask), drafts, logits in zip(
            asks, proposal.token_ids, proposal.draft_logits, strict=True
        ):
            drafts = [int(t) for t in drafts[: ask.max_drafts]]
            if not drafts or any(not 0 <= t < vocab for t in drafts):
                request.clear_drafts()
                continue
            request.spec_token_ids = drafts
            request.draft_logits = None if logits is None else logits[: len(drafts)]
        if self.adaptive is not None:
            self.adaptive.trim([request for request, _ in asks])

    def _execute_isolated(
        self, sched_out: SchedulerOutput, outputs: list[RequestOutput]
    ) -> ModelRunnerOutput:
        merged = ModelRunnerOutput()
        for scheduled in sched_out.requests:
            single = SchedulerOutput(requests=[scheduled], kind=sched_out.kind)
            try:
                result = self.runner.execute(single)
            except Exception as e:  # noqa: BLE001
                logger.error("request %s failed: %s: %s", scheduled.request_id, type(e).__name__, e)
                request = self.scheduler.finish_request(
                    scheduled.request_id, RequestStatus.FINISHED_ERROR
                )
                if request is not None:
                    request.error = f"{type(e).__name__}: {e}"
                    outputs.append(self._make_output(request))
                self._drop_draft_state(scheduled.request_id)
                continue
            merged.sampled_token_ids.update(result.sampled_token_ids)
            merged.logprobs.update(result.logprobs)
            merged.aux_hidden.update(result.aux_hidden)
        return merged

    def _finish_deferred(self) -> list[RequestOutput]:
        if self.adaptive is not None:
            self.adaptive.learn()
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


class _StartupClock:
    """Seconds per named start-up phase: each lap is the time since the previous one."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = self._start = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now

    def add(self, laps: dict[str, float]) -> None:
        """Phases timed elsewhere that happened since the previous lap (the next lap excludes
        them)."""
        self.laps.update(laps)
        self._last += sum(laps.values())

    @property
    def total(self) -> float:
        return self._last - self._start

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.laps.items())
