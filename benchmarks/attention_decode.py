"""Paged attention timing at Qwen3-8B layer shapes (32 q / 8 KV heads, head_dim 128, block 16).

Decode: batch 1/32/128 x context 512/4K/8K, timed as CUDA-graph replays of `layers` calls, each on
its own scrambled blocks so the KV working set is several times the 60 MB L2. The floor is the KV
bytes read / 4.2 TB/s. Also sweeps decode and varlen launch settings and picks the best.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
import traceback

import libkk.kernels.attention as pa
import torch
from libkk.kernels import FP8_DTYPE, paged_attention, paged_attention_ref

H, HKV, D, BS = 32, 8, 128, 16
BW = 4.2e12
L2 = 60e6  # H200 L2 bytes
DEV = "cuda"
BATCHES = (1, 32, 128)
CONTEXTS = (512, 4096, 8192)


def kv_bytes(batch: int, ctx: int, cache_dtype: torch.dtype) -> int:
    return batch * ctx * HKV * D * 2 * torch.empty((), dtype=cache_dtype).element_size()


class Decode:
    """`layers` decode calls of one shape over disjoint, scrambled blocks of one cache."""

    def __init__(self, batch: int, ctx: int, cache_dtype: torch.dtype) -> None:
        self.batch, self.ctx, self.cache_dtype = batch, ctx, cache_dtype
        self.bytes = kv_bytes(batch, ctx, cache_dtype)
        self.layers = max(1, min(64, math.ceil(4 * L2 / self.bytes)))
        per_req = ctx // BS
        nb = 1 + self.layers * batch * per_req
        cache = torch.empty(2, nb, BS, HKV, D, dtype=torch.bfloat16, device=DEV).normal_()
        self.cache = cache.to(cache_dtype) if cache_dtype != torch.bfloat16 else cache
        del cache
        perm = torch.randperm(nb - 1, device=DEV).int() + 1
        self.tables = perm.view(self.layers, batch, per_req)
        self.q = torch.randn(self.layers, batch, H, D, dtype=torch.bfloat16, device=DEV)
        self.out = torch.empty_like(self.q)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        self.k_scale = torch.tensor([0.05], device=DEV)
        self.v_scale = torch.tensor([0.02], device=DEV)

    def args(self, layer: int) -> tuple:
        return (self.q[layer], self.cache, self.tables[layer], self.seq_lens, self.qsl,
                D**-0.5, self.k_scale, self.v_scale, 1)  # fmt: skip

    def run(self, num_splits: int = 0) -> None:
        for i in range(self.layers):
            paged_attention(*self.args(i), out=self.out[i], num_splits=num_splits)

    def error(self) -> float:
        want = paged_attention_ref(*self.args(0))
        return (self.out[0].float() - want.float()).abs().max().item()


def time_graph(fn, calls: int, reps: int = 10) -> float:
    """Microseconds per call: `fn` makes `calls` calls; it is captured once and replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def set_decode(block_n: int, warps: int, stages: int, splits_per_sm: int | None = None) -> None:
    pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.DECODE_STAGES = block_n, warps, stages
    if splits_per_sm is not None:
        pa.SPLITS_PER_SM = splits_per_sm


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def sweep_decode(results: dict) -> None:
    shapes = [(1, 8192), (32, 8192), (128, 8192), (1, 512)]
    cases = {s: Decode(*s, torch.bfloat16) for s in shapes}
    floors = {s: c.bytes / BW * 1e6 for s, c in cases.items()}
    configs = [(32, (4, 3)), (64, (4, 2)), (64, (4, 3)), (64, (8, 3)), (128, (4, 3)), (128, (8, 3))]
    rows = []
    print("\n# decode sweep (bf16): us per call, ratio to floor in ()", flush=True)
    for block_n, (warps, stages) in configs:
        set_decode(block_n, warps, stages)
        times, errs = [], []
        try:
            for c in cases.values():
                times.append(time_graph(c.run, c.layers))
                errs.append(c.error())
        except Exception:
            traceback.print_exc()
            continue
        ratio = geomean([t / floors[s] for t, s in zip(times, shapes, strict=True)])
        rows.append((ratio, (block_n, warps, stages)))
        cells = "  ".join(
            f"{t:7.1f}({t / floors[s]:4.2f})" for t, s in zip(times, shapes, strict=True)
        )
        print(f"BLOCK_N={block_n:3} warps={warps} stages={stages}: {cells}  "
              f"geo={ratio:.2f} maxerr={max(errs):.1e}", flush=True)  # fmt: skip
    best = min(rows)[1]
    set_decode(*best)
    results["decode_best"] = best
    print(f"best decode config: {best}", flush=True)

    print("\n# split target (programs per SM), best config", flush=True)
    shapes2 = [(1, 8192), (1, 4096), (32, 8192), (32, 512)]
    cases2 = {s: cases.get(s) or Decode(*s, torch.bfloat16) for s in shapes2}
    rows2 = []
    for per_sm in (1, 2, 4, 8):
        pa.SPLITS_PER_SM = per_sm
        times = [time_graph(c.run, c.layers) for c in cases2.values()]
        ratio = geomean(
            [t / (c.bytes / BW * 1e6) for t, c in zip(times, cases2.values(), strict=True)]
        )
        rows2.append((ratio, per_sm))
        print(f"SPLITS_PER_SM={per_sm}: " + "  ".join(f"{t:7.1f}" for t in times)
              + f"  geo={ratio:.2f}", flush=True)  # fmt: skip
    pa.SPLITS_PER_SM = min(rows2)[1]
    results["splits_per_sm_best"] = pa.SPLITS_PER_SM
    print(f"best SPLITS_PER_SM: {pa.SPLITS_PER_SM}", flush=True)
    del cases, cases2
    torch.cuda.empty_cache()


