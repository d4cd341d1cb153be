"""Helpers for driving libkk's C library from test host programs: build it (with the README's
command), compile the C and C++ programs, run them in a chosen environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TIMEOUT_S = 180


@dataclass(frozen=True)
class Programs:
    build: Path  # libkk.so and libkk.h
    generate: Path  # examples/c/generate.c
    stream: Path  # examples/c/stream.cpp
    json: Path  # examples/c/json.c
    abi_test: Path  # tests/c_abi/abi_test.c
    dlopen_test: Path  # tests/c_abi/dlopen_test.c
    threads_test: Path  # tests/c_abi/threads_test.c


def host_env(extra: Mapping[str, str] | None = None, *, c_locale: bool = False) -> dict[str, str]:
    """The environment of a host program: offline; with c_locale, the plain C locale and none of
    Python's own encoding switches, so UTF-8 must come from libkk itself."""
    env = dict(os.environ)
    env.pop("LIBKK_PYTHON", None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if c_locale:
        for name in ("LANG", "LANGUAGE", "LC_CTYPE", "PYTHONUTF8", "PYTHONIOENCODING"):
            env.pop(name, None)
        env["LC_ALL"] = "C"
    env.update(extra or {})
    return env


def run(args: list[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("env", host_env())
    return subprocess.run(  # type: ignore[call-overload]
        [str(a) for a in args], capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs
    )


def _compile(args: list[str | Path]) -> None:
    result = run(args)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stderr}"


def build_programs(tmp_path_factory: pytest.TempPathFactory) -> Programs:
    """Builds libkk into a temporary directory and compiles the examples and test programs
    against it (skips when there is no C/C++ compiler)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cc is None or cxx is None:
        pytest.skip("no C/C++ compiler (gcc/g++ or cc/c++) on PATH: the C ABI cannot be built")
    build = tmp_path_factory.mktemp("libkk-c")
    result = run([sys.executable, ROOT / "bindings_c" / "build.py", "--out", build])
    assert result.returncode == 0, f"build failed:\n{result.stdout}\n{result.stderr}"
    link = ["-I", build, "-L", build, "-lkk", f"-Wl,-rpath,{build}"]
    warnings = ["-Wall", "-Wextra", "-Werror"]
    bins = tmp_path_factory.mktemp("bin")
    out = Programs(
        build=build,
        generate=bins / "generate",
        stream=bins / "stream",
        json=bins / "json",
        abi_test=bins / "abi_test",
        dlopen_test=bins / "dlopen_test",
        threads_test=bins / "threads_test",
    )
    c99 = [cc, "-std=c99", *warnings]
    _compile([*c99, ROOT / "examples/c/generate.c", *link, "-o", out.generate])
    _compile([*c99, ROOT / "examples/c/json.c", *link, "-o", out.json])
    _compile(
        [cxx, "-std=c++17", *warnings, ROOT / "examples/c/stream.cpp", *link, "-o", out.stream]
    )
    _compile([*c99, HERE / "abi_test.c", *link, "-lpthread", "-lm", "-o", out.abi_test])
    _compile([*c99, HERE / "threads_test.c", *link, "-lpthread", "-o", out.threads_test])
    # Links neither libkk nor libpython: it dlopens libkk.so with RTLD_LOCAL.
    _compile([*c99, "-I", build, HERE / "dlopen_test.c", "-ldl", "-o", out.dlopen_test])
    return out
