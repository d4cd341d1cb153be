"""Host time to fill one step's grammar masks: one llguidance call per constrained row (what the
engine does), against one call for the whole batch on llguidance's thread pool (`LLExecutor`),
and against the rows split over Python threads (llguidance drops the GIL while it computes).

Rows are matchers of structured.py's LONG_ANSWER schema advanced into its free string (the state
its constrained decode spends its steps in: nearly every token allowed, the costliest mask), of
the same string without its maxLength ("unbounded"), or of a schema with numbers and enums
advanced part way (structural states), each row a few tokens apart. Each repeat times fresh matchers; the figure is the median ms per step, with the spread.
Host work only: it runs the same on a CPU-only machine.

    python benchmarks/grammar_masks.py [--batch 1 8 32] [--repeats 20] [--threads N] [--tokenizer FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from structured import LONG_ANSWER

from libkk.models.default import default_model_path
from libkk.models.tokenizer import Tokenizer
from libkk.sample.grammar import GrammarCompiler, bitmask_words
from libkk.sample.params import StructuredOutput

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "kind", "tags"],
}
# LONG_ANSWER's string has a maxLength (4000), which the lexer counts; "unbounded" is the same
# string without it.
UNBOUNDED = {**LONG_ANSWER, "properties": {"answer": {"type": "string"}}}
FREE = '{"answer": "The lighthouse keeper climbed the stairs every evening at dusk'
CASES = {
    "free string": (LONG_ANSWER, FREE),
    "unbounded": (UNBOUNDED, FREE),
    "structural": (RECORD, '{"id": 12345, "kind": "beta", "tags": ["north", "south"]}'),
}


def rows(grammars, tok, case: str, batch: int) -> list:
    schema, text = CASES[case]
    spec = StructuredOutput(json_schema=schema)
    ids = tok.encode(text, add_special_tokens=False)
    out = []
    for i in range(batch):
        m = grammars.matcher(spec)
        start = 0 if case == "structural" else 5  # past '{"answer": "'
        for t in ids[: start + i % (len(ids) - start)]:
            assert m.consume(t)
        out.append(m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of llguidance's pool and of the Python threads (default: llguidance's "
        "own choice; 4 Python threads)",
    )
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="a byte-level tokenizer.json (default: the default model's)",
    )
    args = ap.parse_args()
    if args.tokenizer is None:
        folder = default_model_path(progress=False)
    else:  # a folder of the tokenizer alone
        folder = Path(tempfile.mkdtemp())
        shutil.copy(args.tokenizer, folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    tok = Tokenizer.from_folder(folder)
    grammars = GrammarCompiler(folder / "tokenizer.json", tok.vocab_size, tok.eos_token_ids)
    import llguidance

    threads = {} if args.threads is None else {"num_threads": args.threads}
    pool = llguidance.LLExecutor(**threads)
    workers = ThreadPoolExecutor(args.threads or 4)
    print(
        f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), vocabulary "
        f"{tok.vocab_size}, {args.threads or 4} Python threads"
    )
    print(
        f"{'case':>12}{'batch':>6}{'one by one ms':>15}{'spread':>15}{'together ms':>13}"
        f"{'spread':>15}{'threads ms':>12}{'spread':>15}"
    )
    for case in CASES:
        for batch in args.batch:
            alone, together, threaded = [], [], []
            for _ in range(args.repeats):
                ms = rows(grammars, tok, case, batch)
                start = time.perf_counter()
                for m in ms:
                    m.next_mask()
                alone.append((time.perf_counter() - start) * 1e3)
                ms = rows(grammars, tok, case, batch)
                start = time.perf_counter()
                pooled_masks(ms, pool)
                together.append((time.perf_counter() - start) * 1e3)
                ms = rows(grammars, tok, case, batch)
                start = time.perf_counter()
                threaded_masks(ms, workers, args.threads or 4)
                threaded.append((time.perf_counter() - start) * 1e3)
            print(
                f"{case:>12}{batch:>6}{statistics.median(alone):>15.3f}"
                f"{f'{min(alone):.3f}-{max(alone):.3f}':>15}{statistics.median(together):>13.3f}"
                f"{f'{min(together):.3f}-{max(together):.3f}':>15}"
                f"{statistics.median(threaded):>12.3f}"
                f"{f'{min(threaded):.3f}-{max(threaded):.3f}':>15}",
                flush=True,
            )


def pooled_masks(matchers: list, pool) -> torch.Tensor:
    """[rows, words] int32: every matcher's next mask in one call on llguidance's threads."""
    words = bitmask_words(matchers[0].vocab_size)
    masks = torch.zeros(len(matchers), words, dtype=torch.int32)
    pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
    pool.unsafe_compute_mask_ptr(pairs, masks.data_ptr(), words * 4, len(matchers))
    return masks


def threaded_masks(matchers: list, workers: ThreadPoolExecutor, num_threads: int) -> None:
    """Every matcher's next mask, the rows split into one contiguous share per thread."""

    def share(part: list) -> None:
        for m in part:
            m.next_mask()

    size = -(-len(matchers) // num_threads)
    parts = [matchers[i : i + size] for i in range(0, len(matchers), size)]
    for future in [workers.submit(share, part) for part in parts]:
        future.result()


if __name__ == "__main__":
    main()
