"""Launch helpers shared by the Triton ops.

Triton decides between compiling a function and interpreting it (`TRITON_INTERPRET=1`, numpy on
the CPU) when the function is decorated, and its own library (`tl.sum`, `tl.zeros`, ...) was
decorated when `triton.language` was first imported. `jit` follows that first choice, so our
kernels and Triton's helpers never mix modes even if the variable changed in between. On CPU the
ops therefore run only when the variable was set before anything imported triton.

Programmatic dependent launch (Hopper and later): a kernel launched with `pdl_args` may start
while the kernel before it on the stream is still finishing, so its programs are resident when
their inputs land instead of being launched then. Such a kernel must call
`wait_for_previous(PDL)` before it writes global memory or reads anything an earlier kernel may
write (only memory no kernel writes, such as weights, may be read before): the wait returns once
the previous kernel has completed and its writes are visible. A step of one-token decode is a
chain of a few hundred short kernels, each of which would otherwise pay its launch after its
predecessor ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.jit import JITFunction

INTERPRETED: bool = not isinstance(tl.zeros, JITFunction)


class NeedsWarmUp(RuntimeError):
    """Raised by an op under CUDA graph capture when it needs state that only a run outside
    capture can make (a captured fill runs at replay, not before): the capturer runs the forward
    once and captures again (graphs/capture.py)."""


def jit(fn: Callable[..., Any]) -> Any:
    if INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return JITFunction(fn)


class KernelOp:
    """A libkk op as the layers call it. While torch.compile traces (or autograd records) it is
    the registered custom op, which Dynamo keeps opaque; otherwise its function runs directly:
    the dispatcher's round trip costs several µs a call, and the first call of any custom op
    imports torch._dynamo (about a second), which an eager CUDA forward has no other use for
    (benchmarks/op_dispatch.py)."""

    def __init__(self, op: Any, fn: Callable[..., Any]) -> None:
        self.op, self.fn = op, fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            return self.op(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        return self.op.register_fake(fake)


def kernel_op(name: str, *, mutates_args: tuple[str, ...] | str) -> Callable[..., KernelOp]:
    """`torch.library.custom_op(name, mutates_args=...)` for a libkk kernel, called as a
    KernelOp."""

    def register(fn: Callable[..., Any]) -> KernelOp:
        return KernelOp(torch.library.custom_op(name, mutates_args=mutates_args)(fn), fn)

    return register


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


@functools.cache
def _major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch arguments of a kernel that takes a `PDL: tl.constexpr` (see the module's note)."""
    if device.type != "cuda" or INTERPRETED:
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _major(index) < 9:
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel's writes are visible, and let the next kernel's
    programs launch (they wait in turn). The first statement of a kernel launched with pdl_args."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
