"""FULL CUDA graph replay gives the same tokens as eager execution (greedy), whatever the batch."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _generate(
    path,
    prompts,
    mode,
    compile_=False,
    kv_cache_dtype="auto",
    device="cuda",
    dtype="float32",
    **settings,
):
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with Session(
        str(path),
        device=device,
        dtype=dtype,
        max_num_seqs=16,
        max_model_len=512,
        cudagraph_mode=mode,
        torch_compile=compile_,
        kv_cache_dtype=kv_cache_dtype,
        progress=False,
        **settings,
    ) as s:
        runner = s.engine.runner
        if mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
            assert runner.graphs is not None and runner.graphs.graphs
        backends = runner.step_backends
        if mode == "FULL":
            assert backends.mixed_graphs is not None and backends.mixed_graphs.graphs
        if "PIECEWISE" in mode:
            assert backends.piecewise.pieces and all(p.graphs for p in backends.piecewise.pieces)
        return [o.token_ids for o in s.generate(prompts, params)]


def test_cuda_ops_give_the_cpu_path_tokens(tiny_qwen3_dir):
    """CUDA runs the Triton ops (fused norms, q/k norm + rotary, attention) where the CPU runs
    the torch references: fp32, greedy, the same tokens."""
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (3, 50, 130)]
    cpu = _generate(tiny_qwen3_dir, prompts, "NONE", device="cpu")
    assert _generate(tiny_qwen3_dir, prompts, "NONE") == cpu


def test_programmatic_dependent_launch_changes_no_token(tiny_qwen3_dir, monkeypatch):
    """Kernels launched with programmatic dependent launch (Hopper) wait for their inputs: with
    the launch attribute off, the same bf16 graph replays give the same tokens (the kernels are
    the same, so only a missing wait could change one)."""
    from libkk.kernels import _jit

    if not _jit.pdl_args(torch.device("cuda"))["PDL"]:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (4, 60, 150, 9)]
    with_pdl = _generate(tiny_qwen3_dir, prompts, "FULL_DECODE_ONLY", dtype="bfloat16")
    monkeypatch.setattr(_jit, "_major", lambda index: 8)
    assert not _jit.pdl_args(torch.device("cuda"))["PDL"]
    assert _generate(tiny_qwen3_dir, prompts, "FULL_DECODE_ONLY", dtype="bfloat16") == with_pdl


@pytest.mark.parametrize("batch", [1, 3, 8, 13])
def test_graph_replay_equals_eager(tiny_qwen3_dir, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(2, 2048, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 200, (batch,), generator=g)
    ]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE")
    graphed = _generate(tiny_qwen3_dir, prompts, "FULL_DECODE_ONLY")
    assert graphed == eager


def test_lazily_captured_graphs_equal_eager(tiny_qwen3_dir):
    """cudagraph_capture="lazy": the largest decode and mixed graphs at start-up, the others as
    steps first need them (mid-run, with other requests' KV in the cache and an async step in
    flight); asynchronous scheduling, chunked prefill and a batch that shrinks as requests end
    reach many sizes. Greedy tokens equal eager, and graphs were captured after start-up."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (5, 77, 160, 33)]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE", max_num_batched_tokens=48)
    from libkk import SamplingParams, Session

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 25, 33, 12)
    ]
    with Session(
        str(tiny_qwen3_dir), device="cuda", dtype="float32", max_num_seqs=16, max_model_len=512,
        max_num_batched_tokens=48, cudagraph_mode="FULL", cudagraph_capture="lazy",
        torch_compile=False, progress=False,
    ) as s:  # fmt: skip
        backends = s.engine.runner.step_backends
        decode, mixed = backends.decode_graphs, backends.mixed_graphs
        assert len(decode.graphs) == 1 and len(mixed.graphs) == 1  # the largest of each
        outs = [o.token_ids for o in s.generate(prompts, params)]
        assert len(decode.graphs) > 1 and len(mixed.graphs) > 1
    assert outs == [e[: len(o)] for e, o in zip(eager, outs, strict=True)]
    assert [len(o) for o in outs] == [40, 25, 33, 12]


