"""A tensor-parallel worker process (ranks 1..N-1): started by `TPExecutor` as a fresh interpreter
running `worker_entry`, it joins the group, loads its part of the model, builds the same runner
and proposer as rank 0, then carries out every step and proposer call rank 0 sends over its socket
until the stop message."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch

from libkk.config import EngineConfig
from libkk.distributed import (
    destroy_tensor_parallel,
    enter_phase,
    init_tensor_parallel,
    set_phase_listener,
)
from libkk.engine.executor import rank_device
from libkk.engine.step_codec import StepDecoder
from libkk.engine.tp_proposer import ProposerCalls, apply_proposer_call, link_vocab_parallel
from libkk.runtime.heap import freeze_startup_objects
from libkk.runtime.model_runner import ModelRunner
from libkk.sample.sampler import SamplerOutput
from libkk.spec_decode import build_proposer, runner_speculation


class _NoSampler:
    """A worker's stand-in for the Sampler: its tokens are never read (rank 0's are)."""

    def __call__(self, logits: torch.Tensor, rows: list) -> SamplerOutput:
        return SamplerOutput(token_ids=[0] * len(rows), logprobs=[None] * len(rows))


def _watch_parent(parent_pid: int) -> None:
    """Exits this worker when the process that started it is gone (killed, crashed)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_entry() -> None:
    """`python -c` entry of a worker: its arguments come first over the socket (argv[1])."""
    conn = Connection(int(sys.argv[1]))
    _worker_main(*conn.recv(), conn=conn)


def _worker_main(
    rank: int,
    size: int,
    init_method: str,
    config_json: bytes,
    model_dir: str,
    parent_pid: int,
    *,
    conn: Connection,
) -> None:
    """Rank `rank`: join the group, load this rank's weights, then run every step rank 0 sends."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    # `kill -USR1 PID` prints every thread's stack to stderr: where a stuck worker waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = 0
    destroyed = True
    # Rank 0 names this worker's last phase when the start-up stops or fails.
    set_phase_listener(lambda phase: conn.send(("phase", phase)))
    try:
        from libkk.cache.kv_cache import allocate_kv_caches
        from libkk.engine.engine import resolve_device, resolve_dtype
        from libkk.layers.attention import calibrate_kv_scales_on_first_prefill
        from libkk.models.loader import load_model

        config = msgspec.json.decode(config_json, type=EngineConfig)
        device = rank_device(resolve_device(config.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dtype = resolve_dtype(config.model.dtype, device)
        conn.send(("started",))
        enter_phase("join the group")
        init_tensor_parallel(rank, size, init_method, device, config.parallel.worker_timeout_s)
        enter_phase("load weights")
        model, arch = load_model(
            Path(model_dir),
            dtype,
            device,
            progress=False,
            moe_weight_format=config.model.moe_weight_format,
            quantization=config.model.quantization,
            csf_prefetch=config.model.csf_prefetch,
            moe_prefill_activations=config.model.moe_prefill_activations,
        )
        if config.cache.calculate_kv_scales:
            calibrate_kv_scales_on_first_prefill(model)
        conn.send(("loaded",))
        enter_phase("wait for the KV cache plan")
        plan = conn.recv()
        enter_phase("allocate the KV cache and build the proposer")
        cache = config.cache
        kv_dtype = torch.float8_e4m3fn if cache.kv_cache_dtype == "fp8" else dtype
        kv_caches = allocate_kv_caches(
            arch.num_layers,
            plan["num_blocks"],
            cache.block_size,
            model.num_kv_heads,
            arch.head_dim,
            kv_dtype,
            device,
        )
        # The same proposer and runner settings as rank 0 (the engine's order: the proposer's
        # target layers are stashed by the forward the runner captures).
        proposer = build_proposer(
            config,
            model,
            target_dir=Path(model_dir),
            device=device,
            dtype=dtype,
            num_target_blocks=plan["num_blocks"],
        )
        spec = runner_speculation(config, proposer)
        if spec.aux_layers:
            model.set_aux_hidden_layers(spec.aux_layers)
        enter_phase("build the runner")  # graph captures report their own phases
        runner = ModelRunner(
            model,
            kv_caches,
            cache.block_size,
            device,
            compilation=config.compilation,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=plan["max_len"],
            progress=False,
            query_lens=spec.query_lens,
            middle_lens_max_size=spec.middle_lens_max_size,
            stash_aux_hidden=bool(spec.aux_layers),
        )
        if proposer is not None:
            runner.set_speculation(spec.aux_layers, spec.synthetic_rates)
            link_vocab_parallel(runner, proposer)
        # Rank 0 samples: a worker's runner computes the logits (the vocabulary gather is a
        # collective every rank joins) and skips the sampler.
        runner.sampler = _NoSampler()
        enter_phase("steps")
        set_phase_listener(None)
        if config.freeze_gc:
            freeze_startup_objects()  # this process's own heap; its exit releases it
        conn.send(("ready",))
        # Context hidden states of the steps since the last proposer calls, by request.
        aux_hidden: dict[str, tuple[int, torch.Tensor]] = {}
        steps = StepDecoder()
        # Async scheduling: every rank samples each step's tokens on its own device (the same
        # tokens: the same gathered logits and keyed noise) for the next step's inputs.
        launch_steps = config.scheduler.async_scheduling
        while (msg := conn.recv()) is not None:
            if isinstance(msg, ProposerCalls):
                assert proposer is not None
                for call in msg.calls:
                    hidden = None
                    if call[0] == "add_context":
                        start, hidden = aux_hidden[call[1]]
                        assert start == call[2], (call, start)
                    apply_proposer_call(proposer, call, hidden)
                aux_hidden.clear()
            elif launch_steps:
                runner.launch(steps.decode(msg))
            else:
                aux_hidden.update(runner.execute(steps.decode(msg)).aux_hidden)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process exits
        code = 1
        try:
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            conn.send(("error", detail))
        except Exception:  # noqa: BLE001 - rank 0 may be gone
            pass
        if not isinstance(e, KeyboardInterrupt):
            traceback.print_exc()
    finally:
        set_phase_listener(None)
        destroyed = destroy_tensor_parallel()  # resets this rank's captured graphs first
        conn.close()
    if not destroyed:  # a thread is stuck destroying the group: interpreter exit could wait on it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
