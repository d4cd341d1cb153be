"""Tensor parallelism on CPU: gloo, worker processes, tiny random checkpoints.

Every tensor-parallel run is compared with the same model at one rank: the same greedy tokens,
and log-probabilities within a small tolerance (row-parallel sums are added in another order).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from libkk import Session
from libkk.engine.executor import TensorParallelError
from libkk.errors import ConfigError
from libkk.sample.params import SamplingParams

_COMMON = dict(
    vocab_size=250,  # not a multiple of 3 or 4: the last vocab shard is padded
    hidden_size=48,
    num_hidden_layers=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
MODELS = {
    # 4 heads, 2 KV heads: split at tp=2, replicated at tp=4
    "llama": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=96, attention_bias=True)),
    # 12 heads of 8, 6 KV heads: split at tp=2 and tp=3
    "qwen3": (transformers.Qwen3Config, dict(num_attention_heads=12, num_key_value_heads=6,
                                             head_dim=8, intermediate_size=96)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1],
    )),
    # a sliding and a full layer: separate KV groups, the sliding one releasing blocks
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )),
}  # fmt: skip
PROMPTS = [
    [5, 17, 42, 99, 3],
    list(range(30, 60)),  # longer than the step budget: chunked prefill
    [7, 7, 7],
]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5)
SETTINGS = dict(
    progress=False,
    num_gpu_blocks=64,
    block_size=8,
    max_num_seqs=4,
    max_model_len=96,
    max_num_batched_tokens=24,
    worker_timeout_s=60.0,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    dirs = {}
    for name, (cfg_cls, extra) in MODELS.items():
        path = tmp_path_factory.mktemp(f"tp-{name}")
        config = cfg_cls(**_COMMON, **extra)
        torch.manual_seed(0)
        model_cls = {
            "llama": transformers.LlamaForCausalLM,
            "qwen3": transformers.Qwen3ForCausalLM,
            "qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "gemma3": transformers.Gemma3ForCausalLM,
        }[name]
        model_cls(config).save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_model_dir / f, path / f)
        dirs[name] = path
    return dirs


def _run(path: Path, tp: int) -> tuple[list[list[int]], list[list[dict[int, float]]], Session]:
    session = Session(str(path), tensor_parallel_size=tp, **SETTINGS)
    try:
        outs = session.generate(PROMPTS, GREEDY)
        tokens = [o.token_ids for o in outs]
        top = [[dict(lp.top) for lp in o.logprobs] for o in outs]
    finally:
        session.close()
    return tokens, top, session


_REFERENCE: dict[str, tuple] = {}


def _reference(model_dirs, name):
    if name not in _REFERENCE:
        _REFERENCE[name] = _run(model_dirs[name], 1)[:2]
    return _REFERENCE[name]


def _assert_matches(reference, got, atol: float = 2e-4) -> None:
    ref_tokens, ref_top = reference
    tokens, top = got
    assert tokens == ref_tokens
    for ref_steps, steps in zip(ref_top, top, strict=True):
        for ref, mine in zip(ref_steps, steps, strict=True):
            assert ref.keys() == mine.keys()
            for token, logprob in ref.items():
                assert abs(mine[token] - logprob) < atol, (token, mine[token], logprob)


def _assert_workers_gone(session: Session) -> None:
    # Session.close handed the engine back; its executor stopped and reaped every worker.
    executor = session._last_executor  # type: ignore[attr-defined]
    assert executor.procs and all(p.exitcode is not None for p in executor.procs)
    for p in executor.procs:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


@pytest.fixture(autouse=True)
def _keep_executor(monkeypatch):
    """Remembers each Session's executor so a test can check its workers after close()."""
    real_init = Session.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._last_executor = self.engine.executor

    monkeypatch.setattr(Session, "__init__", init)


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_matches_tp1(model_dirs, name):
    tokens, top, session = _run(model_dirs[name], 2)
    _assert_matches(_reference(model_dirs, name), (tokens, top))
    _assert_workers_gone(session)