def test_compiled_graphs_equal_eager(tiny_qwen3_dir):
    """torch.compile (split at attention) + graphs vs plain eager: fp32, so the fused norms and
    rotary round differently only in the last bits; greedy tokens must still agree."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (5, 77, 160)]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE")
    assert _generate(tiny_qwen3_dir, prompts, "FULL_DECODE_ONLY", compile_=True) == eager


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_piecewise_graphs_equal_eager(tiny_qwen3_dir, mode):
    """Chunked prefill (a 48-token budget) mixes prefill chunks with decodes, so steps of many
    token counts replay the graphed pieces with attention eager between them."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (5, 77, 160, 33)]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE", max_num_batched_tokens=48)
    graphed = _generate(tiny_qwen3_dir, prompts, mode, compile_=True, max_num_batched_tokens=48)
    assert graphed == eager


@pytest.mark.parametrize("compile_", [False, True])
def test_mixed_batch_graphs_equal_eager(tiny_qwen3_dir, compile_, monkeypatch):
    """Mode FULL: chunked prefill (a 48-token budget) mixes prefill chunks with decodes, and those
    steps replay one FULL graph per padded token count (MixedGraphs), attention inside."""
    from libkk.graphs.capture import MixedGraphs

    replays = []
    run = MixedGraphs.run

    def counted(self, input_ids, positions, metadata):
        replays.append((input_ids.shape[0], metadata.num_reqs))
        return run(self, input_ids, positions, metadata)

    monkeypatch.setattr(MixedGraphs, "run", counted)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (5, 77, 160, 33)]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE", max_num_batched_tokens=48)
    graphed = _generate(
        tiny_qwen3_dir, prompts, "FULL", compile_=compile_, max_num_batched_tokens=48
    )
    assert graphed == eager
    assert any(reqs > 1 for _, reqs in replays), replays  # steps of several requests replayed


def test_fp8_kv_cache_graphs_equal_eager(tiny_qwen3_dir):
    """An FP8 cache through the Triton store and attention: replay and eager read the same bytes."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 2048, (int(n),), generator=g).tolist() for n in (9, 100)]
    eager = _generate(tiny_qwen3_dir, prompts, "NONE", kv_cache_dtype="fp8")
    assert _generate(tiny_qwen3_dir, prompts, "FULL_DECODE_ONLY", kv_cache_dtype="fp8") == eager


def _metadata(lens: list[int], block_size: int, seed: int):
    """(ids, positions, metadata) of requests with lens[i] new tokens each: request i owns
    block i + 1 and runs positions 5 .. 5 + lens[i] - 1 of it."""
    from libkk.layers.forward_context import AttentionMetadata

    n = len(lens)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 2048, (sum(lens),), generator=g).cuda()
    pos = torch.cat([5 + torch.arange(num) for num in lens]).cuda()
    blocks = torch.arange(1, n + 1, dtype=torch.int32).cuda()
    starts = [0]
    for num in lens:
        starts.append(starts[-1] + num)
    seq_lens = [5 + num for num in lens]
    meta = AttentionMetadata(
        slot_mapping=blocks.long().repeat_interleave(torch.tensor(lens).cuda()) * block_size + pos,
        query_start_loc=torch.tensor(starts, dtype=torch.int32).cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).cuda(),
        block_table=blocks[:, None].contiguous(),
        block_size=block_size, max_query_len=max(lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    return ids, pos, meta


@pytest.mark.parametrize("q", [1, 4])
def test_multi_token_graphs_equal_eager(tiny_qwen3_dir, q):
    """Graphs for batches where requests run up to q tokens (1 + K when verifying K drafts):
    replay gives the hidden states of the eager forward over the same metadata, uniform or
    ragged (padded per request), and the stash (hidden states a drafter reads) comes back from
    its graph too."""
    from libkk.graphs.capture import DecodeGraphs

    from libkk import Session
    from libkk.layers.forward_context import set_forward_context

    with Session(str(tiny_qwen3_dir), device="cuda", dtype="float32", max_model_len=256,
                 cudagraph_mode="NONE", torch_compile=False, progress=False) as s:  # fmt: skip
        model, bs = s.engine.model, s.engine.config.cache.block_size
        stash = {}

        def forward(ids, pos):
            hidden = model.forward(ids, pos)
            stash["t"] = hidden * 2  # stands in for aux hidden states
            return hidden

        graphs = DecodeGraphs(forward, model=model, capture_sizes=[2, 4, 8], max_blocks_per_seq=4,
                              block_size=bs, device=torch.device("cuda"), query_lens=(1, q),
                              stash=lambda: stash["t"])  # fmt: skip
        graphs.capture(progress=False)
        # Uniform batches of 1, 3 and 8 requests, then a ragged one (1 .. q tokens a request).
        batches = [[q] * n for n in (1, 3, 8)] + ([[1 + i % q for i in range(5)]] if q > 1 else [])
        for seed, lens in enumerate(batches):
            ids, pos, meta = _metadata(lens, bs, seed)
            assert graphs.can_run(meta, sum(lens))
            with torch.inference_mode():
                with set_forward_context(meta, model):
                    eager = model.forward(ids, pos).clone()
                hidden, stashed = graphs.run(ids, pos, meta)
            torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(stashed, 2 * eager, rtol=1e-5, atol=1e-5)
        if q > 1:
            # Padding a short request past the block table's reach is refused (eager instead).
            meta.seq_lens_cpu = [4 * bs] * len(lens)
            assert not graphs.can_run(meta, sum(lens))


def test_later_graphs_capture_without_a_warm_up_unless_an_op_needs_one(tiny_qwen3_dir):
    """The first (largest) graph warms up twice, later ones capture straight away; an op that
    needs a run outside capture (NeedsWarmUp) gets one, its graph is captured again, and every
    graph replays as eager runs."""
    from libkk.graphs.capture import DecodeGraphs
    from libkk.kernels import NeedsWarmUp

    from libkk import Session
    from libkk.layers.forward_context import set_forward_context

    with Session(str(tiny_qwen3_dir), device="cuda", dtype="float32", max_model_len=256,
                 cudagraph_mode="NONE", torch_compile=False, progress=False) as s:  # fmt: skip
        model, bs = s.engine.model, s.engine.config.cache.block_size
        outside_capture: list[int] = []  # token counts of the forwards run outside capture

        def forward(ids, pos):
            n = ids.shape[0]
            if not torch.cuda.is_current_stream_capturing():
                outside_capture.append(n)
            elif n == 2 and n not in outside_capture:  # as arrival_counts does before growing
                raise NeedsWarmUp("2 tokens")
            return model.forward(ids, pos)

        graphs = DecodeGraphs(forward, model=model, capture_sizes=[2, 4, 8], max_blocks_per_seq=4,
                              block_size=bs, device=torch.device("cuda"))  # fmt: skip
        graphs.capture(progress=False)
        assert outside_capture == [8, 8, 2]
        assert sorted(graphs.graphs) == [(1, 2), (1, 4), (1, 8)]
        for seed, n in enumerate((1, 2, 3, 8)):
            ids, pos, meta = _metadata([1] * n, bs, seed)
            with torch.inference_mode():
                with set_forward_context(meta, model):
                    eager = model.forward(ids, pos).clone()
                hidden, _ = graphs.run(ids, pos, meta)
            torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)


_START_SESSION = """
import json, sys
import torch
from torch._dynamo import convert_frame
from libkk import SamplingParams, Session

