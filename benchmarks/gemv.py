"""Dense projections of one token and of a few: libkk's GEMV and skinny kernels (`libkk::linear`,
`libkk::gate_up_silu`) vs cuBLAS (F.linear, and F.linear + silu * mul for the MLP) vs the floor
(weight bytes / copy bandwidth).

Shapes are the Qwen3-8B and Qwen3-30B-A3B projections (bf16). Each case is timed as a CUDA graph
of 20 calls that cycle over 4 weight copies, so the weight comes from HBM, not the 60 MB L2; the
graph is replayed `--repeats` times and the median per call is reported with its spread.
`--sweep` also times a grid of block configurations at one token and prints the best next to the
one `gemv_config` picks, the check on its heuristic. `--tokens 2 8 32` times the skinny kernel
against cuBLAS at those token counts instead (the floor adds the tokens' and outputs' bytes);
with `--sweep`, a grid of its configurations against the one `skinny_config` picks.

A table of one 8B decoder layer's four projections as a step runs them (qkv, o, gate_up + silu,
down, over 8 layers' distinct weights in one graph: cuBLAS, libkk, and libkk with the residual
add + RMSNorm kernel before qkv and gate_up) shows what the shapes cost one after another, where
each one's start overlaps the end of a different kernel.

    python benchmarks/gemv.py [--sweep] [--tokens T ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F
from floors import copy_bandwidth, graph_seconds
from libkk.kernels.activation import silu_and_mul
from libkk.kernels.gemv import GemvConfig, SkinnyConfig, gemv, gemv_config, skinny, skinny_config
from libkk.kernels.norm import add_rms_norm

SHAPES = {  # name: (out, in, fused silu)
    "8b qkv": (6144, 4096, False),
    "8b o": (4096, 4096, False),
    "8b gate_up+silu": (24576, 4096, True),
    "8b down": (4096, 12288, False),
    "8b lm_head": (151936, 4096, False),
    "30b qkv": (5120, 2048, False),
    "30b o": (2048, 4096, False),
    "30b router": (128, 2048, False),
}
COPIES = 4
CALLS = 20
# Plain grids up to 16K weights in flight per program per step, and split K from 2 to 8 ways.
SWEEP = [GemvConfig(bn, bk, u, 1, w) for bn, bk, u, w in itertools.product(
    (2, 4, 8, 16), (256, 512), (1, 2, 4), (2, 4)) if bn * bk * u <= 16384] + [
    GemvConfig(bn, 256, 1, sp, w) for bn, sp, w in itertools.product(
        (4, 8, 16, 32), (2, 4, 8), (4, 8))]  # fmt: skip


SKINNY_SWEEP = [SkinnyConfig(bn, bk, sp, w, st) for bn, bk, sp, w, st in itertools.product(
    (64, 128), (64, 128, 256), (1, 2, 4, 8), (4,), (3, 4)) if bn * bk <= 16384]  # fmt: skip


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over want's largest magnitude."""
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def cycling(weights: list[torch.Tensor], call):
    """A graph-capturable call that takes the next weight copy each time (capture unrolls it)."""
    state = {"i": 0}

    def step():
        state["i"] = (state["i"] + 1) % len(weights)
        return call(weights[state["i"]])

    return step


def cublas(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    if not silu:
        return F.linear(x, weight)
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def fastest(configs, silu: bool, check, weights: list[torch.Tensor], launch) -> tuple:
    """(median seconds, config) of the fastest of `configs` (the fused gate/up takes no split),
    each checked against cuBLAS first."""
    best = None
    for cfg in configs:
        if silu and cfg.splits > 1:
            continue
        check(cfg)
        t = statistics.median(
            graph_seconds(cycling(weights, lambda w, c=cfg: launch(w, c)), CALLS, 5)
        )
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def time_shape(name: str, n: int, k: int, silu: bool, args, bandwidth: float) -> dict:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
               for _ in range(COPIES)]  # fmt: skip
    floor_s = n * k * 2 / bandwidth
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    want = cublas(x, weights[0], silu).float()

    def check(cfg: GemvConfig | None) -> None:
        err = relative_error(gemv(x, weights[0], None, silu, cfg), want)
        assert err < 2e-2, f"{name} {cfg}: relative error {err:.3g}"

    check(None)
    peer = statistics.median(graph_seconds(
        cycling(weights, lambda w: cublas(x, w, silu)), CALLS, args.repeats))  # fmt: skip
    ours = graph_seconds(cycling(weights, lambda w: gemv(x, w, None, silu)), CALLS, args.repeats)
    med = statistics.median(ours)
    row = {"shape": name, "mb": n * k * 2 / 1e6, "floor_us": floor_s * 1e6,
           "cublas_us": peer * 1e6, "libkk_us": med * 1e6,
           "libkk_spread_us": [min(ours) * 1e6, max(ours) * 1e6]}  # fmt: skip
    spread = f"{min(ours) * 1e6:.2f}-{max(ours) * 1e6:.2f}"
    print(f"{name:<17}{row['mb']:>8.1f}{row['floor_us']:>10.2f}{row['cublas_us']:>11.2f}"
          f"{row['libkk_us']:>10.2f}{spread:>14}{100 * floor_s / med:>8.0f}%"
          f"{peer / med:>9.2f}x", flush=True)  # fmt: skip
    if args.sweep:
        best = fastest(SWEEP, silu, check, weights, lambda w, cfg: gemv(x, w, None, silu, cfg))
        print(f"  sweep {name}: best {best[0] * 1e6:.2f} µs {tuple(best[1])}, "
              f"gemv_config picks {tuple(gemv_config(n, k, silu))}", flush=True)  # fmt: skip
    return row