def test_tp3_matches_tp1(model_dirs):
    tokens, top, session = _run(model_dirs["qwen3"], 3)  # 4 heads and 2 KV heads per rank
    _assert_matches(_reference(model_dirs, "qwen3"), (tokens, top))
    _assert_workers_gone(session)
    phases = list(session.startup_seconds)
    assert phases[:3] == ["model files and tokenizer", "start tensor-parallel workers",
                          "load weights"]  # fmt: skip
    assert "wait for the tensor-parallel workers' weights" in phases
    assert phases[-1] == "wait for the tensor-parallel workers' runners"


def test_async_scheduling_at_tp2_matches_sync_tp1(model_dirs):
    """Async scheduling at TP=2: every rank samples each step's tokens on its own device and
    feeds them to its next step. Rows taking the argmax from vocab shards, greedy rows with
    logprobs and seeded top-p rows give TP=1's synchronous tokens."""
    batches = [
        [SamplingParams(max_tokens=10, temperature=0.0)] * len(PROMPTS),  # argmax from shards
        [GREEDY, SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=3),
         SamplingParams(max_tokens=10, temperature=1.2, seed=4)],
    ]  # fmt: skip

    def run(tp: int, async_scheduling: bool) -> list[list[list[int]]]:
        with Session(str(model_dirs["qwen3"]), tensor_parallel_size=tp,
                     async_scheduling=async_scheduling, **SETTINGS) as session:  # fmt: skip
            return [[o.token_ids for o in session.generate(PROMPTS, p)] for p in batches]

    assert run(2, True) == run(1, False)


def test_tp4_matches_tp1_with_replicated_kv_heads(model_dirs):
    session = Session(str(model_dirs["llama"]), tensor_parallel_size=4, **SETTINGS)
    try:
        engine = session.engine
        # 2 KV heads over 4 ranks: each rank caches the one KV head its query head reads.
        assert engine.model.num_kv_heads == 1
        assert engine.runner.kv_caches[0].shape[3] == 1
        # One tensor-parallel group per process: no other Session while this one is open.
        with pytest.raises(ConfigError, match="tensor-parallel Session is open"):
            Session(str(model_dirs["llama"]), **SETTINGS)
        outs = session.generate(PROMPTS, GREEDY)
    finally:
        session.close()
    got = ([o.token_ids for o in outs], [[dict(lp.top) for lp in o.logprobs] for o in outs])
    _assert_matches(_reference(model_dirs, "llama"), got)
    _assert_workers_gone(session)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_killed_worker_fails_the_session_quickly(model_dirs, async_scheduling):
    session = Session(str(model_dirs["llama"]), tensor_parallel_size=2,
                      async_scheduling=async_scheduling, **SETTINGS)  # fmt: skip
    try:
        first = session.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(first.token_ids) == 3
        worker = session.engine.executor.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            session.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0))
        assert time.monotonic() - start < 20.0
        # The session stays failed: no step runs with ranks out of step.
        with pytest.raises(TensorParallelError):
            session.generate(PROMPTS[2], SamplingParams(max_tokens=2, temperature=0.0))
    finally:
        session.close()
    _assert_workers_gone(session)


def test_unsupported_splits_fail_before_any_worker_starts(model_dirs):
    start = time.monotonic()
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide"):
        Session(str(model_dirs["llama"]), tensor_parallel_size=3, **SETTINGS)
    with pytest.raises(ConfigError, match="num_key_value_heads=6"):
        Session(str(model_dirs["qwen3"]), tensor_parallel_size=4, **SETTINGS)
    with pytest.raises(ConfigError, match="speculative.method='draft_model' is not supported"):
        Session(
            str(model_dirs["llama"]),
            tensor_parallel_size=2,
            speculative={"method": "draft_model", "draft_model": str(model_dirs["llama"])},
            **SETTINGS,
        )
    assert time.monotonic() - start < 10.0  # no worker was started (each takes seconds)


