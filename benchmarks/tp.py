"""Tensor parallelism on GPUs: decode and prefill at TP=1 vs TP=2 (or any sizes) at real shapes.

Random bf16 checkpoints are written by benchmarks/decode.py's writer (the real loader runs, each
rank reading only its slices). Per (shape, TP) case, in a fresh process with a time limit:

- decode: batch 1 and 32, prompts of --prompt tokens, --tokens greedy tokens (EOS ignored); ms per
  step from the requests' timelines (after the first token);
- prefill: one --prefill-len-token prompt, time to first token (prefix caching off);
- floors, measured on rank 0's GPU before the session starts: a decode step reads its rank's
  share of the bytes `decode.step_bytes` counts (÷ copy bandwidth), a prefill multiplies its
  share of the linear layers' weights by every token (÷ bf16 matmul rate). The table gives the
  share of the floor each figure reaches.

The 30B-A3B shape runs with --moe-layers layers (48 in the real model) so that writing and
loading it fits the run. Results are written to --out after every case, so a run cut short keeps
what it measured; a case that fails or runs out of time is recorded with its error.

`--drafting` adds, per TP, decode with DFlash speculation (a random one-layer drafter at the
shape, K = 7) with full-vocabulary drafting and, at TP > 1, with `vocab_parallel_drafting`: the
difference in ms per step is what the vocab-parallel greedy drafts save (random weights accept
almost nothing, so both runs do the same work apart from the drafter's logits).
`--draft-temperature T` (> 0) makes those cases sample instead: seeded requests at temperature T
with probabilistic drafts, so the vocab-parallel case drafts and verifies sampled drafts from
vocab shards (the full-vocab case gathers whole rows for both).

    python benchmarks/tp.py [--tp 1 2] [--shapes qwen3-8b qwen3-30b-a3b] [--budget-s 540]
    python benchmarks/tp.py --shapes qwen3-8b --tp 2 --batch 32 --drafting
    python benchmarks/tp.py --shapes qwen3-8b --tp 2 --batch 32 --drafting --draft-temperature 1
    python benchmarks/tp.py --shapes qwen3-30b-a3b --experts nvfp4 --tp 1 2
    python benchmarks/tp.py --shapes qwen3-8b --tp 2 --profile    (rank 0's kernels and host ops)
    python benchmarks/tp.py --shapes qwen3-8b --tp 1 2 --compile --scheduling async
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402  (benchmarks/decode.py: shapes and the checkpoint writer)
import profiling  # noqa: E402
from floors import copy_bandwidth, matmul_rate  # noqa: E402


def _shape_name(shape: str, moe_layers: int) -> str:
    """The decode.SHAPES entry to write: the 30B-A3B shape cut to `moe_layers` layers."""
    if shape != "qwen3-30b-a3b" or moe_layers >= decode.SHAPES[shape]["num_hidden_layers"]:
        return shape
    name = f"{shape}-{moe_layers}l"
    decode.SHAPES[name] = {**decode.SHAPES[shape], "num_hidden_layers": moe_layers}
    return name


def _folder(name: str, experts: str) -> str:
    """The checkpoint folder of a shape: MoE shapes with 4-bit experts get their own."""
    return (
        name
        if experts == "bf16" or "num_experts" not in decode.SHAPES[name]
        else f"{name}-{experts}"
    )


def run_case(args: argparse.Namespace) -> dict:
    """One (shape, TP) case in this process: start a Session, measure decode and prefill."""
    from libkk import SamplingParams, Session

    path = Path(args.dir) / args.case_shape
    batches = args.batch
    floors = _floors(path, args) if torch.cuda.is_available() else None  # before the KV cache
    speculative = {}
    if args.case_drafting != "none":
        speculative = {
            "method": "dflash",
            "draft_model": str(Path(args.dir) / f"{args.case_shape}-dflash"),
            "num_speculative_tokens": 7,
            "vocab_parallel_drafting": args.case_drafting == "vocab-parallel",
            "draft_sampling": "probabilistic" if args.draft_temperature > 0 else "greedy",
        }
    started = time.perf_counter()
    with Session(
        str(path),
        dtype="bfloat16",
        tensor_parallel_size=args.case_tp,
        max_model_len=max(args.prefill_len, args.prompt + args.tokens) + 16,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(4096, args.prefill_len),
        enable_prefix_caching=False,
        torch_compile=args.compile,
        async_scheduling=decode.SCHEDULING[args.scheduling],
        worker_timeout_s=120.0,
        progress=False,
        speculative=speculative,
    ) as s:
        start_s = time.perf_counter() - started
        vocab = s.engine.arch.vocab_size
        s.generate(decode.prompts(2, 16, vocab), SamplingParams(max_tokens=4, ignore_eos=True))
        params = SamplingParams(
            max_tokens=args.tokens + 1,
            temperature=args.draft_temperature if speculative else 0.0,
            seed=0,
            ignore_eos=True,
        )
        result: dict = {"start_s": start_s, "decode": {}, "weights_bytes_rank0": 0}
        result["weights_bytes_rank0"] = s.engine.weights_bytes
        if floors is not None:
            result["floors"] = floors
        for batch in batches:
            ids = decode.prompts(batch, args.prompt, vocab, seed=batch)
            steps = []
            for _ in range(args.repeats):
                outs = s.generate(ids, params)
                steps.append(max(o.timeline.decode_time for o in outs) / args.tokens * 1e3)
            result["decode"][str(batch)] = {
                "floor_ms": floors["decode_ms"][str(batch)] if floors else None,
                "ms_per_step": statistics.median(steps),
                "spread": [min(steps), max(steps)],
                "tok_per_s": batch * 1e3 / statistics.median(steps),
            }
            print(f"  batch {batch}: {statistics.median(steps):.2f} ms/step", flush=True)
        if speculative:  # decode only
            return result
        ttft = []
        for i in range(args.repeats):
            ids = decode.prompts(1, args.prefill_len, vocab, seed=1000 + i)
            out = s.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))[0]
            ttft.append(out.timeline.time_to_first_token * 1e3)
        result["prefill"] = {
            "floor_ms": floors["prefill_ms"] if floors else None,
            "tokens": args.prefill_len,
            "ttft_ms": statistics.median(ttft),
            "spread": [min(ttft), max(ttft)],
            "tok_per_s": args.prefill_len * 1e3 / statistics.median(ttft),
        }
        print(f"  prefill {args.prefill_len}: {statistics.median(ttft):.1f} ms", flush=True)
        if args.profile:
            profiling.profile_prefill(s, decode.prompts(1, args.prefill_len, vocab, seed=999))
            profiling.profile_steps(s, decode.prompts(1, args.prompt, vocab), args.tokens)
    return result


def _linear_params(cfg: dict) -> int:
    """Weights one token multiplies through (attention, then the MLP or its top-k experts and
    the router), over every layer of the whole model."""
    h, heads, kv, hd = (cfg["hidden_size"], cfg["num_attention_heads"],
                        cfg["num_key_value_heads"], cfg["head_dim"])  # fmt: skip
    attention = h * hd * (heads + 2 * kv) + heads * hd * h
    if "num_experts" in cfg:
        mlp = 3 * h * cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"]
        mlp += h * cfg["num_experts"]
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    return cfg["num_hidden_layers"] * (attention + mlp)


def _floors(path: Path, args: argparse.Namespace) -> dict:
    """A rank's floors, measured on its GPU: a decode step per batch reads its share of the bytes
    `decode.step_bytes` counts (÷ copy bandwidth); the prefill multiplies its share of the linear
    layers' weights by every prompt token (÷ bf16 matmul rate; attention's FLOPs left out)."""
    cfg = json.loads((path / "config.json").read_text())
    tp = args.case_tp
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    torch.cuda.empty_cache()
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    context = args.prompt + args.tokens // 2
    decode_ms = {
        str(b): decode.step_bytes(cfg, weights, args.experts, b, context) / tp / bandwidth * 1e3
        for b in args.batch
    }
    prefill_ms = 2 * args.prefill_len * _linear_params(cfg) / tp / rate * 1e3
    return {"copy_GBps": bandwidth / 1e9, "matmul_TFLOPs": rate / 1e12,
            "decode_ms": decode_ms, "prefill_ms": prefill_ms}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--moe-layers", type=int, default=8, help="layers of the 30B-A3B shape")
    ap.add_argument("--experts", choices=["bf16", "nvfp4", "mxfp4"], default="bf16",
                    help="MoE shapes: experts written pre-quantized (kept packed at every TP)")  # fmt: skip
    ap.add_argument("--compile", action="store_true", help="torch.compile (slow cold start)")
    ap.add_argument("--profile", action="store_true", help="rank 0's prefill and decode profile")
    ap.add_argument("--scheduling", choices=sorted(decode.SCHEDULING), default="auto",
                    help="libkk's async_scheduling (auto: asynchronous unless drafting)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting cases after")
    ap.add_argument("--case-timeout-s", type=float, default=300.0)
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    ap.add_argument("--out", default="tp.json")
    ap.add_argument("--drafting", action="store_true", help="DFlash drafting cases (see above)")
    ap.add_argument(
        "--draft-temperature",
        type=float,
        default=0.0,
        help="drafting cases: sample at this temperature with probabilistic drafts (0: greedy)",
    )
    # internal: run one case in this process and print its JSON on the last line
    ap.add_argument("--case-shape", help=argparse.SUPPRESS)
    ap.add_argument("--case-tp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--case-drafting", default="none", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.case_shape:
        print("RESULT " + json.dumps(run_case(args)), flush=True)
        return

    t0 = time.monotonic()
    gpus = torch.cuda.device_count()
    report: dict = {
        "gpu": torch.cuda.get_device_name() if gpus else None,
        "gpus": gpus,
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("case_")},
        "cases": [],
    }
    out = Path(args.out)
    for shape in args.shapes:
        name = _shape_name(shape, args.moe_layers)
        start = time.monotonic()
        folder = _folder(name, args.experts)
        decode.write_checkpoint(name, Path(args.dir) / folder, "cuda" if gpus else "cpu",
                                args.experts if folder != name else "bf16")  # fmt: skip
        if args.drafting:
            _write_drafter(name, Path(args.dir) / f"{folder}-dflash")
        print(f"{folder}: checkpoint ready in {time.monotonic() - start:.0f} s", flush=True)
        for tp in args.tp:
            draftings = ["none"]
            if args.drafting:
                draftings = ["full-vocab"] + (["vocab-parallel"] if tp > 1 else [])
            for drafting in draftings:
                case = {"shape": folder, "tp": tp, "drafting": drafting}
                left = args.budget_s - (time.monotonic() - t0)
                if gpus and tp > gpus:  # (no GPU at all: a CPU trial run, gloo workers)
                    case["error"] = f"needs {tp} GPUs, {gpus} visible"
                elif left < 30:
                    case["error"] = "not run: time budget spent"
                else:
                    timeout = min(args.case_timeout_s, left)
                    case |= _run_subprocess(args, folder, tp, drafting, timeout)
                report["cases"].append(case)
                out.write_text(json.dumps(report, indent=2))
                print(json.dumps(case), flush=True)
    _print_table(report)


def _write_drafter(shape: str, path: Path) -> None:
    """A random one-layer DFlash drafter for `shape` (K = 7) at `path`, beside its checkpoint."""
    from libkk.spec_decode.dflash_model import DFlashConfig, default_target_layer_ids, save_drafter
    from libkk.spec_decode.training.distill import init_drafter

    if path.exists():
        return
    cfg = {**decode.COMMON, **decode.SHAPES[shape]}
    layers = cfg["num_hidden_layers"]
    config = DFlashConfig(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
        num_layers=1,
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        vocab_size=cfg["vocab_size"],
        target_layer_ids=default_target_layer_ids(layers, min(3, layers)),
        mask_token_id=cfg["vocab_size"] - 1,
        block_size=8,
    )
    save_drafter(init_drafter(config, seed=0), path, dtype=torch.bfloat16)


def _run_subprocess(
    args: argparse.Namespace, shape: str, tp: int, drafting: str, timeout: float
) -> dict:
    cmd = [sys.executable, __file__, "--case-shape", shape, "--case-tp", str(tp)]
    cmd += ["--case-drafting", drafting]
    for flag in (
        "prompt",
        "tokens",
        "prefill_len",
        "repeats",
        "moe_layers",
        "draft_temperature",
        "experts",
    ):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += ["--batch", *map(str, args.batch), "--dir", args.dir]
    cmd += ["--compile"] * args.compile + ["--profile"] * args.profile
    cmd += ["--scheduling", args.scheduling]
    print(f"{shape} TP={tp}: {' '.join(cmd[1:])}", flush=True)
    # A new session: a hung case is killed with its tensor-parallel workers.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in stdout.splitlines():
        if not line.startswith("RESULT "):
            print("  " + line, flush=True)
    results = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        return {"error": f"exit code {proc.returncode}"}
    return json.loads(results[-1].removeprefix("RESULT "))


def _print_table(report: dict) -> None:
    """ms per step (and per prefill) with the share of the rank's floor it reaches."""
    print(f"\ntensor parallelism, {report['gpu']} x{report['gpus']}")
    batches = report["settings"]["batch"]
    head = "".join(f"{f'b{b} ms':>10}{'floor':>7}{f'b{b} tok/s':>11}" for b in batches)
    print(f"{'shape':<24}{'TP':>3}{'drafting':>16}{head}{'prefill ms':>12}{'floor':>7}")
    for case in report["cases"]:
        row = f"{case['shape']:<24}{case['tp']:>3}{case['drafting']:>16}"
        if "error" in case:
            print(row + f"  {case['error']}")
            continue
        for b in batches:
            d = case["decode"][str(b)]
            row += f"{d['ms_per_step']:>10.2f}{_share(d):>7}{d['tok_per_s']:>11.0f}"
        p = case.get("prefill")
        print(row + (f"{p['ttft_ms']:>12.1f}{_share(p):>7}" if p else ""))


def _share(figures: dict) -> str:
    floor = figures.get("floor_ms")
    ms = figures.get("ms_per_step", figures.get("ttft_ms"))
    return f"{100 * floor / ms:.0f}%" if floor else "-"


if __name__ == "__main__":
    main()
