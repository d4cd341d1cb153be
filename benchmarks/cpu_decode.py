"""CPU decode speed on the default model: libkk vs Hugging Face transformers, same weights, fp32.

Both decode greedily from the same prompt for a fixed number of tokens (EOS ignored). Decode time
is measured after the first token (prefill excluded): libkk from each request's timeline,
transformers as generate(N + 1 tokens) minus generate(1 token). The two run interleaved, repeat
after repeat, and the table reports the median and the spread. Writes JSON too.

    python benchmarks/cpu_decode.py [--tokens 128] [--repeats 5] [--batch 1 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

PROMPT = "The history of the printing press begins with"


def libkk_runner(model_dir: str, batch: int, tokens: int):
    from libkk import SamplingParams, Session

    session = Session(model_dir, device="cpu", max_model_len=1024, progress=False)
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    session.generate([PROMPT] * batch, SamplingParams(max_tokens=4))  # warm up

    def run() -> float:
        outs = session.generate([PROMPT] * batch, params)
        return batch * tokens / max(o.timeline.decode_time for o in outs)

    return run


def transformers_runner(model_dir: str, batch: int, tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tok([PROMPT] * batch, return_tensors="pt")

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                **inputs,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        return time.perf_counter() - start

    generate(4)  # warm up

    def run() -> float:
        return batch * tokens / (generate(tokens + 1) - generate(1))

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--out", default="cpu_decode.json")
    args = ap.parse_args()

    from libkk.models.default import default_model_path

    model_dir = str(default_model_path())
    rows = []
    for batch in args.batch:
        runners = {
            "libkk": libkk_runner(model_dir, batch, args.tokens),
            "transformers": transformers_runner(model_dir, batch, args.tokens),
        }
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
            for name, run in runners.items():
                rates[name].append(run())
        for name, r in rates.items():
            rows.append(
                {
                    "engine": name,
                    "batch": batch,
                    "median_tok_s": statistics.median(r),
                    "min_tok_s": min(r),
                    "max_tok_s": max(r),
                    "runs": r,
                }
            )
    print(
        f"CPU decode, SmolLM2-135M fp32, {args.tokens} tokens, {args.repeats} repeats, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    print(f"{'engine':<14}{'batch':>6}{'median tok/s':>14}{'min':>9}{'max':>9}")
    for r in rows:
        print(
            f"{r['engine']:<14}{r['batch']:>6}{r['median_tok_s']:>14.1f}"
            f"{r['min_tok_s']:>9.1f}{r['max_tok_s']:>9.1f}"
        )
    with open(args.out, "w") as f:
        json.dump(
            {
                "rows": rows,
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
