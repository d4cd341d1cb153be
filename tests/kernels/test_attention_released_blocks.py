"""Released blocks before a sliding window are never read.

When every layer of a model has a window, the KV cache manager releases a request's blocks wholly
before the window of its step's first query and points their block-table entries at the null
block. Here those entries point at the null block filled with NaN (as `make_batch` leaves it):
the Triton kernels and the torch backend (the CPU path) must give what the reference gives
with the whole table, so neither reads a released entry.
"""

from __future__ import annotations

import libkk.kernels.attention as pa
import pytest
import torch
from kernel_env import DEVICE, RUNS_KERNELS
from libkk.kernels import paged_attention, paged_attention_ref
from paged_batch import make_batch

from libkk.layers.attention import TorchAttentionBackend
from libkk.layers.triton_attention import TritonAttentionBackend

pytestmark = RUNS_KERNELS

# Requests as (query_len, seq_len): decode, verify, a prefix-hit chunk and a fresh prefill.
BATCHES = {
    "decode": [(1, 33), (1, 17), (1, 70), (1, 6)],
    "mixed": [(1, 45), (12, 12), (3, 70), (9, 38)],
}


def _release_before_window(block_table: torch.Tensor, b, window: int) -> torch.Tensor:
    """The table with every block wholly before each request's first query window nulled."""
    table = block_table.clone()
    page = b.kv_cache.shape[2]
    for i, (query_len, seq_len) in enumerate(zip(b.query_lens, b.seq_lens_list, strict=True)):
        first = max(0, seq_len - query_len - window + 1) // page
        table[i, :first] = 0
    return table


@pytest.mark.parametrize("window", [1, 5, 8, 13])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_released_entries_are_never_read(monkeypatch, batch: str, window: int) -> None:
    monkeypatch.setattr(pa, "VARLEN_BLOCK_N", 16)  # several KV tiles per sequence
    monkeypatch.setattr(pa, "DECODE_BLOCK_N", 16)
    b = make_batch(BATCHES[batch], 4, 2, 32, 4, dtype=torch.float32, device=DEVICE, seed=31)
    assert torch.isnan(b.kv_cache[:, 0]).all()  # the null block holds NaN
    full = b.block_table
    released = _release_before_window(full, b, window)
    assert (released == 0).sum() > (full == 0).sum()  # some entries were released

    n = b.num_real_tokens
    backends = [TorchAttentionBackend(), TritonAttentionBackend()]
    outs = []
    for backend in backends:
        cache = b.kv_cache.clone()
        b.block_table = released
        outs.append(backend.forward(b.q, b.k, b.v, cache, b.metadata(), b.scale, window=window))
    # The reference over the whole table, with the new K/V stored as the backends store them.
    b.block_table = full
    cache = b.kv_cache.clone()
    TorchAttentionBackend().forward(b.q, b.k, b.v, cache, b.metadata(), b.scale, window=window)
    args = list(b.attention_args(cache))
    want = paged_attention_ref(*args, window=window)
    for got in outs:
        assert not torch.isnan(got[:n]).any()
        torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    args[2] = released
    got = paged_attention(*args, num_splits=3, window=window) if batch == "decode" else None
    if got is not None:
        torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)
