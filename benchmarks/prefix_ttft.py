"""Time to first token for a long shared prefix: recomputed vs a host-tier (CPU RAM) hit vs a
device-pool hit, in one process on the default model.

Each case sends the same long prefix plus a short distinct question:
- recomputed: prefix caching off;
- device hit: the prefix's blocks are still in the device pool;
- host-tier hit: other prompts first push the prefix's blocks out of a small device pool, so they
  come back from `kv_offload_bytes` RAM.
The peer is transformers' first-token time for the same prompt (a full prefill). Median of
--repeats; prints a table and writes JSON.

    python benchmarks/prefix_ttft.py [--prefix-tokens 1536] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from libkk import SamplingParams, Session

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
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 40000, (args.prefix_tokens,), generator=g).tolist()
    questions = [torch.randint(100, 40000, (16,), generator=g).tolist() for _ in range(64)]
    fillers = [torch.randint(100, 40000, (args.prefix_tokens,), generator=g).tolist()
               for _ in range(3)]  # fmt: skip
    block, max_len = 16, args.prefix_tokens + 64
    # A device pool of about 1.5 sequences: one filler evicts the prefix.
    pool = (3 * max_len) // (2 * block) + 1
    common = dict(device=args.device, block_size=block, max_model_len=max_len, progress=False)
    results: dict[str, list[float]] = {"recomputed": [], "device hit": [], "host-tier hit": []}
    q = iter(questions)

    with Session(enable_prefix_caching=False, num_gpu_blocks=pool, **common) as s:
        ttft(s, next(q))  # warm up
        for _ in range(args.repeats):
            results["recomputed"].append(ttft(s, prefix + next(q))[0])
    with Session(num_gpu_blocks=pool, kv_offload_bytes=4 << 30, **common) as s:
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

    from libkk.models.default import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(progress=False),
                                                 dtype=torch.float32).eval()  # fmt: skip
    results["transformers"] = []
    for _ in range(args.repeats):
        ids = torch.tensor([prefix + next(q)])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=1, do_sample=False)
        results["transformers"].append(time.perf_counter() - start)

    print(f"time to first token, {args.prefix_tokens}-token shared prefix, default model, "
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
