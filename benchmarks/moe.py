"""One MoE layer of the Qwen3-30B-A3B shape (128 experts, top-8, hidden 2048, moe_intermediate 768)
with packed NVFP4 / MXFP4 experts (fused W4A16 kernels) vs the bf16 plain-torch path.

For 1, 4, 16, 64, 256 and 4096 tokens: time per layer of the experts (both GEMMs, the top-k sum,
and on the sorted path the align; routing timed apart) as CUDA-graph replays of the fused path,
eager for the plain path, which reads counts on the host; achieved GB/s (bytes of the experts the
tokens touch + activations) and TFLOP/s, each against its floor measured in the same run: bytes /
device copy bandwidth, FLOPs / bf16 matmul rate; and each kernel's device time from the profiler.
Weights come from quantizing Gaussian weights, so scales (and their CSF compression) are
realistic; four copies of the layer rotate so the touched experts are not served from L2. Also:
CSF expansion time of one layer's scales vs the layer time.

Run on the GPU machine: python benchmarks/moe.py --json moe.json   (about 3-5 minutes)

`--sweep` instead times the fused path over a grid of tile configurations at each token count
(CUDA-graph replays, same inputs) and prints the fastest few beside the default table's choice:
what `kernels/moe/common.py`'s static tile table should hold. Up to 16 tokens the grid
starts with the pair-major decode path (block_m = 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback

import torch
from floors import copy_bandwidth, matmul_rate, time_cuda

E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TOKENS = (1, 4, 16, 64, 256, 4096)
COPIES = 4  # layer copies cycled through, so the working set is several times L2
DEV = "cuda"
_START = time.monotonic()
_deadline_s = 480.0  # stop starting new measurements after this (--budget)


def _left() -> float:
    return _deadline_s - (time.monotonic() - _START)


def quantized_layer(fmt: str, seed: int) -> dict[str, torch.Tensor]:
    """Packed experts of one layer, quantized from Gaussian weights on the device."""
    from libkk.quant.formats import quantize_mxfp4, quantize_nvfp4

    g = torch.Generator(device=DEV).manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("w13", "s13", "g13", "w2", "s2", "g2")}
    for _ in range(E):
        for name, rows, cols, parts in (("13", 2 * INTER, HIDDEN, 2), ("2", HIDDEN, INTER, 1)):
            w = torch.randn(rows, cols, generator=g, device=DEV) * 0.02
            packed, scales, globs = [], [], []
            for block in w.chunk(parts):
                if fmt == "nvfp4":
                    q = quantize_nvfp4(block)
                    packed.append(q.weight)
                    scales.append(q.weight_scale.view(torch.uint8))
                    globs.append(q.weight_scale_2.reshape(1))
                else:
                    q = quantize_mxfp4(block)
                    packed.append(q.weight)
                    scales.append(q.scale)
                    globs.append(torch.ones(1, device=DEV))
            out[f"w{name}"].append(torch.cat(packed))
            out[f"s{name}"].append(torch.cat(scales))
            out[f"g{name}"].append(torch.cat(globs))
    return {k: torch.stack(v).contiguous() for k, v in out.items()}


def layer_args(layer: dict[str, torch.Tensor]) -> tuple:
    return tuple(layer[k] for k in ("w13", "s13", "g13", "w2", "s2", "g2"))


def expert_bytes(layer: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in layer.values()) / E


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from libkk.kernels.moe import moe_topk_routing_ref

    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=g, device=DEV).to(torch.bfloat16)
    weights, ids = moe_topk_routing_ref(torch.randn(t, E, generator=g, device=DEV), TOP_K, True)
    return x, weights, ids


def bench_fused(fmt: str, layers: list[dict], t: int, floors: dict) -> dict:
    from libkk.kernels.moe import fused_moe_w4a16

    inputs = [routing(t, seed=100 * t + i) for i in range(COPIES)]
    touched = sum(int(ids.unique().numel()) for _, _, ids in inputs) / COPIES
    per_expert = expert_bytes(layers[0])
    act_bytes = t * HIDDEN * 2 * 2 + t * TOP_K * (INTER * 2 * 2 + HIDDEN * 2 * 2)
    nbytes = touched * per_expert + act_bytes
    flops = 2 * t * TOP_K * 3 * HIDDEN * INTER

    def run_all():
        for layer, (x, w, ids) in zip(layers, inputs, strict=True):
            fused_moe_w4a16(x, *layer_args(layer), w, ids, fmt)

    run_all()  # compile
    torch.cuda.synchronize()
    eager = time_cuda(run_all, iters=5) / COPIES
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_all()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        run_all()
    per_layer = time_cuda(graph.replay, iters=20 if t <= 256 else 5) / COPIES
    kernels = kernel_times(run_all, COPIES, calls=10 if t <= 256 else 2)
    # the routing and alignment parts alone (eager, so launch overhead included)
    from libkk.kernels.moe import (
        PAIR_MAJOR,
        default_tile_config,
        moe_align_block_size,
        moe_topk_routing,
    )

    logits = torch.randn(t, E, device=DEV, dtype=torch.bfloat16)
    block_m = default_tile_config(t).block_m
    routing_s = time_cuda(lambda: moe_topk_routing(logits, TOP_K, True), iters=20)
    align_s = 0.0  # the pair-major path does not align
    if block_m != PAIR_MAJOR:
        align_s = time_cuda(lambda: moe_align_block_size(inputs[0][2], E, block_m), iters=20)
    floor_bytes = nbytes / floors["copy_bw"]
    floor_flops = flops / floors["matmul_flops"]
    return {
        "time_us": per_layer * 1e6,
        "kernels_us": kernels,
        "routing_us": routing_s * 1e6,
        "align_us": align_s * 1e6,
        "eager_time_us": eager * 1e6,
        "experts_touched": touched,
        "bytes": nbytes,
        "flops": flops,
        "GB_s": nbytes / per_layer / 1e9,
        "TFLOP_s": flops / per_layer / 1e12,
        "floor_us": max(floor_bytes, floor_flops) * 1e6,
        "bandwidth_fraction": floor_bytes / per_layer,
        "compute_fraction": floor_flops / per_layer,
    }


def kernel_times(run_all, layers: int, calls: int = 10) -> dict[str, float]:
    """Device µs per layer of each kernel `run_all` launches (eager, from torch.profiler's CUDA
    events: launch gaps excluded), longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run_all()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / (calls * layers)) for e in prof.key_averages()]
    return {name[:48]: us for name, us in sorted(rows, key=lambda r: -r[1]) if us > 0}


