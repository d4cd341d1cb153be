"""The physical floors benchmarks compare with, measured on the device in the same run, and the
CUDA-event timer they are measured with."""

from __future__ import annotations

import torch


def cuda_seconds(fn, calls: int, repeats: int = 1, warmup: int = 1) -> list[float]:
    """Seconds per call of `fn`, one figure per repeat of `calls` back-to-back calls, measured
    with CUDA events after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return times


def graph_seconds(fn, calls: int, repeats: int) -> list[float]:
    """Seconds per call of `fn`: a CUDA graph of `calls` calls (captured after one warm-up call on
    a side stream), one figure per replay, `repeats` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return times


def time_cuda(fn, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call of `fn` over `iters` back-to-back calls (`cuda_seconds`, one repeat)."""
    return cuda_seconds(fn, iters, warmup=warmup)[0]


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


def upload_bandwidth(device: str = "cuda") -> float:
    """Bytes/s of a page-locked host-to-device copy, 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=device)
    return src.numel() / time_cuda(lambda: dst.copy_(src, non_blocking=True), 5)
