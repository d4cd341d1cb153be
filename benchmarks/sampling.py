"""Keyed Gumbel sampling at Qwen3's vocabulary (151936): the fused Triton kernel vs the torch path.

For 1, 8, 32 and 256 rows of fp32 logits: median time per gumbel_argmax call of both paths (eager,
each repeat averages a burst of calls: at few rows this is the host's launch cost), the kernel's
GPU time alone (CUDA graph replay), checking that both paths pick the same tokens, against the
floor = bytes of logits read / device copy bandwidth measured in the same run ("x floor" is the
graph time over it). Several copies of the logits rotate so small batches are not served from L2.

Run on the GPU machine: python benchmarks/sampling.py   (under a minute)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from floors import copy_bandwidth, cuda_seconds

from libkk.sample.gumbel import gumbel_argmax, gumbel_argmax_ref

VOCAB = 151_936
ROWS = (1, 8, 32, 256)
DEV = "cuda"
ROTATE_BYTES = 256 << 20  # logits copies cycled per size: several times the L2


def median_seconds(fn, calls: int, repeats: int) -> float:
    """Median over repeats of the mean time of `calls` back-to-back calls (CUDA events)."""
    return statistics.median(cuda_seconds(fn, calls, repeats))


def graph_seconds(inputs: list[tuple[torch.Tensor, ...]], repeats: int) -> float:
    """Median GPU time per fused call: one CUDA graph holds a call per input copy (no host)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            gumbel_argmax(*args)
    return median_seconds(graph.replay, calls=1, repeats=repeats) / len(inputs)


def rotating(fn, inputs: list[tuple[torch.Tensor, ...]]):
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(inputs)
        return fn(*inputs[state["i"]])

    return call


def measure(rows: int, calls: int, repeats: int) -> dict[str, float]:
    g = torch.Generator(device=DEV).manual_seed(rows)
    nbytes = rows * VOCAB * 4
    copies = max(2, min(64, -(-ROTATE_BYTES // nbytes)))
    inputs = []
    for _ in range(copies):
        logits = torch.randn(rows, VOCAB, generator=g, device=DEV) * 3
        seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g, device=DEV)
        positions = torch.randint(0, 2**32, (rows,), generator=g, device=DEV)
        inputs.append((logits, seeds, positions))
    for args in inputs[:2]:
        fused, ref = gumbel_argmax(*args), gumbel_argmax_ref(*args)
        if not torch.equal(fused, ref):
            raise AssertionError(f"rows={rows}: kernel and torch path sample different tokens")
    return {
        "rows": rows,
        "torch_s": median_seconds(rotating(gumbel_argmax_ref, inputs), calls, repeats),
        "kernel_s": median_seconds(rotating(gumbel_argmax, inputs), calls, repeats),
        "kernel_graph_s": graph_seconds(inputs, repeats),
        "logits_bytes": nbytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--calls", type=int, default=20, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {bandwidth / 1e12:.2f} TB/s, vocab {VOCAB}")
    print(
        f"{'rows':>5} {'torch ms':>9} {'kernel ms':>10} {'speedup':>8} {'floor ms':>9} {'x floor':>8}"
    )
    results = []
    for rows in args.rows:
        r = measure(rows, args.calls, args.repeats)
        r["floor_s"] = r["logits_bytes"] / bandwidth
        results.append(r)
        print(
            f"{rows:>5} {r['torch_s'] * 1e3:>9.3f} {r['kernel_s'] * 1e3:>10.4f} "
            f"{r['torch_s'] / r['kernel_s']:>7.1f}x {r['kernel_graph_s'] * 1e3:>9.4f} "
            f"{r['floor_s'] * 1e3:>9.4f} {r['kernel_graph_s'] / r['floor_s']:>7.1f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "vocab": VOCAB, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
