"""Weight load onto the GPU: libkk's loader reading through page-locked buffers filled by reader
threads ("staged", models/staged_read.py) and through memory-mapped tensors ("mapped"), both
forced, against transformers loading the same folder onto the device, and the floor (checkpoint
bytes / page-locked upload bandwidth). The loader stages checkpoints of `MIN_STAGED_BYTES` or
more; the output says which it picks.

    python benchmarks/load.py [--shape qwen3-8b|qwen3-30b-a3b|tiny] [--experts bf16|nvfp4]
        [--dir /tmp/libkk-bench] [--repeats 3]

Every figure is a fresh process timing the load alone (after the CUDA context exists), the cases
alternated; an untimed load first puts the files in the page cache. The last line is a JSON
object of the medians (`staged_s`, `mapped_s`, `transformers_s`, `floor_s`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from decode import SHAPES, checkpoint_dir, write_checkpoint  # noqa: E402
from floors import upload_bandwidth  # noqa: E402

LIBKK_CHILD = """
import sys, time, torch
import libkk.models.loader as loader
mode, path = sys.argv[1], sys.argv[2]
loader.worth_staging = lambda total_bytes: mode == "staged"
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
start = time.perf_counter()
loader.load_model(path, torch.bfloat16, torch.device("cuda"), progress=False)
torch.cuda.synchronize()
print(time.perf_counter() - start)
"""

HF_CHILD = """
import sys, time, torch
from transformers import AutoModelForCausalLM
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
start = time.perf_counter()
AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16, device_map="cuda")
torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


def run(code: str, mode: str, path: Path) -> float:
    done = subprocess.run(
        [sys.executable, "-c", code, mode, str(path)], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{mode} load failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--experts", choices=["bf16", "nvfp4", "mxfp4"], default="bf16")
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    path = checkpoint_dir(Path(args.dir), args.shape, args.experts)
    write_checkpoint(args.shape, path, "cuda", args.experts)
    files = sorted(path.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    floor = nbytes / upload_bandwidth()

    from libkk.models.loader import checkpoint_shards, stageable

    picks = "staged" if stageable(checkpoint_shards(path)) else "mapped"
    cases = {"staged": LIBKK_CHILD, "mapped": LIBKK_CHILD}
    if args.experts == "bf16":  # transformers reads no 4-bit ModelOpt checkpoint of its own
        cases["transformers"] = HF_CHILD
    run(LIBKK_CHILD, "mapped", path)  # untimed: the page cache
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, code in cases.items():
            times[name].append(run(code, name, path))
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)

    print(f"{path.name}: {len(files)} files, {nbytes / 1e9:.2f} GB; the loader picks {picks}")
    print(f"{'case':<14}{'median s':>10}{'min':>8}{'max':>8}{'x floor':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<14}{med:>10.2f}{min(ts):>8.2f}{max(ts):>8.2f}{med / floor:>9.1f}")
    print(f"{'floor':<14}{floor:>10.2f}   ({nbytes / floor / 1e9:.1f} GB/s page-locked upload)")
    medians = {f"{name}_s": statistics.median(ts) for name, ts in times.items()}
    print(json.dumps({**medians, "floor_s": floor}))


if __name__ == "__main__":
    main()
