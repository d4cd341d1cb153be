"""The physical floors benchmarks compare with, measured on the device in the same run, and the
CUDA-event timer they are measured with."""

from __future__ import annotations

import torch


def time_cuda(fn, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call of `fn` over `iters` back-to-back calls, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(device: str = "cuda") -> float:
    """Bytes/s of a device-to-device copy (read + write counted), 1 GiB buffers."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_cuda(lambda: dst.copy_(src), 10)


def matmul_rate(device: str = "cuda") -> float:
    """bf16 FLOP/s of a large torch matmul."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / time_cuda(lambda: a @ b, 10)
