"""How long a full Python garbage collection stalls the process once a model is ready: libkk with
and without `freeze_gc`, and Hugging Face transformers on the same checkpoint in the same run.

A full collection walks every tracked object; a compiled model and its CUDA graphs leave hundreds
of thousands. Python starts one on its own once enough objects have survived younger collections,
so the first comes during the first requests after start-up: a stall inside some step. Each case
runs in a fresh process (the heaps do not mix): start, generate once, then time `gc.collect()`
(median of --repeats) and count the objects the collector tracks.

    python benchmarks/gc_pause.py [--shape qwen3-8b] [--device cuda]
    python benchmarks/gc_pause.py --shape tiny --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(case: str, path: str, device: str, repeats: int) -> dict:
    """In this process: start `case`, generate a few tokens, then time full collections."""
    import torch

    prompt = list(range(5, 69))
    if case == "transformers":
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=device)
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                           do_sample=False, pad_token_id=1)  # fmt: skip
    else:
        from libkk import SamplingParams, Session

        session = Session(path, device=device, freeze_gc=case == "libkk freeze_gc=True",
                          max_model_len=512, max_num_seqs=8, progress=False)  # fmt: skip
        session.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return {"case": case, "collect_ms": statistics.median(times), "spread": [min(times),
            max(times)], "tracked_objects": len(gc.get_objects())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    ap.add_argument("--out", default="gc_pause.json")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    args = ap.parse_args()
    path = Path(args.dir) / args.shape
    if args.case:
        print(json.dumps(measure(args.case, str(path), args.device, args.repeats)))
        return

    from decode import write_checkpoint

    write_checkpoint(args.shape, path, args.device)
    rows = []
    for case in ("libkk freeze_gc=False", "libkk freeze_gc=True", "transformers"):
        cmd = [sys.executable, __file__, "--case", case, "--shape", args.shape, "--device",
               args.device, "--repeats", str(args.repeats), "--dir", args.dir]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{case}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.shape} on {args.device}: one full gc.collect() after start-up and a generate")
    print(f"{'case':<26}{'collect ms':>12}{'spread':>16}{'tracked objects':>18}")
    for r in rows:
        spread = f"{r['spread'][0]:.1f}-{r['spread'][1]:.1f}"
        print(f"{r['case']:<26}{r['collect_ms']:>12.1f}{spread:>16}{r['tracked_objects']:>18}")
    Path(args.out).write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
