"""CPU decode speed on the default model: libkk vs Hugging Face transformers, same weights, fp32.

Both decode greedily from the same prompt for a fixed number of tokens (EOS ignored). Decode time
is measured after the first token (prefill excluded): libkk from each request's timeline,
transformers as generate(N + 1 tokens) minus generate(1 token). Repeats and reports the median and
the spread. Prints a table and writes JSON.

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


def bench_libkk(model_dir: str, batch: int, tokens: int, repeats: int) -> list[float]:
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    rates = []
    with Session(model_dir, device="cpu", max_model_len=1024, progress=False) as s:
        s.generate([PROMPT] * batch, SamplingParams(max_tokens=4))  # warm up
        for _ in range(repeats):
            outs = s.generate([PROMPT] * batch, params)
            decode = max(o.timeline.decode_time for o in outs)
            rates.append(batch * tokens / decode)
    return rates


def bench_transformers(model_dir: str, batch: int, tokens: int, repeats: int) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    inputs = tok([PROMPT] * batch, return_tensors="pt")

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=tok.eos_token_id)
        return time.perf_counter() - start

    run(4)  # warm up
    rates = []
    for _ in range(repeats):
        decode = run(tokens + 1) - run(1)
        rates.append(batch * tokens / decode)
    return rates


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
        for name, fn in (("libkk", bench_libkk), ("transformers", bench_transformers)):
            rates = fn(model_dir, batch, args.tokens, args.repeats)
            rows.append({"engine": name, "batch": batch, "median_tok_s": statistics.median(rates),
                         "min_tok_s": min(rates), "max_tok_s": max(rates), "runs": rates})
    print(f"CPU decode, SmolLM2-135M fp32, {args.tokens} tokens, {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'engine':<14}{'batch':>6}{'median tok/s':>14}{'min':>9}{'max':>9}")
    for r in rows:
        print(f"{r['engine']:<14}{r['batch']:>6}{r['median_tok_s']:>14.1f}"
              f"{r['min_tok_s']:>9.1f}{r['max_tok_s']:>9.1f}")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                   "torch": torch.__version__}, f, indent=2)


if __name__ == "__main__":
    main()
