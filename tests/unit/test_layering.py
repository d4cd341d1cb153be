"""Imports run one way: api -> engine -> (cache, runtime) -> spec_decode -> (models, sample) -> layers ->
kernels. A package may import only packages of a lower rank (siblings of one rank stay apart).
Proposers (spec_decode) build on the model classes and on the sampler's keyed noise and processing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANK = {
    "cli": 8,
    "serve": 7.5,
    "api": 7,
    "engine": 6,
    "cache": 5,
    "runtime": 5,
    "graphs": 4,
    "models": 3,
    "sample": 3,
    "spec_decode": 3.5,
    "layers": 2,
    "quant": 1.5,
    "distributed": 1.5,
    "kernels": 1,
    "audio": 0.5,
    "config": 0.1,
    "fsutil": 0.1,
    "errors": 0,
}
# graphs/ and kernels/ live beside libkk/ and install as libkk.graphs and libkk.kernels.
SOURCES = {"libkk": ROOT / "libkk", "graphs": ROOT / "graphs", "kernels": ROOT / "kernels"}


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "libkk":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _files() -> list[tuple[str, Path]]:
    files = []
    for name, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder)
            package = name if name != "libkk" else (rel.parts[0].removesuffix(".py"))
            files.append((package, path))
    return files


def test_every_package_has_a_rank():
    packages = {package for package, _ in _files()} - {"__init__"}
    assert packages <= set(RANK), f"give these a rank: {packages - set(RANK)}"


def test_imports_run_one_way():
    violations = []
    for package, path in _files():
        if package == "__init__":
            continue  # the top-level package re-exports the public names
        for module in _imports(path):
            target = _package_of(module)
            if target is None or target == package:
                continue
            if target == "__init__" or RANK[target] >= RANK[package]:
                violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not violations, "upward or sideways imports:\n" + "\n".join(violations)


def test_importing_libkk_leaves_the_compiler_out():
    """`import libkk` does not import torch._dynamo (~1.4 s): a CPU session never compiles, and a
    CUDA one imports it when it compiles."""
    import subprocess
    import sys

    code = "import sys, libkk; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