def time_tokens(name: str, n: int, k: int, silu: bool, tokens: int, args, bandwidth: float) -> dict:
    """The skinny kernel against libkk's path before it (F.linear, + silu_and_mul for the MLP) at
    `tokens` tokens."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
               for _ in range(COPIES)]  # fmt: skip
    out_cols = n // 2 if silu else n
    floor_s = (n * k + tokens * (k + out_cols)) * 2 / bandwidth
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)

    def before(w):
        return silu_and_mul(F.linear(x, w)) if silu else F.linear(x, w)

    want = before(weights[0]).float()

    def check(cfg: SkinnyConfig | None) -> None:
        err = relative_error(skinny(x, weights[0], None, silu, cfg), want)
        assert err < 2e-2, f"{name} x{tokens} {cfg}: relative error {err:.3g}"

    check(None)
    peer = statistics.median(graph_seconds(cycling(weights, before), CALLS, args.repeats))
    ours = graph_seconds(cycling(weights, lambda w: skinny(x, w, None, silu)), CALLS, args.repeats)
    med = statistics.median(ours)
    row = {"shape": name, "tokens": tokens, "floor_us": floor_s * 1e6, "cublas_us": peer * 1e6,
           "libkk_us": med * 1e6, "libkk_spread_us": [min(ours) * 1e6, max(ours) * 1e6]}  # fmt: skip
    spread = f"{min(ours) * 1e6:.2f}-{max(ours) * 1e6:.2f}"
    print(f"{name:<17}{tokens:>7}{row['floor_us']:>10.2f}{row['cublas_us']:>11.2f}"
          f"{row['libkk_us']:>10.2f}{spread:>14}{100 * floor_s / med:>8.0f}%"
          f"{100 * floor_s / peer:>8.0f}%{peer / med:>9.2f}x", flush=True)  # fmt: skip
    if args.sweep:
        best = fastest(
            SKINNY_SWEEP, silu, check, weights, lambda w, cfg: skinny(x, w, None, silu, cfg)
        )
        print(f"  sweep {name} x{tokens}: best {best[0] * 1e6:.2f} µs {tuple(best[1])}, "
              f"skinny_config picks {tuple(skinny_config(n, k, tokens, silu))}", flush=True)  # fmt: skip
    return row


LAYER = ("8b qkv", "8b o", "8b gate_up+silu", "8b down")
LAYERS = 8


def gemv_product(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    return gemv(x, weight, None, silu)


def time_layers(args, bandwidth: float) -> list[dict]:
    """µs per decoder layer of the four projections in order (`LAYERS` layers' weights, so each
    comes from HBM): cuBLAS, libkk's GEMV, and libkk's GEMV with the norm kernel before qkv and
    gate_up."""
    shapes = [SHAPES[name] for name in LAYER]
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                for n, k, _ in shapes] for _ in range(LAYERS)]  # fmt: skip
    xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k, _ in shapes]
    hidden = SHAPES["8b qkv"][1]  # what the norms normalize: qkv's and gate_up's input
    residual = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    floor_s = sum(n * k * 2 for n, k, _ in shapes) / bandwidth
    rows = []
    for name, product, norms in (("cuBLAS", cublas, False), ("libkk", gemv_product, False),
                                 ("libkk with norms", gemv_product, True)):  # fmt: skip

        def layers(product=product, norms=norms):
            for layer in weights:
                for i, ((_, _, silu), w) in enumerate(zip(shapes, layer, strict=True)):
                    x = xs[i]
                    if norms and LAYER[i] in ("8b qkv", "8b gate_up+silu"):
                        x = add_rms_norm(x, residual, norm_w, 1e-6)[0]
                    product(x, w, silu)

        times = [t / LAYERS for t in graph_seconds(layers, 1, args.repeats)]
        med = statistics.median(times)
        rows.append({"case": name, "layer_us": med * 1e6, "floor_us": floor_s * 1e6,
                     "spread_us": [min(times) * 1e6, max(times) * 1e6]})  # fmt: skip
        print(f"{name:<17}{floor_s * 1e6:>10.2f}"
              f"{med * 1e6:>10.2f}{min(times) * 1e6:>9.2f}-{max(times) * 1e6:<8.2f}"
              f"{100 * floor_s / med:>6.0f}%", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="*", default=[],
                        help="time the skinny kernel at these token counts (2..32) instead")  # fmt: skip
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}, copy {bandwidth / 1e12:.2f} TB/s")
    if args.tokens:
        print(f"{'shape':<17}{'tokens':>7}{'floor µs':>10}{'cuBLAS µs':>11}{'libkk µs':>10}"
              f"{'spread':>14}{'% floor':>9}{'cuBLAS %':>9}{'vs cuBLAS':>10}")  # fmt: skip
        rows = [time_tokens(name, n, k, silu, t, args, bandwidth)
                for t in args.tokens for name, (n, k, silu) in SHAPES.items()]  # fmt: skip
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"bandwidth": bandwidth, "tokens": rows}, f, indent=1)
        return
    print(f"{'shape':<17}{'MB':>8}{'floor µs':>10}{'cuBLAS µs':>11}{'libkk µs':>10}"
          f"{'spread':>14}{'% floor':>9}{'vs cuBLAS':>10}")  # fmt: skip
    rows_out = []
    for name, (n, k, silu) in SHAPES.items():
        rows_out.append(time_shape(name, n, k, silu, args, bandwidth))
        torch.cuda.empty_cache()
    print(f"\n{'8B layer':<17}{'floor µs':>10}{'µs':>10}{'spread':>18}{'% floor':>7}")
    layer_rows = time_layers(args, bandwidth)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows_out, "layers": layer_rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