def sweep_configs(t: int) -> list:
    """Tile configurations worth trying at t tokens (decode sizes: small M tiles, many N tiles)."""
    import itertools

    from libkk.kernels.moe import PAIR_MAJOR, MoeTileConfig

    pairs = []  # the pair-major decode path first: the budget may not reach the end of the grid
    if t <= 16:  # gate_up split along K first (the last field), then one program per tile
        pairs = list(itertools.product([PAIR_MAJOR], [4, 8, 16], [256], [2, 4], [3], [2, 4]))
        pairs += itertools.product([PAIR_MAJOR], [4, 8, 16, 32], [256, 512, 2048], [2, 4], [1, 3])
    if t <= 64:
        grid = itertools.product([16], [16, 32, 64], [64, 128, 256], [4, 8], [2, 3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128], [64, 128], [4, 8], [3])
    return [MoeTileConfig(*c) for c in [*pairs, *grid]]


def sweep_fused(fmt: str, layers: list[dict], t: int, budget_s: float) -> list[dict]:
    """Per-layer time of each tile configuration at t tokens, fastest first."""
    from libkk.kernels.moe import default_tile_config, fused_moe_w4a16

    inputs = [routing(t, seed=100 * t + i) for i in range(COPIES)]
    default = default_tile_config(t)
    results = []
    deadline = time.monotonic() + budget_s
    for cfg in [default, *[c for c in sweep_configs(t) if c != default]]:
        if time.monotonic() > deadline:
            break

        def run_all(cfg=cfg):
            for layer, (x, w, ids) in zip(layers, inputs, strict=True):
                fused_moe_w4a16(x, *layer_args(layer), w, ids, fmt, cfg)

        try:
            run_all()  # compile
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
            per_layer = time_cuda(graph.replay, iters=20 if t <= 256 else 5) / COPIES
        except Exception as e:  # a tile the compiler or the device refuses (shared memory)
            results.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:80]}"})
            continue
        results.append({"config": cfg, "time_us": per_layer * 1e6, "default": cfg == default})
    return sorted(results, key=lambda r: r.get("time_us", float("inf")))


