"""The all-reduce that tensor parallelism pays twice per layer, against the link's floor.

Two GPUs, one process each (as libkk's TP runs). Per message size (hidden 4096 in bf16 at 1 to
2048 tokens: decode to prefill):

- NCCL through torch.distributed, eager (`dist.all_reduce`, one launch each) and replayed from a
  CUDA graph (how libkk's decode steps run it): microseconds per all-reduce;
- the floor: one GPU-to-GPU copy of the message (measured in one process, `copy_` from cuda:0 to
  cuda:1), which a two-rank all-reduce must at least pay once each way, and the copy's bandwidth
  at 64 MiB.

`NCCL_DEBUG=INFO python benchmarks/allreduce.py` also shows which transport NCCL chose
(P2P/IPC over NVLink, or SHM through host memory).

    python benchmarks/allreduce.py [--out allreduce.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from floors import cuda_seconds

HIDDEN = 4096
TOKENS = [1, 8, 32, 256, 2048]
REPEATS = 5
ITERS = 50


def _time_us(fn, iters: int = ITERS) -> list[float]:
    """Per-call microseconds of `fn` over `iters` calls, REPEATS times (CUDA events)."""
    return [t * 1e6 for t in cuda_seconds(fn, iters, REPEATS, warmup=0)]


def _summary(times: list[float]) -> dict:
    return {"us": statistics.median(times), "spread": [min(times), max(times)]}


def _rank(rank: int, world: int, port: int, queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        device_id=device,
    )  # fmt: skip
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)  # NCCL connects on its first collective
    results = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        eager = _time_us(lambda x=x: dist.all_reduce(x))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dist.all_reduce(x)  # warm-up outside capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(ITERS):
                    dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        graphed = _time_us(graph.replay, iters=1)
        results[tokens] = {
            "bytes": x.numel() * x.element_size(),
            "eager": _summary(eager),
            "graph": _summary([t / ITERS for t in graphed]),
        }
        del graph
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _copy_floor() -> dict:
    """GPU-to-GPU copy time per message size, and the copy bandwidth at 64 MiB."""
    src = torch.device("cuda", 0)
    dst = torch.device("cuda", 1)
    out = {"peer_access": torch.cuda.can_device_access_peer(0, 1), "copy": {}}
    for tokens in TOKENS:
        a = torch.randn(tokens, HIDDEN, device=src, dtype=torch.bfloat16)
        b = torch.empty_like(a, device=dst)
        out["copy"][tokens] = _summary(_time_us(lambda a=a, b=b: b.copy_(a, non_blocking=True)))
    big = torch.empty(64 << 20, dtype=torch.uint8, device=src)
    big_dst = torch.empty_like(big, device=dst)
    us = statistics.median(_time_us(lambda: big_dst.copy_(big, non_blocking=True), iters=10))
    out["copy_GBps_64MiB"] = big.numel() / us / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="allreduce.json")
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA devices")
    floor = _copy_floor()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, args.port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    nccl = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "floor": floor,
        "nccl_all_reduce": nccl,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nall-reduce, 2x {result['gpu']}, NCCL {result['nccl']}, peer access "
          f"{floor['peer_access']}, copy {floor['copy_GBps_64MiB']:.0f} GB/s at 64 MiB")  # fmt: skip
    print(f"{'tokens':>7} {'bytes':>10} {'eager us':>9} {'graph us':>9} {'copy us':>8} "
          f"{'graph GB/s':>10}")  # fmt: skip
    for tokens in TOKENS:
        r = nccl[tokens]
        print(f"{tokens:>7} {r['bytes']:>10} {r['eager']['us']:>9.1f} {r['graph']['us']:>9.1f} "
              f"{floor['copy'][tokens]['us']:>8.1f} {r['bytes'] / r['graph']['us'] / 1e3:>10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
