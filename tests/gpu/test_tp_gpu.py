"""Tensor parallelism on CUDA (NCCL, one GPU per rank): TP=2 gives the same greedy tokens as TP=1,
eager and with CUDA graphs (the all-reduces are captured in each rank's graphs), and a Session
with graphs closes promptly: NCCL (2.26 on) cannot destroy a communicator while a graph that
captured its collectives lives, so every rank resets its graphs before the group goes.

    pytest -m gpu tests/gpu/test_tp_gpu.py     (needs >= 2 CUDA devices)
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs at least 2 CUDA devices",
    ),
]


CLOSE_S = 30.0  # a close that waits for NCCL's teardown of a live graph never ends


def _generate(path, prompts, tp, mode, compile_, **options):
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    session = Session(
        str(path),
        device="cuda",
        dtype="float32",
        tensor_parallel_size=tp,
        max_num_seqs=8,
        max_model_len=512,
        cudagraph_mode=mode,
        torch_compile=compile_,
        progress=False,
        worker_timeout_s=120.0,
        **options,
    )
    try:
        if tp > 1:
            layer = session.engine.model.model.layers[0]
            assert layer.self_attn.num_heads == 4  # 8 heads over 2 ranks
        if "FULL" in mode:
            assert session.engine.runner.graphs is not None and session.engine.runner.graphs.graphs
        tokens = [o.token_ids for o in session.generate(prompts, params)]
    finally:
        start = time.monotonic()
        session.close()
    assert time.monotonic() - start < CLOSE_S
    assert not torch.distributed.is_initialized()  # the group was destroyed, not abandoned
    return tokens


@pytest.mark.parametrize(
    ("mode", "compile_"),
    [
        ("NONE", False),
        ("FULL_DECODE_ONLY", False),  # captured without torch.compile: eager functional all-reduce
        ("FULL_DECODE_ONLY", True),
        ("FULL", False),  # mixed batches from FULL graphs too: the same graph on every rank
        ("FULL", True),
        ("FULL_AND_PIECEWISE", True),
    ],
)
def test_tp2_greedy_equals_tp1(tiny_qwen3_dir, mode, compile_):
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(2, 2048, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 120, (5,), generator=g)
    ]
    reference = _generate(tiny_qwen3_dir, prompts, 1, "NONE", False)
    assert _generate(tiny_qwen3_dir, prompts, 2, mode, compile_) == reference


def test_async_scheduling_at_tp2_equals_sync_tp1(tiny_qwen3_dir):
    """Async scheduling with FULL graphs at TP=2: each rank feeds its own sampled ids (the argmax
    from vocab shards) to its next replayed step, and the tokens are TP=1's synchronous ones."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (4, 33, 70)]
    reference = _generate(tiny_qwen3_dir, prompts, 1, "NONE", False)
    got = _generate(tiny_qwen3_dir, prompts, 2, "FULL_DECODE_ONLY", False, async_scheduling=True)
    assert got == reference


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY"])
def test_a_worker_killed_mid_step_fails_the_session(tiny_qwen3_dir, mode):
    """NCCL does not notice a dead peer by itself: the executor aborts the group, the step
    fails with TensorParallelError and this process survives; with FULL graphs too, whose
    replayed all-reduces no NCCL watchdog times, and the session still closes."""
    import os
    import signal
    import threading

    from libkk import SamplingParams, Session, TensorParallelError

    session = Session(
        str(tiny_qwen3_dir),
        device="cuda",
        tensor_parallel_size=2,
        max_num_seqs=4,
        max_model_len=1024,
        cudagraph_mode=mode,
        torch_compile=False,
        progress=False,
        worker_timeout_s=120.0,
    )
    try:
        session.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        pid = session.engine.executor.procs[0].pid
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            for _ in range(50):  # graph replays are fast: keep stepping until the kill lands
                session.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=1000, ignore_eos=True))
        assert time.monotonic() - start < 60.0
    finally:
        start = time.monotonic()
        session.close()
    assert time.monotonic() - start < CLOSE_S + 10.0  # no live graph blocks the group's end


def _random_drafter(path):
    """A random DFlash drafter for the tiny Qwen3 target, saved at `path`."""
    from libkk.spec_decode.dflash_model import DFlashConfig, save_drafter
    from libkk.spec_decode.training.distill import init_drafter

    config = DFlashConfig(
        hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=64, vocab_size=2048, target_layer_ids=(0, 2), mask_token_id=3, block_size=5,
        max_position_embeddings=1024,
    )  # fmt: skip
    return save_drafter(init_drafter(config, seed=2), path, torch.float32)


