"""Wall time of each host phase of a decode step, speculative or plain, on the GPU.

Where a batch's step time goes without a profiler (the profiler inflates host time): each phase's
function is wrapped with a perf_counter timer, and every step's phase times are kept, so the
prefill steps and the last, draining step are left out of the medians. Qwen3-8B shape, random
weights (benchmarks/decode.py's checkpoint), prompt 256, 64 tokens; speculative runs use
benchmarks/spec.py's synthetic case (K = 7 anchor drafts accepted at the rate giving acceptance
length 3.5), synchronous as the engine runs speculation.

Phases: schedule, input batch, forward launch, LM head launch, the logits and verification or
sampling (which hold the wait for the device), update, outputs (detokenize), propose; under
async scheduling also the launch and the previous step's finish (which waits); with `--adaptive`
adaptive verification's own host work (trim, observe, record_step). With
`--split-verify`, verification first waits for the device on its own (a synchronize, timed as
"verify: device wait"), so its own host work shows apart ("verify: rest"); that moves the launch
of verification's small kernels after the forward, so the step gets slower by their launch time.

    python benchmarks/step_phases.py --batch 32 --mode spec [--split-verify]
    python benchmarks/step_phases.py --batch 32 --mode plain        # async scheduling
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from decode import COMMON, SHAPES, prompts, write_checkpoint
from spec import K, RepeatAnchor, rate_for_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mode", choices=["spec", "plain", "plain-sync"], default="spec")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--split-verify", action="store_true")
    ap.add_argument("--adaptive", action="store_true", help="spec with adaptive verification")
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    args = ap.parse_args()

    import libkk.runtime.model_runner as model_runner
    from libkk import SamplingParams, Session

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(args.dir) / args.shape
    write_checkpoint(args.shape, path, device)
    ids = prompts(args.batch, 256, {**COMMON, **SHAPES[args.shape]}["vocab_size"])
    settings: dict = {"async_scheduling": args.mode == "plain"}
    if args.mode == "spec":
        settings |= dict(
            method="ngram",
            num_speculative_tokens=K,
            rejection_sample_method="synthetic",
            synthetic_acceptance_rates=[rate_for_length(3.5)],
            adaptive_verification=args.adaptive,
        )
    params = [
        SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True, seed=i)
        for i in range(args.batch)
    ]
    totals: dict[str, float] = {}

    def timed(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    with Session(
        str(path),
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_model_len=256 + args.tokens + 32,
        max_num_seqs=args.batch,
        max_num_batched_tokens=8192,
        progress=False,
        **settings,
    ) as s:
        engine, runner = s.engine, s.engine.runner
        if args.mode == "spec":
            engine.speculation.proposer = RepeatAnchor()
        s.generate(ids, params)  # warm-up: every step shape the timed run sees
        longest = [0]  # the longest query this step schedules: > 1 + K only with a prefill
        schedule = engine.scheduler.schedule

        def noted_schedule():
            out = schedule()
            longest[0] = max((r.num_new_tokens for r in out.requests), default=0)
            return out

        engine.scheduler.schedule = noted_schedule
        timed(engine.scheduler, "schedule", "schedule")
        timed(engine.scheduler, "append", "append")
        timed(engine, "_process_tokens", "outputs")
        timed(engine.speculation, "after_step", "propose")
        timed(runner.step_backends, "run", "forward launch")
        timed(runner.model, "compute_logits", "LM head launch")
        timed(runner, "_sample_with_drafts", "logits + verification")
        timed(model_runner, "build_input_batch", "input batch")
        timed(engine, "_launch", "launch")
        timed(engine, "_finish", "finish (waits)")
        if engine.speculation.adaptive is not None:
            for name in ("trim", "observe", "record_step"):
                timed(engine.speculation.adaptive, name, f"adaptive {name}")
        if args.split_verify and device == "cuda":
            verify = model_runner.verify

            def split(*a, **k):
                start = time.perf_counter()
                torch.cuda.synchronize()
                waited = time.perf_counter()
                try:
                    return verify(*a, **k)
                finally:
                    end = time.perf_counter()
                    for label, t in (("verify: device wait", waited - start),
                                     ("verify: rest", end - waited)):  # fmt: skip
                        totals[label] = totals.get(label, 0.0) + t

            model_runner.verify = split
        per_step: list[dict[str, float]] = []
        step = engine.step

        def recorded_step():
            before = dict(totals)
            start = time.perf_counter()
            out = step()
            row = {k: v - before.get(k, 0.0) for k, v in totals.items()}
            row["step"] = time.perf_counter() - start
            row["prefill"] = longest[0] > 1 + K
            per_step.append(row)
            return out

        engine.step = recorded_step
        s.generate(ids, params)
    # Leave out prefill steps, the step after them (async: it finishes a prefill) and the last.
    decode = [r for i, r in enumerate(per_step[:-1]) if not any(
        p["prefill"] for p in per_step[max(i - 1, 0) : i + 1])]  # fmt: skip
    print(f"{args.mode}, batch {args.batch}: {len(decode)} decode steps of {len(per_step)}")
    print(f"{'phase':34s} {'median ms':>9s} {'min':>7s} {'max':>7s}")
    labels = [k for k in decode[0] if k != "prefill"]
    labels.sort(key=lambda k: -statistics.median(r.get(k, 0.0) for r in decode))
    for label in labels:
        ms = sorted(r.get(label, 0.0) * 1e3 for r in decode)
        print(f"{label:34s} {statistics.median(ms):9.3f} {ms[0]:7.3f} {ms[-1]:7.3f}")


if __name__ == "__main__":
    main()
