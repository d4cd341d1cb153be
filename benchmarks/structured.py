"""What structured output costs a decode step on the GPU: JSON-schema-constrained against
unconstrained requests at the Qwen3-8B shape, in one process, and the time to compile a schema.

The checkpoint is decode.py's random one, with a real byte-level tokenizer (llguidance needs one;
--tokenizer, default: the default model's tokenizer.json, whose ids lie inside the 8B
vocabulary). Every request decodes up to --tokens tokens; a constrained request follows a schema
whose one long string field lets it run that long. The figure is ms per decode step, from the
requests' timelines (first to last token, over tokens - 1), median over repeats; the floor is
decode.py's bytes-per-step over the measured copy bandwidth. The schema compile is timed for a
large schema (about 200 properties, nested objects, enums and arrays) at its first request, and
again for the same schema at a second request.

    python benchmarks/structured.py [--batch 1 32] [--tokens 64] [--repeats 5] [--tokenizer FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from decode import COMMON, SHAPES, checkpoint_dir, prompts, step_bytes, write_checkpoint
from floors import copy_bandwidth

# A constrained answer that may run long: one free string.
LONG_ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 4000}},
    "required": ["answer"],
}


def large_schema(width: int = 200) -> dict:
    """A wide schema with nesting, enums and arrays: its compile is what a first request pays."""
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "kind": {"enum": ["a", "b", "c", "d"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        },
        "required": ["id", "kind"],
    }
    props = {f"field_{i}": item if i % 3 == 0 else {"type": "string"} for i in range(width)}
    return {"type": "object", "properties": props, "required": list(props)[:20]}


def bench(session, batch: int, tokens: int, repeats: int, structured: dict | None) -> list[float]:
    from libkk import SamplingParams

    params = SamplingParams(
        max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=structured is None,
        structured=None if structured is None else {"json_schema": structured},
    )  # fmt: skip
    vocab = min(session.tokenizer.vocab_size, session.engine.arch.vocab_size)
    session.generate(prompts(batch, 32, vocab), params)  # warm up
    per_step = []
    for r in range(repeats):
        outs = session.generate(prompts(batch, 32, vocab, seed=1 + r), params)
        lines = [o.timeline for o in outs if o.timeline.num_output_tokens > 1]
        steps = max(t.num_output_tokens for t in lines) - 1
        per_step.append(max(t.last_token for t in lines) - min(t.first_token for t in lines))
        per_step[-1] /= steps
    return [t * 1e3 for t in per_step]


def compile_seconds(session) -> tuple[float, float]:
    """(first request's schema compile, the same schema again): time to admit a request."""
    from libkk import SamplingParams

    params = SamplingParams(max_tokens=1, structured={"json_schema": large_schema()})
    times = []
    for _ in range(2):
        start = time.perf_counter()
        rid = session.submit([5, 6, 7], params)
        times.append(time.perf_counter() - start)
        session.abort(rid)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", default=None, help="a byte-level tokenizer.json")
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument(
        "--max-length",
        type=int,
        default=4000,
        help="the answer string's maxLength (0: none; a bound makes each mask in the string "
        "about 2.5x costlier on the host, benchmarks/grammar_masks.py)",
    )
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    from libkk import Session

    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    if tokenizer is None:
        from libkk.models.default import default_model_path

        tokenizer = default_model_path(progress=False) / "tokenizer.json"
    path = checkpoint_dir(Path(args.dir), args.shape)
    write_checkpoint(args.shape, path, device)
    bpe = Path(args.dir) / f"{args.shape}-bpe"
    if not (bpe / "config.json").exists():
        bpe.mkdir(parents=True, exist_ok=True)
        for f in path.iterdir():
            if f.name not in ("tokenizer.json", "tokenizer_config.json", "config.json"):
                (bpe / f.name).unlink(missing_ok=True)
                (bpe / f.name).symlink_to(f)
        shutil.copy(tokenizer, bpe / "tokenizer.json")
        (bpe / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
        shutil.copy(path / "config.json", bpe / "config.json")
    cfg = {**COMMON, **SHAPES[args.shape]}
    answer = {"type": "string", **({"maxLength": args.max_length} if args.max_length else {})}
    schema = {**LONG_ANSWER, "properties": {"answer": answer}}
    bandwidth = copy_bandwidth(device) if device == "cuda" else float("nan")
    rows = []
    for batch in args.batch:
        with Session(str(bpe), device=device, max_num_seqs=batch, max_model_len=512,
                     progress=False) as s:  # fmt: skip
            if batch == args.batch[0]:
                first, again = compile_seconds(s)
                print(
                    f"large schema: first request {first * 1e3:.1f} ms, again {again * 1e3:.1f} ms"
                )
            plain = bench(s, batch, args.tokens, args.repeats, None)
            constrained = bench(s, batch, args.tokens, args.repeats, schema)
            floor = step_bytes(cfg, s.engine.weights_bytes, "bf16", batch, 32 + args.tokens // 2)
        row = {
            "batch": batch,
            "plain_ms": statistics.median(plain),
            "plain_spread": [min(plain), max(plain)],
            "constrained_ms": statistics.median(constrained),
            "constrained_spread": [min(constrained), max(constrained)],
            "floor_ms": floor / bandwidth * 1e3,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\n{args.shape} shape, {name}, copy {bandwidth / 1e12:.2f} TB/s")
    print(f"{'batch':>6}{'plain ms':>10}{'JSON ms':>10}{'JSON/plain':>12}{'floor ms':>10}")
    for r in rows:
        ratio = r["constrained_ms"] / r["plain_ms"]
        print(
            f"{r['batch']:>6}{r['plain_ms']:>10.2f}{r['constrained_ms']:>10.2f}{ratio:>12.3f}"
            f"{r['floor_ms']:>10.2f}"
        )


if __name__ == "__main__":
    main()