def decode_table(results: dict) -> None:
    print("\n# decode table: us per call (CUDA graph replay), floor = KV bytes / 4.2 TB/s")
    print(
        "| kv | batch | context | KV MB | floor us | split=1 us | default us (splits) "
        "| % of floor | TB/s | max err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    table = []
    for cache_dtype, batch, ctx in itertools.product((torch.bfloat16, FP8_DTYPE), BATCHES,
                                                     CONTEXTS):  # fmt: skip
        name = "bf16" if cache_dtype == torch.bfloat16 else "fp8"
        try:
            c = Decode(batch, ctx, cache_dtype)
            floor = c.bytes / BW * 1e6
            t1 = time_graph(lambda c=c: c.run(1), c.layers)
            td = time_graph(c.run, c.layers)
            err = c.error()
            splits = pa.default_num_splits(batch, HKV, torch.device(DEV))
            row = dict(kv=name, batch=batch, ctx=ctx, mb=c.bytes / 1e6, floor=floor, split1=t1,
                       default=td, splits=splits, err=err)  # fmt: skip
            table.append(row)
            print(f"| {name} | {batch} | {ctx} | {c.bytes / 1e6:.1f} | {floor:.1f} | {t1:.1f} | "
                  f"{td:.1f} ({splits}) | {100 * floor / td:.0f}% | {c.bytes / td / 1e6:.2f} | "
                  f"{err:.1e} |", flush=True)  # fmt: skip
            del c
            torch.cuda.empty_cache()
        except Exception:
            traceback.print_exc()
    results["decode_table"] = table


def prefill(results: dict) -> None:
    """One 4096-token causal prefill, and a mixed step (2048 prefill + 64 decodes at 4K)."""
    print("\n# varlen (prefill / mixed) sweep: us and causal TFLOP/s", flush=True)
    gen_cases = {
        "prefill 1x4096": [(4096, 4096)],
        "mixed 2048 + 64x(1 @ 4K)": [(2048, 2048)] + [(1, 4096)] * 64,
    }
    built = {}
    for name, reqs in gen_cases.items():
        blocks = [-(-s // BS) for _, s in reqs]
        nb = 1 + sum(blocks)
        cache = torch.randn(2, nb, BS, HKV, D, dtype=torch.bfloat16, device=DEV)
        perm = (torch.randperm(nb - 1, device=DEV) + 1).int().tolist()
        table = torch.zeros(len(reqs), max(blocks), dtype=torch.int32)
        i = 0
        for r, n in enumerate(blocks):
            table[r, :n] = torch.tensor(perm[i : i + n])
            i += n
        tokens = sum(q for q, _ in reqs)
        qsl = torch.tensor([0] + list(itertools.accumulate(q for q, _ in reqs)), dtype=torch.int32)
        args = (torch.randn(tokens, H, D, dtype=torch.bfloat16, device=DEV), cache, table.to(DEV),
                torch.tensor([s for _, s in reqs], dtype=torch.int32, device=DEV), qsl.to(DEV),
                D**-0.5, torch.ones(1, device=DEV), torch.ones(1, device=DEV),
                max(q for q, _ in reqs))  # fmt: skip
        flops = sum(4 * H * D * sum(s - q + i + 1 for i in range(q)) for q, s in reqs)
        built[name] = (args, flops, torch.empty_like(args[0]))
    configs = [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2),
               (128, 32, 4, 3), (64, 32, 4, 3)]  # fmt: skip
    rows = []
    for block_m, block_n, warps, stages in configs:
        pa.VARLEN_BLOCK_M, pa.VARLEN_BLOCK_N = block_m, block_n
        pa.VARLEN_WARPS, pa.VARLEN_STAGES = warps, stages
        cells, ts = [], []
        try:
            for name, (args, flops, out) in built.items():
                t = time_graph(lambda args=args, out=out: paged_attention(*args, out=out), 1)
                want = paged_attention_ref(*args)
                err = (out.float() - want.float()).abs().max().item()
                ts.append(t)
                cells.append(f"{name}: {t:8.1f} us {flops / t / 1e6:6.1f} TFLOP/s err {err:.1e}")
        except Exception:
            traceback.print_exc()
            continue
        rows.append((geomean(ts), (block_m, block_n, warps, stages)))
        print(f"M={block_m} N={block_n} w={warps} s={stages} | " + " | ".join(cells), flush=True)
    best = min(rows)[1]
    results["varlen_best"] = best
    print(f"best varlen config: {best}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-sweep", action="store_true")
    opts = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs", flush=True)
    results: dict = {}
    t0 = time.time()
    for step in (decode_table,) if opts.no_sweep else (sweep_decode, decode_table, prefill):
        try:
            step(results)
        except Exception:
            traceback.print_exc()
        print(f"[{step.__name__} done at {time.time() - t0:.0f}s]", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