def bench_bf16(t: int, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    from libkk.layers.moe import fused_moe_ref

    x, weights, ids = routing(t, seed=7 * t)
    per = time_cuda(lambda: fused_moe_ref(x, w13, w2, weights, ids), iters=5 if t <= 256 else 2)
    return {"time_us": per * 1e6}


def bench_csf(fmt: str, layer: dict[str, torch.Tensor]) -> dict:
    from libkk.kernels.csf import csf_expand

    from libkk.quant.csf import csf_size_report, encode_csf

    out = {}
    total = 0.0
    for key in ("s13", "s2"):
        scales = layer[key]
        t = encode_csf(scales.cpu(), fmt)
        raw, packed = csf_size_report(t)
        args = [x.to(DEV) for x in (t.base, t.offsets, t.records, t.record_offsets)]
        buf = torch.empty_like(scales)
        csf_expand(fmt, *args, buf)
        assert torch.equal(buf, scales), f"CSF expansion of {key} is not bit-exact"
        # Device time, as csf_prefetch runs it (in the decode graph): an eager call's host
        # side (the op's checks and launches, ~80 µs) would hide the kernels.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                csf_expand(fmt, *args, buf)
        sec = time_cuda(graph.replay, iters=20) / 10
        out[key] = {"raw_bytes": raw, "csf_bytes": packed, "exceptions": t.num_exceptions,
                    "expand_us": sec * 1e6}  # fmt: skip
        total += sec
    out["expand_us"] = total * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="moe_bench.json")
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--sweep", action="store_true", help="time tile configurations")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds after which no new measurement starts")  # fmt: skip
    opts = parser.parse_args()
    global _deadline_s
    _deadline_s = opts.budget
    tokens = [int(x) for x in opts.tokens.split(",")]
    if opts.sweep:
        sweep(opts.formats.split(",")[0], tokens, opts.json)
        return
    results: dict = {"device": torch.cuda.get_device_name(), "shape": {
        "experts": E, "top_k": TOP_K, "hidden": HIDDEN, "moe_intermediate": INTER}}  # fmt: skip
    errors: list[str] = []

    def save() -> None:
        results["errors"] = errors
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1, default=str)

    floors = {"copy_bw": copy_bandwidth(), "matmul_flops": matmul_rate()}
    results["floors"] = floors
    print(f"copy bandwidth {floors['copy_bw'] / 1e9:.0f} GB/s, "
          f"bf16 matmul {floors['matmul_flops'] / 1e12:.0f} TFLOP/s")  # fmt: skip

    # bf16 plain path (one copy: 1.2 GB, far above L2 at every token count)
    results["bf16"] = {}
    try:
        g = torch.Generator(device=DEV).manual_seed(0)
        w13 = (torch.randn(E, 2 * INTER, HIDDEN, generator=g, device=DEV) * 0.02).bfloat16()
        w2 = (torch.randn(E, HIDDEN, INTER, generator=g, device=DEV) * 0.02).bfloat16()
        for t in tokens:
            if _left() < 0.6 * _deadline_s:  # most of the budget is for the 4-bit paths
                errors.append(f"bf16 t={t}: skipped (time)")
                continue
            results["bf16"][t] = bench_bf16(t, w13, w2)
        del w13, w2
    except Exception:
        errors.append("bf16: " + traceback.format_exc(limit=3))
    torch.cuda.empty_cache()
    save()

    for fmt in opts.formats.split(","):
        results[fmt] = {}
        try:
            if _left() < 60:
                errors.append(f"{fmt}: skipped (time)")
                continue
            layers = [quantized_layer(fmt, seed=i) for i in range(COPIES)]
        except Exception:
            errors.append(f"{fmt} setup: " + traceback.format_exc(limit=3))
            continue
        try:
            results[fmt]["csf"] = bench_csf(fmt, layers[0])
        except Exception:
            errors.append(f"{fmt} csf: " + traceback.format_exc(limit=3))
        for t in tokens:
            if _left() < 20:
                errors.append(f"{fmt} t={t}: skipped (time)")
                continue
            try:
                results[fmt][t] = bench_fused(fmt, layers, t, floors)
            except Exception:
                errors.append(f"{fmt} t={t}: " + traceback.format_exc(limit=3))
            save()
        del layers
        torch.cuda.empty_cache()

    print(f"\n{'format':7} {'tokens':>6} {'us':>9} {'floor us':>9} {'GB/s':>7} {'TFLOP/s':>8} "
          f"{'bw%':>5} {'flop%':>6} {'bf16 us':>9} {'vs bf16':>7} {'csf us':>7} {'align':>6} "
          f"{'route':>6}")  # fmt: skip
    for fmt in opts.formats.split(","):
        csf_us = results.get(fmt, {}).get("csf", {}).get("expand_us", float("nan"))
        for t in tokens:
            r = results.get(fmt, {}).get(t)
            if r is None:
                continue
            b = results["bf16"].get(t, {}).get("time_us", float("nan"))
            print(f"{fmt:7} {t:6d} {r['time_us']:9.1f} {r['floor_us']:9.1f} {r['GB_s']:7.0f} "
                  f"{r['TFLOP_s']:8.1f} {100 * r['bandwidth_fraction']:5.0f} "
                  f"{100 * r['compute_fraction']:6.0f} {b:9.1f} {b / r['time_us']:7.2f} "
                  f"{csf_us:7.1f} {r['align_us']:6.1f} {r['routing_us']:6.1f}")  # fmt: skip
    print("\nper kernel, device µs per layer (eager, launch gaps excluded):")
    for fmt in opts.formats.split(","):
        for t in tokens:
            r = results.get(fmt, {}).get(t)
            if r is not None:
                parts = "  ".join(f"{k} {us:.1f}" for k, us in r["kernels_us"].items())
                print(f"{fmt:7} {t:6d}  {parts}")
    for fmt in opts.formats.split(","):
        c = results.get(fmt, {}).get("csf")
        if c:
            raw = c["s13"]["raw_bytes"] + c["s2"]["raw_bytes"]
            packed = c["s13"]["csf_bytes"] + c["s2"]["csf_bytes"]
            print(f"{fmt} CSF: {raw / 1e6:.1f} MB scales -> {packed / 1e6:.1f} MB, expansion "
                  f"{c['expand_us']:.1f} us per layer")  # fmt: skip
    for e in errors:
        print("ERROR:", e)
    save()
    print(f"wrote {opts.json}")


def sweep(fmt: str, tokens: list[int], out: str) -> None:
    layers = [quantized_layer(fmt, seed=i) for i in range(COPIES)]
    found = {}
    for i, t in enumerate(tokens):
        budget = _left() / (len(tokens) - i) - 5
        rows = sweep_fused(fmt, layers, t, budget)
        found[t] = [{**r, "config": dataclasses.astuple(r["config"])} for r in rows]
        timed = [r for r in rows if "time_us" in r]
        default = next((r for r in timed if r["default"]), None)
        default_us = f"{default['time_us']:.1f} us" if default else "not timed"
        print(f"\n{fmt}, {t} tokens: {len(timed)} configurations timed, "
              f"{len(rows) - len(timed)} refused; default {default_us}")  # fmt: skip
        for r in timed[:5]:
            print(f"  {r['time_us']:8.1f} us  {dataclasses.astuple(r['config'])}")
        with open(out, "w") as f:
            json.dump({"format": fmt, "sweep": found}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
