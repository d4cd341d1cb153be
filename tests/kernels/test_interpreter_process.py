"""Reruns the kernel tests in a fresh process when this one cannot interpret Triton kernels.

That happens on CPU when something imported triton before `tests/kernels/conftest.py` could set
TRITON_INTERPRET=1 (see there); the kernel tests then skip themselves here and run there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from libkk.kernels._jit import INTERPRETED

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(
    torch.cuda.is_available() or INTERPRETED, reason="the kernel tests run in this process"
)
def test_kernel_tests_in_interpreter_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
    cmd += [str(p) for p in sorted(HERE.glob("test_*.py")) if p.name != Path(__file__).name]
    result = subprocess.run(
        cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout
