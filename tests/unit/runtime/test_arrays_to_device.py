"""arrays_to_device: several host arrays through one copy come back with their values, dtypes and
shapes (odd int32 lengths, 2-D tables and empty arrays between aligned int64 ones)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libkk.runtime.input_batch import arrays_to_device

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_arrays_come_back_equal(device):
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(-(2**62), 2**62, 5, dtype=np.int64),
        np.arange(3, dtype=np.int32),  # 12 bytes: the next array starts at the next 8-byte offset
        rng.integers(0, 1000, (4, 7), dtype=np.int32),
        np.zeros(0, dtype=np.int64),
        rng.integers(0, 2**40, 9, dtype=np.int64),
        np.arange(6, dtype=np.int64)[::2],  # not contiguous
    ]
    got = arrays_to_device(arrays, torch.device(device))
    assert len(got) == len(arrays)
    for a, t in zip(arrays, got, strict=True):
        assert t.device.type == device
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype
        assert tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a)
