"""Alternate one benchmark command between two libkk trees, one fresh process per run.

A change worth a percent or two cannot be told from the run-to-run spread of separate calls (or
separate machines), so both trees run in the same session, interleaved (new, base, base, new,
...), and each run's figure is read from the JSON lines the command prints. The current tree is
whatever `import libkk` finds; the base tree is a plain install of another revision in its own
folder, put first on PYTHONPATH for its runs:

    git archive REV | (mkdir -p /tmp/base-src && tar -x -C /tmp/base-src)
    pip install --no-deps --no-build-isolation --target /tmp/base-site /tmp/base-src
    python benchmarks/ab.py --base-site /tmp/base-site --runs 3 -- \\
        benchmarks/decode.py --shape qwen3-8b --batch 1 --tokens 64 --repeats 5 --no-peer

Each run's figure is the last value of `--metric` (default `libkk_ms`, decode.py's ms per step)
among the JSON objects on its output lines; the table gives every run, then each tree's median
and spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def run_once(command: list[str], base_site: str | None, metric: str) -> tuple[float | None, str]:
    """(the run's metric, where its libkk.kernels comes from) for one process of `command`."""
    env = dict(os.environ)
    if base_site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (base_site, env.get("PYTHONPATH")) if p)
    # -P: as for a script, the working directory is not on the path (its libkk would shadow).
    where = subprocess.run(
        [sys.executable, "-P", "-c", "import libkk.kernels as k; print(k.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    out = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True)
    value = None
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and metric in row:
                value = float(row[metric])
    if out.returncode or value is None:
        sys.stderr.write(out.stdout[-2000:] + out.stderr[-4000:])
    return value, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-site", required=True, help="folder holding the base tree's libkk")
    parser.add_argument("--runs", type=int, default=2, help="runs of each tree")
    parser.add_argument("--metric", default="libkk_ms")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- script and its arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    results: dict[str, list[float]] = {"new": [], "base": []}
    for i in range(args.runs):
        order = ("new", "base") if i % 2 == 0 else ("base", "new")
        for tree in order:
            value, where = run_once(command, args.base_site if tree == "base" else None,
                                    args.metric)  # fmt: skip
            print(f"run {i + 1} {tree:<5} {args.metric} = {value}  ({where})", flush=True)
            if value is not None:
                results[tree].append(value)
    print(f"\n| tree | runs | median {args.metric} | min–max |\n|---|---:|---:|---|")
    for tree, values in results.items():
        if values:
            print(f"| {tree} | {len(values)} | {statistics.median(values):.4g} | "
                  f"{min(values):.4g}–{max(values):.4g} |")  # fmt: skip
    print(json.dumps({"metric": args.metric, **results}))


if __name__ == "__main__":
    main()
