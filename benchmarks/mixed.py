"""Throughput of a continuous-batching workload (prefills arriving while others decode) under each
CUDA-graph mode, against Hugging Face transformers' static batches of the same requests.

Random bf16 weights at a real shape (benchmarks/decode.py's checkpoint). --requests requests with
--prompt-token prompts and output lengths drawn uniformly from [--min-tokens, --max-tokens]
(seeded, EOS ignored) go to one `generate` call with max_num_seqs = --batch: as requests finish at
different steps, new prompts are prefilled in steps that also decode the others (mixed batches).
Uniform decode steps replay FULL graphs in every mode but NONE; the mixed steps run eagerly under
FULL_DECODE_ONLY, replay FULL graphs of their padded token count under FULL, and replay graphed
pieces under FULL_AND_PIECEWISE (in both, when their token count is at most the largest capture
size; a --prompt-token prefill chunk is larger and runs eagerly).

Output tok/s = requested output tokens / wall time of the call; each mode first runs the workload
once untimed (compiles and captures), then --repeats timed runs (median, spread). The peer runs
the requests in static batches of --batch, each to its longest request's length (what static
batching costs), counting only the requested tokens.

    python benchmarks/mixed.py [--shape qwen3-8b] [--modes FULL_DECODE_ONLY FULL FULL_AND_PIECEWISE]
        [--compile auto|on|off]
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
from decode import COMMON, COMPILE, SHAPES, prompts, write_checkpoint  # noqa: E402


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    ids = prompts(args.requests, args.prompt, vocab)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_tokens, args.max_tokens + 1, (args.requests,), generator=g)
    return ids, lengths.tolist()


def bench_libkk(path: Path, mode: str, ids: list[list[int]], lengths: list[int], args) -> dict:
    from libkk import SamplingParams, Session

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    with Session(
        str(path),
        dtype="bfloat16",
        device=args.device,
        max_model_len=args.prompt + args.max_tokens + 16,
        max_num_seqs=args.batch,
        cudagraph_mode=mode,
        torch_compile=COMPILE[args.compile],
        progress=False,
    ) as s:
        s.generate(ids, params)  # warm up: compiles, captures and every step shape
        ready = time.perf_counter() - start
        tok_s = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            s.generate(ids, params)
            tok_s.append(sum(lengths) / (time.perf_counter() - t0))
    return {"tok_s": statistics.median(tok_s), "spread": [min(tok_s), max(tok_s)],
            "per_repeat": tok_s, "start_and_warm_up_s": ready}  # fmt: skip


def bench_transformers(path: Path, ids: list[list[int]], lengths: list[int], args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()

    def run() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, len(ids), args.batch):
            chunk = torch.tensor(ids[i : i + args.batch], device="cuda")
            n = max(lengths[i : i + args.batch])
            with torch.inference_mode():
                model.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=1)  # fmt: skip
        torch.cuda.synchronize()
        return sum(lengths) / (time.perf_counter() - t0)

    run()  # warm up
    tok_s = [run() for _ in range(args.repeats)]
    return {"tok_s": statistics.median(tok_s), "spread": [min(tok_s), max(tok_s)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument(
        "--modes", nargs="+", default=["FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE"]
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="max_num_seqs")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--compile", choices=sorted(COMPILE), default="auto",
                    help="torch_compile, as decode.py's --compile")  # fmt: skip
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (use --shape tiny)")
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    ap.add_argument("--out", default="mixed.json")
    args = ap.parse_args()

    path = Path(args.dir) / args.shape
    write_checkpoint(args.shape, path, args.device)
    ids, lengths = workload(args, {**COMMON, **SHAPES[args.shape]}["vocab_size"])
    rows = []
    for mode in args.modes:
        row = {"case": f"libkk {mode}", **bench_libkk(path, mode, ids, lengths, args)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.no_peer and args.device == "cuda":
        row = {"case": "transformers (static batches)", **bench_transformers(path, ids, lengths,
                                                                            args)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.shape}: {args.requests} requests, prompt {args.prompt}, outputs "
          f"{args.min_tokens}-{args.max_tokens} tokens ({sum(lengths)} in all), "
          f"max_num_seqs {args.batch}")  # fmt: skip
    print(f"{'case':<34}{'output tok/s':>14}{'spread':>18}")
    for r in rows:
        spread = f"{r['spread'][0]:.0f}-{r['spread'][1]:.0f}"
        print(f"{r['case']:<34}{r['tok_s']:>14.1f}{spread:>18}")
    Path(args.out).write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
