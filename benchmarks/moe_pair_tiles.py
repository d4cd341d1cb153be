"""The pair-major W4A16 expert kernels one at a time, over a grid of tiles, at decode sizes.

One MoE layer of the Qwen3-30B-A3B shape (128 experts, top-8, hidden 2048, moe_intermediate 768)
with NVFP4 experts: for 1, 2 and 4 tokens, the gate_up kernel and the down kernel each timed
alone for every (rows per program, K step, warps) of a small grid, as CUDA-graph replays of ten
back-to-back launches per layer copy (four copies rotate, so the touched experts are not served
from L2; launched with programmatic dependent launch, as in a decode step). Each kernel's time
is set against its floor: the bytes of the weights and scales its pairs read / the device copy
bandwidth measured in the same run. The pair-major path's config takes a tile for each kernel
(`MoeTileConfig.down_*`), so the best of each column is what `PAIR_DECODE_NARROW` should hold.
A diagnostic kernel ("gate_up bytes") reads what gate_up reads, tile for tile, and only
xor-folds the words: the time of the memory side alone, which the decode and products add to.

    python benchmarks/moe_pair_tiles.py [--tokens 1,2,4] [--json moe_pair_tiles.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton.language as tl
from floors import copy_bandwidth, graph_seconds
from libkk.kernels._jit import jit, pdl_args, wait_for_previous
from libkk.kernels.moe.dequant import _ptx_decode
from libkk.kernels.moe.pairs import _down_gemv_kernel, _gate_up_gemv_kernel
from moe import COPIES, DEV, HIDDEN, INTER, TOP_K, quantized_layer, routing

GATE_UP_TILES = [(4, 1024, 1), (4, 2048, 2), (4, 2048, 4), (8, 512, 4), (8, 1024, 4),
                 (8, 256, 2), (16, 256, 4), (32, 256, 4), (2, 2048, 1)]  # fmt: skip
DOWN_TILES = [(32, 256, 4), (64, 256, 8), (16, 256, 4), (16, 256, 2), (8, 256, 2), (4, 256, 1),
              (32, 128, 4)]  # fmt: skip


@jit
def _gate_up_bytes_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, stride_we, stride_wn, stride_se,
                          stride_sn, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """gate_up's weight words (w_ptr: int32 view, 8 elements a word) and scale bytes for each
    pair and N tile, xor-folded into one word per row."""
    wait_for_previous(PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.arange(0, BLOCK_K // 8)
    groups = tl.arange(0, BLOCK_K // 16)
    w_rows = w_ptr + expert * stride_we + n[:, None] * stride_wn
    s_rows = s_ptr + expert * stride_se + n[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_rows + (k0 // 8 + words)[None, :])
        w ^= tl.load(w_rows + N * stride_wn + (k0 // 8 + words)[None, :])
        sc = tl.load(s_rows + (k0 // 16 + groups)[None, :]).to(tl.int32)
        sc ^= tl.load(s_rows + N * stride_sn + (k0 // 16 + groups)[None, :]).to(tl.int32)
        acc ^= tl.xor_sum(w, axis=1) ^ tl.xor_sum(sc, axis=1)
    tl.store(out_ptr + pair * N + n, acc.to(tl.float32).to(out_ptr.dtype.element_ty))


def kernel_runner(kernel: str, layers, inputs, tile):
    """One launch per layer copy of `kernel` with `tile` = (block_n, block_k, num_warps)."""
    bn, bk, warps = tile
    launch = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1,
                  **pdl_args(torch.device(DEV)))  # fmt: skip
    opts = dict(GROUP=16, IS_NVFP4=True, USE_PTX=_ptx_decode(bn, bk, warps), **launch)

    def run():
        for layer, (x, w, ids, a, out) in zip(layers, inputs, strict=True):
            if kernel == "gate_up bytes":
                w13, s13 = layer["w13"].view(torch.int32), layer["s13"]
                _gate_up_bytes_kernel[(ids.numel(), INTER // bn)](
                    w13, s13, ids, out, w13.stride(0), w13.stride(1), s13.stride(0),
                    s13.stride(1), N=INTER, K=HIDDEN, **launch,
                )  # fmt: skip
            elif kernel == "gate_up":
                w13, s13, g13 = layer["w13"], layer["s13"], layer["g13"]
                _gate_up_gemv_kernel[(ids.numel(), INTER // bn, 1)](
                    x, w13, s13, g13, ids, a, a, ids, x.stride(0), w13.stride(0),
                    w13.stride(1), s13.stride(0), s13.stride(1), a.stride(0), N=INTER, K=HIDDEN,
                    TOP_K=TOP_K, EVEN_K=HIDDEN % bk == 0, SPLIT_K=1, **opts,
                )  # fmt: skip
            else:
                w2, s2, g2 = layer["w2"], layer["s2"], layer["g2"]
                _down_gemv_kernel[(ids.numel(), HIDDEN // bn)](
                    a, w2, s2, g2, ids, w, out, a.stride(0), w2.stride(0), w2.stride(1),
                    s2.stride(0), s2.stride(1), out.stride(0), N=HIDDEN, K=INTER,
                    EVEN_K=INTER % bk == 0, **opts,
                )  # fmt: skip

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--json", default="moe_pair_tiles.json")
    args = ap.parse_args()
    bandwidth = copy_bandwidth(DEV)
    layers = [quantized_layer("nvfp4", seed=i) for i in range(COPIES)]
    per_pair = {  # bytes of one pair's expert weights and scales, per kernel
        "gate_up": (layers[0]["w13"][0].numel() + layers[0]["s13"][0].numel()),
        "down": (layers[0]["w2"][0].numel() + layers[0]["s2"][0].numel()),
    }
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        inputs = []
        for c in range(COPIES):
            x, w, ids = routing(t, seed=100 * t + c)
            pairs = ids.numel()
            a = torch.randn(pairs, INTER, device=DEV).to(torch.bfloat16)
            out = torch.empty(pairs, HIDDEN, dtype=torch.bfloat16, device=DEV)
            inputs.append((x, w.reshape(-1).contiguous(), ids.reshape(-1).contiguous(), a, out))
        kernels = (
            ("gate_up", GATE_UP_TILES),
            ("down", DOWN_TILES),
            ("gate_up bytes", GATE_UP_TILES),
        )
        for kernel, tiles in kernels:
            first = None
            for tile in tiles:
                run = kernel_runner(kernel, layers, inputs, tile)
                for *_, a, out in inputs:
                    (a if kernel == "gate_up" else out).fill_(float("nan"))
                run()
                error = float("nan")  # the diagnostic kernel computes nothing to compare
                if kernel != "gate_up bytes":  # each tile against the grid's first
                    got = torch.cat(
                        [(a if kernel == "gate_up" else out).float() for *_, a, out in inputs]
                    )
                    first = got if first is None else first
                    error = ((got - first).norm() / first.norm()).item()
                # µs per launch: one launch per layer copy, ten per replay, 7 replays
                times = [1e6 * s / COPIES for s in graph_seconds(run, calls=10, repeats=7)]
                us = statistics.median(times)
                floor_us = t * TOP_K * per_pair[kernel.split()[0]] / bandwidth * 1e6
                rows.append(dict(tokens=t, kernel=kernel, tile=tile, us=us, min=min(times),
                                 max=max(times), floor_us=floor_us, error=error))  # fmt: skip
    print(f"\n{torch.cuda.get_device_name()}, copy {bandwidth / 1e12:.2f} TB/s; NVFP4 pair-major "
          f"kernels, 30B-A3B layer, median of 7 replays (min-max)")  # fmt: skip
    print(f"{'tokens':>6} {'kernel':>14} {'tile (n, k, warps)':>20} {'us':>7} {'min-max':>13} "
          f"{'% floor':>8} {'rel err':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['tokens']:>6} {r['kernel']:>14} {str(r['tile']):>20} {r['us']:>7.2f} "
              f"{r['min']:>6.2f}-{r['max']:<6.2f} {100 * r['floor_us'] / r['us']:>8.0f} "
              f"{r['error']:>8.1e}")  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
