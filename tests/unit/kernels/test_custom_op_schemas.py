"""The conventions every `libkk::` custom op keeps, read from the registered schemas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import libkk  # noqa: F401 - registers every op (kernels, attention, the quantized MoE layer)


def _libkk_schemas() -> list[torch._C.FunctionSchema]:
    schemas = []
    for name in dir(torch.ops.libkk):
        packet = getattr(torch.ops.libkk, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            schemas.append(packet.default._schema)
    return schemas


def test_ops_are_registered():
    names = {s.name for s in _libkk_schemas()}
    assert {"libkk::store_kv", "libkk::paged_attention", "libkk::qk_norm_rope_store_kv"} <= names


def test_ops_that_write_an_argument_return_nothing():
    """An op that writes into an argument hands its results back through arguments too (one
    convention: a caller sees from the schema alone which buffers an op fills)."""
    both = []
    for schema in _libkk_schemas():
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        if written and schema.returns:
            both.append(f"{schema.name} writes {written} and returns {len(schema.returns)}")
    assert not both, both


# In a fresh process: the checkout's folder is importable as `kernels` (the root on sys.path,
# as under `python -m pytest`), and transformers imports that name to probe for a package.
_IMPORTED_TWICE = """
import importlib, sys
sys.path.insert(0, sys.argv[1])
import torch
import libkk.kernels as lk
assert importlib.import_module("kernels") is lk
assert not [m for m in sys.modules if m.startswith("kernels.")], "kernels/ ran a second time"
T, H, KV, D = 2, 4, 2, 16
q, k, v = torch.randn(T, H * D), torch.randn(T, KV * D), torch.randn(T, KV * D)
one = torch.ones(1)
try:  # the op that crashed once defined twice (CPU tensors: it raises before any kernel)
    lk.qk_norm_rope_store_kv(q, k, v, torch.ones(D), torch.ones(D), torch.randn(64, D),
        torch.arange(T), 1e-6, torch.zeros(2, 4, 16, KV, D), torch.arange(16, 16 + T), one,
        one, torch.empty_like(q))
except RuntimeError as e:
    assert "CUDA tensors" in str(e), e
print("ok")
"""


def test_kernels_folder_under_its_own_name_is_libkk_kernels():
    """Defining the libkk:: ops a second time (the folder run again as `kernels`) left torch's
    dispatcher crashing on the next call of a mutating op; the folder hands out libkk.kernels."""
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled mode
    result = subprocess.run(
        [sys.executable, "-c", _IMPORTED_TWICE, str(root)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        result.returncode,
        result.stdout[-2000:],
        result.stderr[-4000:],
    )
