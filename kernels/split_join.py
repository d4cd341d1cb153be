"""Split K joined inside the splitting kernel, with no second kernel.

A product with a tall K and few output rows gives too few programs to keep the memory system
busy, so K is split over several programs per output tile, each summing its part in fp32. Each
program stores its partial sums and counts itself in at the tile's arrival count (`arrive`); the
tile's last arrival resets the count for the next launch, reads every split's partials back and
adds them in split order (`sum_partials`), so the sums are the same whichever program arrives
last (unlike atomic adds). One launch fewer than a separate reduce kernel: at
decode sizes a launch costs about what the reduce does.

The counts live in one zeroed int32 buffer per device (`arrival_counts`). Launches sharing it
must not overlap: libkk runs a model's forward on one stream, and a kernel launched with
programmatic dependent launch waits for its predecessor before touching memory.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import NeedsWarmUp, jit


@jit
def arrive(count_ptr, tile, SPLITS: tl.constexpr):
    """Counts this program in at its tile, after it stored its partials: whether it is the tile's
    last arrival, which may then read every split's partials (and has reset the count)."""
    # The barrier orders every thread's stores before the one thread's count; acq_rel makes them
    # visible to whoever counts in after it, and the last arrival's threads see every earlier
    # split's stores (they wait at the second barrier).
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    tl.debug_barrier()
    last = arrived == SPLITS - 1
    if last:  # every program of this launch has counted in; the next launch starts from zero
        tl.atomic_xchg(count_ptr + tile, 0)
    return last


@jit
def sum_partials(ptrs, split_stride, mask, SPLITS: tl.constexpr):
    """In the tile's last arrival: every split's partials at ptrs + s * split_stride, summed in
    split order in fp32."""
    total = tl.zeros(ptrs.shape, dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # L2 reads: other programs wrote them
        total += tl.load(ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total


# Per device: every buffer ever handed out stays alive, since a CUDA graph keeps using the one it
# was captured with.
_COUNTS: dict[torch.device, torch.Tensor] = {}
_EVERY_BUFFER: list[torch.Tensor] = []


def arrival_counts(device: torch.device, numel: int) -> torch.Tensor:
    """At least numel zeroed int32 arrival counts on device. Grown outside CUDA graph capture
    only (NeedsWarmUp during one): a graph's zero fill would first run at its replay."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise NeedsWarmUp(
                f"the split-K arrival counts ({numel}) must be allocated before CUDA graph "
                "capture: run the kernel once at this size first"
            )
        counts = torch.zeros(max(numel, 1024), dtype=torch.int32, device=device)
        _COUNTS[device] = counts
        _EVERY_BUFFER.append(counts)
    return counts
