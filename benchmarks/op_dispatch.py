"""What calling a libkk op costs on the host: through torch's dispatcher (the registered custom op,
what torch.compile traces) against its function directly (what an eager forward runs,
`kernels/_jit.py`'s KernelOp), and the torch._dynamo import that the dispatcher's custom-op path
makes at the first call of any op, each in a fresh process.

On CUDA the op is `rms_norm` on one decode row of the 8B shape (hidden 4096), so the figures
include its Triton launch; on the CPU (no kernels) an empty custom op stands in.

    python benchmarks/op_dispatch.py [--calls 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time, torch
cuda = torch.cuda.is_available()
if cuda:
    from libkk.kernels import rms_norm as op
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    direct, dispatched = op.fn, op.op
else:
    @torch.library.custom_op("bench::empty", mutates_args=())
    def empty(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(0)
    empty.register_fake(lambda x, w, eps: x.new_empty(0))
    x, w = torch.randn(1, 64), torch.ones(64)
    direct, dispatched = empty._init_fn, empty

def per_call(fn, n):
    for _ in range(100):
        fn(x, w, 1e-6)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn(x, w, 1e-6)
    elapsed = time.perf_counter() - start  # host time: launches are asynchronous
    return elapsed / n * 1e6

with torch.inference_mode():
    before = "torch._dynamo" in sys.modules
    start = time.perf_counter()
    dispatched(x, w, 1e-6)
    first = time.perf_counter() - start
    imported = "torch._dynamo" in sys.modules and not before
    print(json.dumps({"first_dispatched_call_s": first, "imported_dynamo": imported,
                      "direct_us": per_call(direct, {calls}),
                      "dispatched_us": per_call(dispatched, {calls})}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run(
            [sys.executable, "-c", CHILD.replace("{calls}", str(args.calls))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    for key in ("first_dispatched_call_s", "direct_us", "dispatched_us"):
        values = [r[key] for r in runs]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    summary["imported_dynamo"] = all(r["imported_dynamo"] for r in runs)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