def _cli(model: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "libkk.cli", "generate", "--model", str(model), *extra]
    cmd += ["--max-tokens", "6", "--set", "progress=false", "--set", "num_gpu_blocks=32"]
    cmd += ["--set", "max_num_seqs=2", "--set", "max_model_len=64", "Hello there"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cli_tensor_parallel_size(tiny_llama_dir):
    one = _cli(tiny_llama_dir)
    two = _cli(tiny_llama_dir, "--tensor-parallel-size", "2")
    assert one.strip() and two == one


@pytest.fixture(scope="module")
def qwen3_drafter_dir(tmp_path_factory) -> Path:
    """A random DFlash drafter for the tiny Qwen3 (hidden 48, vocab 250): 4 heads, 2 KV heads,
    so it splits at tp=2."""
    from libkk.spec_decode.dflash_model import DFlashConfig, save_drafter
    from libkk.spec_decode.training.distill import init_drafter

    config = DFlashConfig(
        hidden_size=48, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=12, vocab_size=250, target_layer_ids=(0, 1), mask_token_id=3, block_size=5,
        max_position_embeddings=128,
    )  # fmt: skip
    drafter = init_drafter(config, seed=1)
    return save_drafter(drafter, tmp_path_factory.mktemp("qwen3-drafter"), dtype=torch.float32)


def _run_spec(path: Path, tp: int, spec: dict) -> tuple[list[list[int]], dict]:
    with Session(str(path), tensor_parallel_size=tp, speculative=spec, **SETTINGS) as session:
        outs = session.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
        return [o.token_ids for o in outs], session.stats()


@pytest.mark.parametrize("method", ["dflash", "dflash-vocab-parallel", "ngram"])
def test_speculation_at_tp2_matches_tp1(model_dirs, qwen3_drafter_dir, method):
    """Greedy tokens with speculation at tp=2 equal the plain tp=1 run, and the drafts (hence the
    accepted counts) equal those of speculation at tp=1: every rank drafts in step, and the DFlash
    drafter's split (and its vocab-parallel greedy drafts) gives rank 0 the same drafts."""
    # Every draft verified at both sizes (the backoff runs at tp=1 only).
    spec = {"method": method.split("-")[0], "num_speculative_tokens": 3, "draft_backoff": False}
    if method.startswith("dflash"):
        spec["draft_model"] = str(qwen3_drafter_dir)
    if method == "dflash-vocab-parallel":
        spec["vocab_parallel_drafting"] = True
    path = model_dirs["qwen3"]
    plain, _ = _run_spec(path, 1, {})
    one, one_stats = _run_spec(path, 1, spec)
    two, two_stats = _run_spec(path, 2, spec)
    assert one == plain and two == plain
    assert one_stats["spec_num_verify_steps"] > 0
    for key in ("spec_num_verify_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
        assert two_stats[key] == one_stats[key], key


@pytest.mark.parametrize(("name", "tp"), [("llama", 2), ("qwen3", 3)])
def test_greedy_rows_take_the_argmax_from_vocab_shards(model_dirs, name, tp, monkeypatch):
    """Greedy rows without logprobs pick the argmax from each rank's vocabulary shard (tp=3 pads
    the last shard): the same tokens as one rank."""
    from libkk.models.llama import LlamaForCausalLM

    calls = []
    real = LlamaForCausalLM.greedy_tokens

    def counted(self, hidden):
        calls.append(hidden.shape[0])
        return real(self, hidden)

    monkeypatch.setattr(LlamaForCausalLM, "greedy_tokens", counted)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    tokens = []
    for size in (1, tp):
        with Session(str(model_dirs[name]), tensor_parallel_size=size, **SETTINGS) as session:
            tokens.append([o.token_ids for o in session.generate(PROMPTS, params)])
    assert tokens[0] == tokens[1]
    assert calls  # rank 0 (this process) took the shard path at tp > 1