@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_dflash_at_tp2_greedy_equals_plain_tp1(tiny_qwen3_dir, tmp_path, vocab_parallel):
    """DFlash speculation on two GPUs (the drafter split like the target, every rank drafting in
    step; verification graphs with their NCCL collectives) gives the plain TP=1 greedy tokens."""
    from libkk import SamplingParams, Session

    drafter = _random_drafter(tmp_path / "drafter")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 2048, (n,), generator=g).tolist() for n in (5, 40, 90)]
    reference = _generate(tiny_qwen3_dir, prompts, 1, "NONE", False)
    spec = {"method": "dflash", "draft_model": str(drafter), "num_speculative_tokens": 4,
            "vocab_parallel_drafting": vocab_parallel}  # fmt: skip
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with Session(str(tiny_qwen3_dir), device="cuda", dtype="float32", tensor_parallel_size=2,
                 max_num_seqs=8, max_model_len=512, progress=False, worker_timeout_s=120.0,
                 speculative=spec) as s:  # fmt: skip
        assert [o.token_ids for o in s.generate(prompts, params)] == reference
        assert s.stats()["spec_num_verify_steps"] > 0


def test_sampled_dflash_at_tp2_from_vocab_shards_equals_whole_rows(tiny_qwen3_dir, tmp_path):
    """Vocab-parallel probabilistic drafting and verification on two GPUs: seeded sampled
    tokens and draft/acceptance counts equal those of drafting and verifying on whole rows."""
    from libkk import SamplingParams, Session

    drafter = _random_drafter(tmp_path / "drafter")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 2048, (n,), generator=g).tolist() for n in (5, 40, 90, 12)]
    params = [
        SamplingParams(max_tokens=32, temperature=t, seed=10 + i, ignore_eos=True)
        for i, t in enumerate([0.6, 1.0, 1.3, 0.0])
    ]
    results = []
    for vocab_parallel in (False, True):
        spec = {"method": "dflash", "draft_model": str(drafter), "num_speculative_tokens": 4,
                "draft_sampling": "probabilistic", "vocab_parallel_drafting": vocab_parallel}  # fmt: skip
        with Session(str(tiny_qwen3_dir), device="cuda", dtype="float32", tensor_parallel_size=2,
                     max_num_seqs=8, max_model_len=512, progress=False, worker_timeout_s=120.0,
                     speculative=spec) as s:  # fmt: skip
            tokens = [o.token_ids for o in s.generate(prompts, params)]
            stats = s.stats()
            assert (s.engine.runner.vocab_head is not None) == vocab_parallel
        counts = [stats[k] for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens")]
        results.append((tokens, counts))
    assert results[1] == results[0]
    assert results[0][1][0] > 0


def test_a_graph_session_closes_and_the_next_one_starts(tiny_qwen3_dir):
    """Two TP=2 sessions with FULL graphs one after the other in one process: the first closes
    within CLOSE_S (its graphs reset, its NCCL group destroyed, its worker gone), so the second
    can build a group again."""
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for _ in range(2):
        session = Session(str(tiny_qwen3_dir), device="cuda", dtype="float32",
                          tensor_parallel_size=2, max_num_seqs=4, max_model_len=256,
                          cudagraph_mode="FULL_DECODE_ONLY", torch_compile=False, progress=False,
                          worker_timeout_s=60.0)  # fmt: skip
        procs = session.engine.executor.procs
        try:
            outputs.append(session.generate([[5, 6, 7]], params)[0].token_ids)
        finally:
            start = time.monotonic()
            session.close()
        assert time.monotonic() - start < CLOSE_S
        # The worker left its loop and exited itself (not stopped by a signal).
        assert [p.exitcode for p in procs] == [0]
        assert not torch.distributed.is_initialized()
    assert outputs[0] == outputs[1]


def test_packed_moe_at_tp2_greedy_equals_tp1(tiny_moe_dirs):
    """NVFP4 experts stay packed at TP=2 (each rank its half of every expert's intermediate
    dimension, the fused kernels, FULL graphs) and give TP=1's greedy tokens."""
    from libkk.layers.quant_moe import QuantFusedMoE

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (3, 17, 60)]
    # Untuned tiles: each rank's tile tuning times its kernels per batch size, minutes here.
    reference = _generate(tiny_moe_dirs["nvfp4"], prompts, 1, "FULL_DECODE_ONLY", False,
                          tune_moe_tiles=False)  # fmt: skip
    from libkk import SamplingParams, Session

    session = Session(str(tiny_moe_dirs["nvfp4"]), device="cuda", dtype="float32",
                      tensor_parallel_size=2, max_num_seqs=8, max_model_len=512,
                      cudagraph_mode="FULL_DECODE_ONLY", torch_compile=False, progress=False,
                      worker_timeout_s=120.0, tune_moe_tiles=False)  # fmt: skip
    try:
        experts = session.engine.model.model.layers[0].mlp.experts
        assert isinstance(experts, QuantFusedMoE) and experts.intermediate_size == 64
        assert session.engine.runner.graphs is not None and session.engine.runner.graphs.graphs
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        tokens = [o.token_ids for o in session.generate(prompts, params)]
    finally:
        session.close()
    assert tokens == reference
