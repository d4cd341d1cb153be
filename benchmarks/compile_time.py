"""Compile time of the model forward as the runner's graph capture calls it: a first call at
several tokens, then one at a single token (batch-1 decode), each timed to its return.

A 36-layer Qwen3 at tiny widths (tracing cost grows with layers and ops, not widths), on the CPU,
through `graphs.compile.CompiledForward` with a stand-in backend: `eager` times Dynamo's trace,
`aot_eager` adds AOTAutograd's. A one-token call that recompiles shows up as a second long call.
The Inductor code generation that a GPU start adds (or loads from the artifact cache) is not
included; benchmarks/startup.py measures the whole start on the GPU.

`piecewise` is what the PIECEWISE graph modes compile: the graph split at attention, each piece
compiled by Inductor (for the CPU here), with the pieces' compile time printed apart. That mode
has no precompiled forward in the artifact cache, so every start traces and compiles again; the
Inductor cache starts empty in each run of this script, and a backend named twice runs its second
time on the first's cache entries, as a warm start does.

    python benchmarks/compile_time.py [--backends eager aot_eager piecewise piecewise]
        [--layers 36]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_host_overhead import write_tiny_qwen3  # noqa: E402


def first_calls(path: Path, backend: str, sizes: list[int]) -> tuple[list[float], float | None]:
    """(seconds of the compiled forward's first call at each size, in order; of those, the
    seconds piecewise compiled its pieces in, or None for other backends)."""
    from libkk.graphs import piecewise
    from libkk.graphs.capture import DecodeGraphs
    from libkk.graphs.compile import CompiledForward

    from libkk import Session
    from libkk.layers.forward_context import set_forward_context

    with Session(str(path), device="cpu", dtype="float32", max_model_len=128, progress=False) as s:
        torch._dynamo.reset()
        pieces = None
        if backend == "piecewise":
            pieces = [0.0]

            def compile_piece(gm, example_inputs):
                start = time.perf_counter()
                compiled = piecewise._inductor(gm, example_inputs)
                pieces[0] += time.perf_counter() - start
                return compiled

            backend = piecewise.PiecewiseBackend(sizes, compile_piece)
        forward = CompiledForward(s.engine.model, backend=backend, precompile=False)
        graphs = DecodeGraphs(forward, model=s.engine.model, capture_sizes=sizes, max_blocks_per_seq=4,
                              block_size=s.engine.config.cache.block_size,
                              device=torch.device("cpu"))  # fmt: skip
        seconds = []
        with torch.inference_mode():
            for size in sizes:  # the static inputs and metadata a capture uses
                start = time.perf_counter()
                with set_forward_context(graphs._metadata(1, size), s.engine.model):
                    forward(graphs.input_ids[:size], graphs.positions[:size])
                seconds.append(time.perf_counter() - start)
    return seconds, None if pieces is None else pieces[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--backends", nargs="+", default=["eager", "aot_eager"],
        choices=["eager", "aot_eager", "piecewise"],
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "libkk-compile-time"))
    args = ap.parse_args()
    path = write_tiny_qwen3(Path(args.dir) / f"qwen3-{args.layers}l", args.layers)
    inductor_cache = tempfile.mkdtemp(prefix="inductor-", dir=args.dir)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache  # read when Inductor first caches
    print(
        f"{'backend':<12}"
        + "".join(f"{f'{n} tokens s':>14}" for n in args.sizes)
        + f"{'pieces s':>11}"
    )
    for backend in args.backends:
        seconds, pieces = first_calls(path, backend, args.sizes)
        print(
            f"{backend:<12}"
            + "".join(f"{s:>14.2f}" for s in seconds)
            + (f"{pieces:>11.2f}" if pieces is not None else f"{'':>11}"),
            flush=True,
        )
    shutil.rmtree(inductor_cache, ignore_errors=True)


if __name__ == "__main__":
    main()
