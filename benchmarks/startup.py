"""Start-up time: a fresh process to its first generated token, with cold and with warm caches.

Cold: every cache libkk reads starts empty (libkk's own cache dir with the model conversion and the
compiled-graph artifacts, Inductor's and Triton's caches). Warm: a second fresh process reusing
them. Warm, artifacts only: a third process with fresh Inductor and Triton caches, so only libkk's
artifact cache (graphs/compile.py) can save compile time. The peer is transformers loading the
same (converted) folder in a fresh process. Each case runs in its own subprocess and reports wall
time from interpreter start to the first token.

Python's bytecode cache is not part of any case: pip writes it at install, but a read-only
site-packages without it makes every process compile each module it imports (seconds for torch's
compiler stack). All children share one bytecode cache (PYTHONPYCACHEPREFIX), filled by an untimed
cold start before the timed ones; PYTHONDONTWRITEBYTECODE is dropped from their environment, since
with it set nothing would fill that cache.

    python benchmarks/startup.py [--model PATH] [--device auto|cpu|cuda] [--repeats 3] [--out FILE]
        [--warm-repeats 1] [--only-libkk] [--no-compile] [--cudagraph-mode MODE]
        [--capture startup|lazy]

The last line printed is a JSON object of each case's median (`warm_s`, `cold_s`, ...), the
figure `benchmarks/ab.py --metric warm_s` reads to compare two trees' warm starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import COMPILE  # noqa: E402

LIBKK_CHILD = """
import time, sys
t0 = float(sys.argv[1])
import torch
t_torch = time.time()
import libkk
t1 = time.time()
PROMPT = {prompt!r}
with libkk.Session({model!r}, device={device!r}, max_model_len=1024, progress=False,
                   **{settings!r}) as s:
    t2 = time.time()
    s.generate(PROMPT, libkk.SamplingParams(max_tokens=1, temperature=0.0))
    elapsed = time.time() - t0
    phases = ", ".join(f"{{name}} {{sec:.1f}} s" for name, sec in s.startup_seconds.items())
    print(f"artifact cache {{s.engine.runner.compile_cache}}; import torch {{t_torch - t0:.1f}} s, "
          f"libkk {{t1 - t_torch:.1f}} s, Session "
          f"{{t2 - t1:.1f}} s ({{phases}}), first token {{time.time() - t2:.2f}} s")
    if {explain!r}:
        print(torch._dynamo.utils.compile_times(repr="str").replace(chr(10), " | ")[:2000])
print(elapsed)
"""

HF_CHILD = """
import time, sys
t0 = float(sys.argv[1])
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
device = {device!r} if {device!r} != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tok = AutoTokenizer.from_pretrained({model!r})
model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=dtype).to(device).eval()
PROMPT = {prompt!r}
ids = tok(PROMPT, return_tensors="pt").input_ids if isinstance(PROMPT, str) else torch.tensor([PROMPT])
with torch.inference_mode():
    model.generate(ids.to(device), max_new_tokens=1, do_sample=False)
print(time.time() - t0)
"""


def run_child(code: str, env: dict[str, str]) -> float:
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-c", code, repr(start)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # import the installed libkk, not a source tree in the cwd
    )
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    if len(lines) > 1:
        print("   ", *lines[:-1])
    return float(lines[-1])


PYCACHE = Path(tempfile.mkdtemp(prefix="libkk-pycache-"))


def bytecode_cached_env(**extra: str) -> dict[str, str]:
    """The environment with the shared bytecode cache on."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(PYCACHE), **extra}


def cache_env(root: Path) -> dict[str, str]:
    return {
        **bytecode_cached_env(),
        "LIBKK_CACHE_DIR": str(root / "libkk"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "HF_HUB_OFFLINE": "1",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the default model)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="startup.json")
    ap.add_argument("--explain", action="store_true", help="print torch.compile's phase times")
    ap.add_argument("--warm-repeats", type=int, default=1, help="warm starts after each cold one")
    ap.add_argument(
        "--only-libkk",
        action="store_true",
        help="cold and warm starts only (no artifacts-only case, no transformers)",
    )
    ap.add_argument(
        "--compile",
        choices=sorted(COMPILE),
        default="auto",
        help="torch_compile: auto (libkk's choice for the family), on or off",
    )
    ap.add_argument(
        "--cudagraph-mode", default=None, help="libkk's cudagraph_mode (default: its own)"
    )
    ap.add_argument(
        "--capture",
        choices=["startup", "lazy"],
        default=None,
        help="libkk's cudagraph_capture (default: its own)",
    )
    args = ap.parse_args()

    from libkk.models.default import default_model_path

    # transformers needs a folder; for the default model that is libkk's converted one.
    hf_model = args.model if args.model else str(default_model_path(progress=False))
    # Token ids for a checkpoint given by path (random-weight benchmark folders have a word-level
    # tokenizer that knows no English); text for the default model.
    prompt = list(range(10, 42)) if args.model else "The capital of France is"
    results: dict[str, list[float]] = {
        "libkk cold": [],
        "libkk warm": [],
        "libkk warm, artifacts only": [],
        "transformers": [],
    }

    def record(name: str, code: str, env: dict[str, str]) -> None:
        results[name].append(run_child(code, env))
        print(f"  {name}: {results[name][-1]:.2f} s", flush=True)

    libkk_code = LIBKK_CHILD.format(
        model=args.model,
        device=args.device,
        prompt=prompt,
        explain=args.explain,
        settings={"torch_compile": COMPILE[args.compile]}
        | ({"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else {})
        | ({"cudagraph_capture": args.capture} if args.capture else {}),
    )
    hf_code = HF_CHILD.format(model=hf_model, device=args.device, prompt=prompt)
    hf_env = bytecode_cached_env(HF_HUB_OFFLINE="1")
    if args.only_libkk:
        del results["libkk warm, artifacts only"], results["transformers"]
    with tempfile.TemporaryDirectory() as tmp:  # untimed: fills the bytecode cache
        run_child(libkk_code, cache_env(Path(tmp)))
        if not args.only_libkk:
            run_child(hf_code, hf_env)
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            env = cache_env(Path(tmp))
            record("libkk cold", libkk_code, env)
            for _ in range(args.warm_repeats):
                record("libkk warm", libkk_code, env)
            if args.only_libkk:
                continue
            env = cache_env(Path(tmp))
            env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor-fresh")
            env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton-fresh")
            record("libkk warm, artifacts only", libkk_code, env)
        if not args.only_libkk:
            record("transformers", hf_code, hf_env)

    print(
        f"start-up to first token, {args.model or 'default model'}, device {args.device}, "
        f"{args.repeats} repeats"
    )
    print(f"{'case':<28}{'median s':>10}{'min':>8}{'max':>8}")
    for name, times in results.items():
        print(f"{name:<28}{statistics.median(times):>10.2f}{min(times):>8.2f}{max(times):>8.2f}")
    cold, warm = (statistics.median(results[k]) for k in ("libkk cold", "libkk warm"))
    print(f"warm / cold: {warm / cold:.0%}")
    Path(args.out).write_text(json.dumps(results, indent=2))
    keys = {"libkk cold": "cold_s", "libkk warm": "warm_s", "transformers": "transformers_s",
            "libkk warm, artifacts only": "warm_artifacts_only_s"}  # fmt: skip
    print(json.dumps({keys[name]: statistics.median(times) for name, times in results.items()}))


if __name__ == "__main__":
    main()