traces = []
capture = convert_frame.fullgraph_capture
convert_frame.fullgraph_capture = lambda *a, **k: traces.append(1) or capture(*a, **k)
with Session(sys.argv[1], device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
             torch_compile=True, progress=False) as s:
    runner = s.engine.runner
    out = s.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0))
    print(json.dumps({"how": runner.compile_cache, "traces": len(traces),
                      "precompiled": getattr(runner.forward, "precompiled", None) is not None,
                      "tokens": out[0].token_ids, "phases": list(s.startup_seconds),
                      "mixed graphs": len(runner.step_backends.mixed_graphs.graphs)}))
"""


def test_a_second_session_loads_the_precompiled_forward(tiny_qwen3_dir, tmp_path):
    """The warm start's point: with the CUDA path's custom ops (norms, GEMV, attention) in the
    graph, the artifact entry's precompiled forward loads in a fresh process and runs without a
    Dynamo trace, giving the first process's tokens."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "LIBKK_CACHE_DIR": str(tmp_path / "libkk"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip

    def start() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _START_SESSION, str(tiny_qwen3_dir)],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "without precompile" not in done.stderr, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    built = start()
    assert built["how"] == "built" and built["precompiled"] and built["traces"] >= 1
    loaded = start()
    assert loaded["how"] == "loaded" and loaded["precompiled"]
    assert loaded["traces"] == 0
    assert loaded["tokens"] == built["tokens"]
    assert built["mixed graphs"] > 0 and loaded["mixed graphs"] > 0  # the default mode, FULL
    for run in (built, loaded):  # the entry's load is timed apart from compile + capture
        phases = run["phases"]
        i = phases.index("load the compile artifacts")
        assert phases[i + 1] == "compile and capture CUDA graphs"
