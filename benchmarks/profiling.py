"""Where a step's time goes: per-kernel device time per step, the device's idle share, host ops
and Python functions, over the steady decode steps of one batch (prefills excluded), or over
one prefill.

Used by decode.py, spec.py and tp.py (`--profile`). The profiler adds host time of its own, so
its wall figure is not the benchmark's step time; device times are unaffected.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch


def device_timeline(prof, steps: int) -> str:  # noqa: ANN001 - torch.profiler.profile
    """Kernels per step, and how much of the device's span between the first and the last kernel
    it spent idle between kernels (launch gaps and host waits), from the profiler's events."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return "no device events"
    busy, end = 0.0, spans[0][0]
    for lo, hi in spans:  # union of the intervals: overlapping kernels count once
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    span = end - spans[0][0]
    return (
        f"device: {len(spans) / steps:.0f} kernels and copies per step; busy {busy / 1e3 / steps:.2f}"
        f" of {span / 1e3 / steps:.2f} ms per step, idle between them "
        f"{(span - busy) / 1e3 / steps:.2f} ms ({100 * (span - busy) / span:.0f}%)"
    )


# Kernel families by name: the first pattern a kernel's name contains decides its row.
FAMILIES = (
    ("attention", ("_decode_kernel", "_varlen_kernel", "_merge_splits", "_store_kv")),
    ("norms and rotary", ("_rms_norm_kernel", "_qk_norm_rope_kernel")),
    (
        "MoE experts and routing",
        (
            "_gate_up_",
            "_down_kernel",
            "_down_gemv",
            "_routing_kernel",
            "_align_count",
            "_align_prefix",
            "_align_scatter",
            "_csf_expand",
        ),
    ),
    ("GEMM (cuBLAS / CUTLASS)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")),
    ("Inductor (fused elementwise)", ("triton_",)),
    ("NCCL", ("nccl",)),
    ("sampling", ("_chunk_kernel", "_reduce_kernel", "_uniform", "argmax", "gumbel", "topk")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill", "cat")),
)


def _family(name: str) -> str:
    low = name.lower()
    for family, patterns in FAMILIES:
        if any(p in low for p in patterns):
            return family
    return "other"


def kernel_table(prof, steps: int, top: int = 25) -> str:  # noqa: ANN001
    """The `top` kernels (and copies) by device time: launches per step, µs per launch, µs per
    step and share of the device time, then the rest summed."""
    from torch.autograd import DeviceType

    rows = [
        (e.key, e.count, e.self_device_time_total)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    ]
    if not rows:
        return "no kernels"
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    lines = [f"{'kernel':<72}{'per step':>9}{'µs each':>9}{'µs/step':>9}{'share':>7}"]
    for name, count, us in rows[:top]:
        lines.append(
            f"{name[:71]:<72}{count / steps:>9.1f}{us / count:>9.2f}{us / steps:>9.1f}"
            f"{us / total:>7.1%}"
        )
    rest = rows[top:]
    if rest:
        us = sum(r[2] for r in rest)
        launches = sum(r[1] for r in rest)
        lines.append(
            f"{f'{len(rest)} other kernels':<72}{launches / steps:>9.1f}{us / launches:>9.2f}"
            f"{us / steps:>9.1f}{us / total:>7.1%}"
        )
    lines.append(f"{'all kernels':<72}{sum(r[1] for r in rows) / steps:>9.1f}{'':>9}"
                 f"{total / steps:>9.1f}")  # fmt: skip
    families: dict[str, list[float]] = {}
    for name, count, us in rows:
        entry = families.setdefault(_family(name), [0.0, 0.0])
        entry[0] += count
        entry[1] += us
    lines.append(f"{'by family':<72}{'per step':>9}{'µs each':>9}{'µs/step':>9}{'share':>7}")
    for family, (count, us) in sorted(families.items(), key=lambda kv: -kv[1][1]):
        lines.append(
            f"{family:<72}{count / steps:>9.1f}{us / count:>9.2f}{us / steps:>9.1f}"
            f"{us / total:>7.1%}"
        )
    return "\n".join(lines)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prefill(session, ids: list[list[int]], params) -> None:  # noqa: ANN001
    """Submits the requests and steps until each has its first token (its prefill is done)."""
    pending = {session.submit(prompt, params) for prompt in ids}
    while pending:
        for out in session.step():
            if out.token_ids:
                pending.discard(out.request_id)


def _decode(session) -> int:  # noqa: ANN001
    """Steps until every request finished; returns how many steps that took."""
    steps = 0
    while session.has_unfinished_requests():
        session.step()
        steps += 1
    return steps


def profile_steps(session, ids: list[list[int]], tokens: int, python_top: int = 20) -> None:  # noqa: ANN001
    """Profiles the decode steps of `ids` generating `tokens` greedy tokens each (their prefills
    run first, outside the profile): device timeline, kernel table and host ops per step, then
    the Python functions by own time over a second such run (cProfile)."""
    from torch.profiler import ProfilerActivity, profile

    from libkk import SamplingParams

    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    _prefill(session, ids, params)
    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = _decode(session)
        sync()
    wall = (time.perf_counter() - start) * 1e3 / steps
    print(f"profile: {steps} decode steps, {wall:.2f} ms wall per step (profiler on)")
    print(device_timeline(prof, steps))
    print(kernel_table(prof, steps))
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    _prefill(session, ids, params)
    py = cProfile.Profile()
    steps = py.runcall(_decode, session)
    print(f"Python functions over {steps} decode steps (cProfile on):")
    pstats.Stats(py).sort_stats("tottime").print_stats(python_top)


def profile_prefill(session, ids: list[list[int]]) -> None:  # noqa: ANN001
    """The kernels of one prefill of `ids` (to the first token): at TP > 1 a long NCCL kernel on
    rank 0 is rank 0 waiting for a slower peer."""
    from torch.profiler import ProfilerActivity, profile

    from libkk import SamplingParams

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        session.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        sync()
    print("prefill " + device_timeline(prof, 1))
    print(kernel_table(prof, 1, top=15))
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
