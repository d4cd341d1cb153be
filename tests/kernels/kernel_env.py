"""Where the kernel tests run: on CUDA, or on the CPU in Triton's interpreter (conftest.py)."""

from __future__ import annotations

import pytest
import torch
from libkk.kernels._jit import INTERPRETED

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# The module mark of every kernel test file.
RUNS_KERNELS = pytest.mark.skipif(
    not (ON_CUDA or INTERPRETED),
    reason="triton was imported before TRITON_INTERPRET=1; test_interpreter_process.py runs these",
)
