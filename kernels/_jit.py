"""Launch helpers shared by the Triton ops.

Triton decides between compiling a function and interpreting it (`TRITON_INTERPRET=1`, numpy on
the CPU) when the function is decorated, and its own library (`tl.sum`, `tl.zeros`, ...) was
decorated when `triton.language` was first imported. `jit` follows that first choice, so our
kernels and Triton's helpers never mix modes even if the variable changed in between. On CPU the
ops therefore run only when the variable was set before anything imported triton.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

INTERPRETED: bool = not isinstance(tl.zeros, JITFunction)


def jit(fn: Callable[..., Any]) -> Any:
    if INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return JITFunction(fn)


def check_device(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "libkk.kernels ops need CUDA tensors; on CPU they run only under Triton's "
            "interpreter, with TRITON_INTERPRET=1 set before triton is first imported"
        )


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_parallelism(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a fixed small number elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 16
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)
