"""How the layers call a libkk op (`kernels/_jit.py`'s KernelOp): its function directly outside
torch.compile's tracing, so an eager forward never reaches torch's dispatcher for it, nor imports
torch._dynamo, which the dispatcher's custom-op path does at its first call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

EAGER_CALLS = """
import sys, torch
from libkk.kernels import rms_norm
from libkk.kernels._jit import KernelOp
device = "cuda" if torch.cuda.is_available() else "cpu"
x, w = torch.randn(3, 64, device=device), torch.ones(64, device=device)
assert isinstance(rms_norm, KernelOp) and torch.ops.libkk.rms_norm.default is not None
with torch.inference_mode():
    out = rms_norm(x, w, 1e-6)
assert "torch._dynamo" not in sys.modules, "an eager op call imported torch._dynamo"
want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
# With autograd recording the registered op runs (a custom op without a backward), and its
# dispatcher path is the one that imports Dynamo.
rms_norm(x.requires_grad_(), w, 1e-6)
assert "torch._dynamo" in sys.modules
print("ok")
"""


def test_an_eager_op_call_skips_the_dispatcher_and_dynamo():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # on CPU the kernels run interpreted
    result = subprocess.run(
        [sys.executable, "-c", EAGER_CALLS], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-4000:]
