"""Time to first token for a long shared prefix: recomputed vs a host-tier (CPU RAM) hit vs a
device-pool hit, in one process on the default model.

Each case sends the same long prefix plus a short distinct question:
- recomputed: prefix caching off;
- device hit: the prefix's blocks are still in the device pool;
- host-tier hit: other prompts first push the prefix's blocks out of a small device pool, so they
  come back from `kv_offload_bytes` RAM.
The peer is transformers' first-token time for the same prompt (a full prefill). Median of
--repeats; prints a table and writes JSON. `--shape` runs random weights at a real shape (written
by benchmarks/decode.py's helper) instead of the default model.

    python benchmarks/prefix_ttft.py [--prefix-tokens 1536] [--repeats 5] [--device cpu]
    python benchmarks/prefix_ttft.py --shape qwen3-8b --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from libkk import SamplingParams, Session

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import SHAPES, write_checkpoint  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def ttft(session: Session, prompt: list[int]) -> tuple[float, int]:
    out = session.generate(prompt, ONE)
    return out.timeline.time_to_first_token, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="prefix_ttft.json")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    args = ap.parse_args()

    if args.shape:
        model_path = Path(args.dir) / args.shape
        write_checkpoint(args.shape, model_path, args.device)
        model, dtype, name = str(model_path), torch.bfloat16, args.shape
    else:
        from libkk.models.default import default_model_path

        model, dtype, name = default_model_path(progress=False), torch.float32, "default model"

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 40000, (args.prefix_tokens,), generator=g).tolist()
    questions = [torch.randint(100, 40000, (16,), generator=g).tolist() for _ in range(64)]
    fillers = [torch.randint(100, 40000, (args.prefix_tokens,), generator=g).tolist()
               for _ in range(3)]  # fmt: skip
    block, max_len = 16, args.prefix_tokens + 64
    # A device pool of about 1.5 sequences: one filler evicts the prefix.
    pool = (3 * max_len) // (2 * block) + 1
    common = dict(model=model, dtype=str(dtype).removeprefix("torch."), device=args.device,
                  block_size=block, max_model_len=max_len, max_num_seqs=2, progress=False)  # fmt: skip
    results: dict[str, list[float]] = {"recomputed": [], "device hit": [], "host-tier hit": []}
    q = iter(questions)

    with Session(enable_prefix_caching=False, num_gpu_blocks=pool, **common) as s:
        ttft(s, fillers[0] + next(q))  # warm up: a full-length prefill compiles its shapes
        for _ in range(args.repeats):
            results["recomputed"].append(ttft(s, prefix + next(q))[0])
    with Session(num_gpu_blocks=pool, kv_offload_bytes=4 << 30, **common) as s:
        ttft(s, fillers[0] + next(q))  # warm up a full prefill and a prefill over a cached prefix
        ttft(s, fillers[0] + next(q))
        ttft(s, prefix + next(q))
        for _ in range(args.repeats):
            t, cached = ttft(s, prefix + next(q))
            assert cached >= args.prefix_tokens - block, "expected a device hit"
            results["device hit"].append(t)
        for _ in range(args.repeats):
            for filler in fillers:
                s.generate(filler, ONE)
            before = s.stats()["offload_blocks_restored"]
            t, cached = ttft(s, prefix + next(q))
            assert s.stats()["offload_blocks_restored"] > before, "expected a host-tier hit"
            results["host-tier hit"].append(t)
        stats = s.stats()

    from transformers import AutoModelForCausalLM

    peer = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(args.device).eval()
    results["transformers"] = []
    for _ in range(args.repeats + 1):  # the first is a warm-up
        ids = torch.tensor([prefix + next(q)], device=args.device)
        start = time.perf_counter()
        with torch.inference_mode():
            peer.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                          do_sample=False, pad_token_id=0)  # fmt: skip
        if args.device == "cuda":
            torch.cuda.synchronize()
        results["transformers"].append(time.perf_counter() - start)
    del results["transformers"][0]

    print(f"time to first token, {args.prefix_tokens}-token shared prefix, {name}, "
          f"{args.device}, {args.repeats} repeats")  # fmt: skip
    print(f"{'case':<16}{'median ms':>11}{'min':>9}{'max':>9}")
    for name, times in results.items():
        ms = [t * 1e3 for t in times]
        print(f"{name:<16}{statistics.median(ms):>11.1f}{min(ms):>9.1f}{max(ms):>9.1f}")
    print(f"host tier: {stats['offload_blocks_restored']} blocks restored, "
          f"{stats['offload_bytes_moved'] / 2**20:.1f} MiB moved")  # fmt: skip
    Path(args.out).write_text(json.dumps({"results": results, "stats": stats}, indent=2))


if __name__ == "__main__":
    main()
