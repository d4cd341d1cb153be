"""Host (Python) time per engine step, plain decode vs speculative verification, on the CPU.

On the GPU a decode or verification step replays a captured graph; everything else a step does
(scheduling, building the input batch, proposing, verification bookkeeping, appending tokens,
detokenizing, stop checks, outputs) is host work that the device waits for. This measures that
work on a tiny random Qwen3 (vocabulary 2048, so tensor ops on logits are cheap) with the model's
forward and LM head timed and subtracted: host ms/step = step time - forward - logits. Times are
this process's CPU time (time.process_time, torch on one thread), so other work on a shared
machine does not inflate them as it does wall-clock time. `ops` counts the torch ops a step runs
outside the forward and LM head: on the GPU each is a kernel launch (a few µs of host time) that
the replayed graphs do not cover. They are counted in one more run after the timed ones, since the
counting itself (a dispatch mode seeing every op) takes host time.

Speculative steps use benchmarks/spec.py's synthetic case: K = 7 drafts from a free stand-in
proposer (the anchor repeated), accepted at the per-position rate giving acceptance length 3.5.
Every request decodes greedily, EOS ignored. `--ngram` adds the n-gram proposer itself (same
synthetic acceptance) on a repetitive workload (a random 8-token phrase repeated).

    python benchmarks/spec_host_overhead.py [--batch 1 32] [--tokens 64] [--repeats 3] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import write_word_tokenizer  # noqa: E402
from spec import K, RepeatAnchor, rate_for_length  # noqa: E402

VOCAB = 2048
_clock = time.process_time
PROMPT_LEN = 64


def write_tiny_qwen3(path: Path, num_layers: int = 2) -> Path:
    """A random Qwen3 at tiny widths with a word-level tokenizer (token ids as prompts)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return path


