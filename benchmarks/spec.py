"""GPU decode speed with speculative decoding at the 8B shape: synthetic acceptance and n-gram.

Random bf16 weights at a real shape, written as a checkpoint folder by benchmarks/decode.py's
helper. Every request decodes --tokens tokens greedily (EOS ignored) after a --prompt token prompt.

- baseline: no speculation in the engine's default mode (asynchronous scheduling on CUDA), and
  in synchronous mode, the one speculation runs in, as a second row;
- synthetic: K = 7 drafts every step (any tokens: a stand-in proposer repeats the anchor) accepted
  with one keyed per-position rate r chosen so the expected acceptance length
  1 + r + ... + r^K is 2, 3.5 and 5 (rejection_sample_method="synthetic": outputs then differ
  from the target's; the drafter costs nothing, so this is the verification side's ceiling);
- ngram: the n-gram proposer on a repetitive workload (a random 32-token phrase repeated). With
  random weights the target does not continue the pattern, so the acceptance it reaches is
  reported as measured.
- `--adaptive` adds each speculative case again with adaptive verification (the drafts each step
  verifies chosen from the online acceptance estimate and the start-up cost tables).

Two rates per case, each the median (and spread) of --repeats timed runs after one untimed run
of the whole workload:
- tok/s (closed batch): requests * tokens / the slowest request's decode time (first token to
  last). Under speculation requests accept different numbers of drafts, so the batch waits for
  its unluckiest request: at batch 32 and 128 tokens the last one needs several more steps than
  the mean.
- steady tok/s: output tokens per second while all the batch's requests are decoding (the rate
  at that batch size, as a server that keeps its batch full sees it).
The floor for a speculative row is its measured acceptance length * requests per weight read:
a verification step reads the weights at least once (decode.py's `step_bytes` without the KV
cache / measured copy bandwidth).
`--peer` adds Hugging Face transformers' plain greedy decode at each batch (decode.py's).

    python benchmarks/spec.py --batch 1 8 32 [--shape qwen3-8b] [--out spec.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import (  # noqa: E402
    COMMON,
    COMPILE,
    SHAPES,
    bench_transformers,
    prompts,
    step_bytes,
    write_checkpoint,
)
from floors import copy_bandwidth  # noqa: E402
from profiling import profile_steps  # noqa: E402

K = 7
ACCEPTANCE_LENGTHS = (2.0, 3.5, 5.0)


def rate_for_length(length: float, k: int = K) -> float:
    """The constant per-position acceptance rate r with 1 + r + ... + r^k = length."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class RepeatAnchor:
    """A free proposer for the synthetic runs: max_drafts copies of the anchor token."""

    target_layer_ids: tuple[int, ...] = ()

    def propose(self, requests):
        try:
            from libkk.spec_decode.base import DraftProposal
        except ImportError:  # a tree before libkk/spec_decode (benchmarks/ab.py's base)
            from libkk.spec.base import DraftProposal

        drafts = [[r.token_ids[-1]] * r.max_drafts for r in requests]
        return DraftProposal(token_ids=drafts, draft_logits=[None] * len(requests))

    def add_context(self, request_id, start_position, hidden):
        pass

    def remove(self, request_id):
        pass