class OpCounter(TorchDispatchMode):
    """Counts the torch ops a step runs outside the model (each is a kernel launch on the GPU,
    where the forward and LM head replay a captured graph); paused inside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))


class ModelClock:
    """Wraps the runner's forward and the model's LM head to add up the time spent in them (and
    pause the op counter there)."""

    def __init__(self, engine, ops: OpCounter) -> None:  # noqa: ANN001 - libkk.engine.engine.Engine
        self.seconds = 0.0
        self.ops = ops
        runner, model = engine.runner, engine.model
        eager = runner.step_backends.eager  # every step on the CPU
        eager.forward = self._timed(eager.forward)
        model.compute_logits = self._timed(model.compute_logits)

    def _timed(self, fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = _clock()
            self.ops.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.ops.paused -= 1
                self.seconds += _clock() - start

        return call


def prompts(batch: int, repetitive: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    if repetitive:
        phrases = torch.randint(2, VOCAB, (batch, 8), generator=g).tolist()
        return [(p * (PROMPT_LEN // 8 + 1))[:PROMPT_LEN] for p in phrases]
    return torch.randint(2, VOCAB, (batch, PROMPT_LEN), generator=g).tolist()


def decode_steps(
    engine,
    ids: list[list[int]],
    tokens: int,
    clock: ModelClock,
    count_ops: bool = False,  # noqa: ANN001
) -> list[dict]:
    """Runs the batch to the end through Engine.step (what Session.generate calls); per decode
    step (after every prompt is in): total and host seconds, tokens emitted, and with
    `count_ops` the ops run outside the model (counting slows the host: not for timed runs)."""
    from libkk import SamplingParams

    for i, prompt in enumerate(ids):
        # Seeded: the synthetic acceptance draws are keyed by the seed, so every run is the same.
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, seed=i)
        engine.add_request(engine.make_request(f"r{i}", prompt, params, time.monotonic()))
    steps = []
    while engine.has_unfinished_requests:
        prefilling = any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values())
        model_before = clock.seconds
        ops_before = clock.ops.count
        start = _clock()
        if count_ops:
            with clock.ops:
                outputs = engine.step()
        else:
            outputs = engine.step()
        total = _clock() - start
        if not prefilling:
            emitted = sum(len(o.delta_token_ids) for o in outputs)
            model = clock.seconds - model_before
            steps.append({"total": total, "host": total - model, "tokens": emitted,
                          "ops": clock.ops.count - ops_before})  # fmt: skip
    return steps


def run_case(
    path: Path,
    ids: list[list[int]],
    tokens: int,
    repeats: int,
    spec: dict,
    stand_in: bool,
    profile_top: int,
):
    from libkk import Session

    with Session(
        str(path),
        device="cpu",
        dtype="float32",
        max_model_len=PROMPT_LEN + tokens + 16,
        max_num_seqs=len(ids),
        max_num_batched_tokens=max(2048, len(ids) * PROMPT_LEN),
        progress=False,
        **spec,
    ) as s:
        if stand_in:
            s.engine.proposer = RepeatAnchor()
        clock = ModelClock(s.engine, OpCounter())
        decode_steps(s.engine, ids, 8, clock)  # warm up
        per_repeat = []
        for _ in range(repeats):
            steps = decode_steps(s.engine, ids, tokens, clock)
            per_repeat.append(
                {
                    "host_ms": statistics.median(x["host"] for x in steps) * 1e3,
                    "total_ms": statistics.median(x["total"] for x in steps) * 1e3,
                    "tokens_per_step": sum(x["tokens"] for x in steps) / len(steps),
                }
            )
        counted = decode_steps(s.engine, ids, tokens, clock, count_ops=True)
        profile = None
        if profile_top:
            prof = cProfile.Profile()
            prof.enable()
            decode_steps(s.engine, ids, tokens, clock)
            prof.disable()
            profile = pstats.Stats(prof)
    row = {
        key: statistics.median(r[key] for r in per_repeat)
        for key in ("host_ms", "total_ms", "tokens_per_step")
    }
    row["ops_per_step"] = statistics.median(x["ops"] for x in counted)
    row["host_ms_spread"] = [
        min(r["host_ms"] for r in per_repeat),
        max(r["host_ms"] for r in per_repeat),
    ]
    return row, profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--length", type=float, default=3.5, help="synthetic acceptance length")
    ap.add_argument("--top", type=int, default=25, help="profile rows (0: no profile)")
    ap.add_argument("--ngram", action="store_true", help="add the n-gram proposer's case")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "libkk-spec-host"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = write_tiny_qwen3(Path(args.dir))
    spec = dict(
        method="ngram",
        num_speculative_tokens=K,
        rejection_sample_method="synthetic",
        synthetic_acceptance_rates=[rate_for_length(args.length)],
    )
    rows = []
    profiles = {}
    for batch in args.batch:
        cases = [("plain", {}, False, False), ("spec", spec, True, False)]
        if args.ngram:
            cases.append(("ngram", spec, False, True))
        for name, case, stand_in, repetitive in cases:
            top = args.top if batch == max(args.batch) else 0
            ids = prompts(batch, repetitive)
            row, profile = run_case(path, ids, args.tokens, args.repeats, case, stand_in, top)
            row = {"batch": batch, "case": name} | row
            rows.append(row)
            if profile is not None:
                profiles[f"{name}, batch {batch}"] = profile
            print(json.dumps(row), flush=True)
    print(f"\nhost ms per decode step (median of {args.repeats}; model forward + LM head excluded)")
    print(f"{'batch':>6}  {'case':<7}{'host ms':>9}{'spread':>14}{'step ms':>9}{'tok/step':>10}"
          f"{'ops':>6}")  # fmt: skip
    for r in rows:
        spread = f"{r['host_ms_spread'][0]:.2f}-{r['host_ms_spread'][1]:.2f}"
        print(
            f"{r['batch']:>6}  {r['case']:<7}{r['host_ms']:>9.2f}{spread:>14}"
            f"{r['total_ms']:>9.2f}{r['tokens_per_step']:>10.2f}{r['ops_per_step']:>6.0f}"
        )
    for name, profile in profiles.items():
        print(f"\n---- profile: {name} (one run, by own time; includes the model) ----")
        profile.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