def run(
    path: Path,
    ids: list[list[int]],
    tokens: int,
    repeats: int,
    device: str,
    profile: bool,
    torch_compile: bool | str,
    **spec,
) -> dict:
    from libkk import SamplingParams, Session

    batch, prompt = len(ids), len(ids[0])
    # One seed per request, the same in every repeat: the synthetic acceptance is keyed by it, so
    # each repeat decodes the same steps.
    params = [SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True, seed=i)
              for i in range(batch)]  # fmt: skip
    with Session(
        str(path),
        dtype="bfloat16",
        device=device,
        max_model_len=prompt + tokens + 32,
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, prompt),
        torch_compile=torch_compile,
        progress=False,
        **spec,
    ) as s:
        if spec.get("rejection_sample_method") == "synthetic":
            # The engine's speculation component holds the proposer (the engine itself in trees
            # before that component, which benchmarks/ab.py may compare against).
            getattr(s.engine, "speculation", s.engine).proposer = RepeatAnchor()
        s.generate(ids, params)  # warm up: every step shape the repeats will see
        before = s.stats()
        tok_s, steady = [], []
        for _ in range(repeats):
            closed, full = _decode_rates(s, ids, params, tokens)
            tok_s.append(closed)
            steady.append(full)
        after = s.stats()
        if profile:
            profile_steps(s, ids, tokens)
        weights = s.engine.weights_bytes
        startup = {k: round(v, 3) for k, v in s.startup_seconds.items()}
    row = {"tok_s": statistics.median(tok_s), "spread": [min(tok_s), max(tok_s)],
           "per_repeat": tok_s, "steady_tok_s": statistics.median(steady),
           "steady_spread": [min(steady), max(steady)]}  # fmt: skip
    row["weights_bytes"] = weights
    row["startup_s"] = startup  # graph capture and the speculation cost profile among them
    if "spec_num_verify_steps" in after:
        steps = after["spec_num_verify_steps"] - before["spec_num_verify_steps"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        row["acceptance_length"] = 1 + accepted / steps if steps else 1.0
    return row


def _decode_rates(session, ids: list[list[int]], params: list, tokens: int) -> tuple[float, float]:
    """One run of the batch through Session.submit / step: (closed-batch tok/s, steady tok/s).

    Closed batch: requests * tokens / the slowest request's decode time. Steady: output tokens
    per second while every request is still decoding, from two steps after the last first token
    to the step before the first request finishes; each end counts the tokens handed out by
    then (outputs a step late, under async scheduling or deferred detokenization, are late at
    both ends alike)."""
    rids = [session.submit(p, sp) for p, sp in zip(ids, params, strict=True)]
    counts = dict.fromkeys(rids, 0)
    final = []
    marks = []  # after each step while every request runs: (time, tokens handed out)
    first = None  # the mark two steps after the last first token
    while len(final) < len(rids):
        outs = session.step()
        now = time.perf_counter()
        for o in outs:
            counts[o.request_id] = len(o.token_ids)
            if o.finished:
                final.append(o)
        if not final:
            marks.append((now, sum(counts.values())))
            if first is None and min(counts.values()) >= 1:
                first = len(marks) + 1
    closed = len(rids) * tokens / max(o.timeline.decode_time for o in final)
    if first is None or len(marks) - 1 <= first:
        raise RuntimeError(f"no steady window in {len(marks)} steps: raise --tokens")
    (t0, n0), (t1, n1) = marks[first], marks[-1]
    return closed, (n1 - n0) / (t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    ap.add_argument("--out", default="spec.json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the tiny shape")
    ap.add_argument("--lengths", type=float, nargs="+", default=list(ACCEPTANCE_LENGTHS))
    ap.add_argument("--no-ngram", action="store_true", help="skip the n-gram workload")
    ap.add_argument("--compile", choices=sorted(COMPILE), default="auto",
                    help="torch_compile, as decode.py's --compile")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="profile the speculative cases")
    ap.add_argument("--peer", action="store_true", help="transformers' plain decode per batch")
    ap.add_argument("--adaptive", action="store_true", help="also each case adaptively verified")
    ap.add_argument("--skinny", action="store_true",
                    help="products of 2 to 32 tokens (verifications) on libkk's skinny kernel")  # fmt: skip
    args = ap.parse_args()
    if args.skinny:
        from libkk.kernels import gemv

        gemv.ROUTE_SKINNY = True

    path = Path(args.dir) / args.shape
    t0 = time.perf_counter()
    write_checkpoint(args.shape, path, args.device)
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s: {path}", flush=True)
    cfg = {**COMMON, **SHAPES[args.shape]}
    vocab = cfg["vocab_size"]
    bandwidth = copy_bandwidth(args.device) if args.device == "cuda" else None
    rows = []
    for batch in args.batch:
        ids = prompts(batch, args.prompt, vocab)
        phrase = prompts(batch, 32, vocab, seed=1)
        repetitive = [(p * (args.prompt // 32 + 1))[: args.prompt] for p in phrase]
        # Speedups are against plain decoding in the engine's default mode (asynchronous on
        # CUDA); speculation runs synchronously, so plain decoding's synchronous mode is shown
        # as well.
        cases = [("none", ids, {}), ("none (sync)", ids, {"async_scheduling": False})]
        for length in args.lengths:
            spec = dict(
                method="ngram",
                num_speculative_tokens=K,
                rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[rate_for_length(length)],
            )
            cases.append((f"synthetic {length}", ids, spec))
        if not args.no_ngram:
            cases.append(("ngram", repetitive, dict(method="ngram", num_speculative_tokens=K)))
        if args.adaptive:
            cases += [(f"{name}, adaptive", workload, {**spec, "adaptive_verification": True})
                      for name, workload, spec in cases if "method" in spec]  # fmt: skip
        if not args.no_ngram:
            cases.append(("none (repetitive)", repetitive, {}))
        base = None
        for name, workload, spec in cases:
            row = {"batch": batch, "case": name}
            profile = args.profile and "method" in spec  # plain decoding: decode.py --profile
            row |= run(path, workload, args.tokens, args.repeats, args.device, profile,
                       COMPILE[args.compile], **spec)  # fmt: skip
            if name == "none":
                base = row
            row["speedup"] = row["tok_s"] / base["tok_s"] if base else None
            row["steady_speedup"] = row["steady_tok_s"] / base["steady_tok_s"] if base else None
            if bandwidth:
                per_read = row.get("acceptance_length", 1.0) * batch
                read = step_bytes(cfg, row["weights_bytes"], "bf16", batch, context=0)
                row["floor_tok_s"] = per_read * bandwidth / read
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
        if args.peer:
            ms = bench_transformers(path, batch, args.prompt, args.tokens, args.repeats)
            tok_s = [batch * 1e3 / t for t in ms["ms_per_step"]]
            row = {"batch": batch, "case": "transformers (none)", "speedup": None}
            row |= {"tok_s": statistics.median(tok_s), "spread": [min(tok_s), max(tok_s)]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    print(
        f"\n{args.shape} decode with speculation, K={K}, prompt {args.prompt}, {args.tokens} tokens"
    )
    print(f"{'batch':>6}  {'case':<26}{'tok/s':>10}{'spread':>13}{'speedup':>9}"
          f"{'steady':>10}{'spread':>13}{'speedup':>9}"
          f"{'acc. len':>10}{'floor tok/s':>13}")  # fmt: skip
    nan = float("nan")
    for r in rows:
        acc = r.get("acceptance_length")
        spreads = [
            f"{lo:.0f}-{hi:.0f}" for lo, hi in (r["spread"], r.get("steady_spread", (nan,) * 2))
        ]
        print(
            f"{r['batch']:>6}  {r['case']:<26}{r['tok_s']:>10.1f}{spreads[0]:>13}"
            f"{r['speedup'] or nan:>9.2f}{r.get('steady_tok_s', nan):>10.1f}{spreads[1]:>13}"
            f"{r.get('steady_speedup') or nan:>9.2f}{acc if acc is not None else nan:>10.2f}"
            f"{r.get('floor_tok_s', nan):>13.0f}"
        )
    Path(args.out).write_text(json.dumps({"shape": args.shape, "k": K, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
