"""Paged attention on the Triton ops of libkk.kernels (the CUDA backend).

Same contract as the torch reference backend: store the step's K/V first, then attend. Padded rows
(slots in the null block, or negative) are not written at all. FP8 (e4m3) caches store x / scale
with one scale for K and one for V; both start at 1.0 and `set_kv_scales` changes them in place,
so CUDA graphs captured earlier read the new values on replay.
"""

from __future__ import annotations

import math

import torch

from libkk.kernels import paged_attention, store_kv
from libkk.layers.attention import AttentionBackend
from libkk.layers.forward_context import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention: varlen for mixed batches, split-K for uniform decode batches.

    The KV scales are per process (every layer shares them); per-layer calibration would keep
    scales on each layer and pass them here.
    """

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self._k_scale = 1.0
        self._v_scale = 1.0
        # NOTE: one [1] fp32 tensor per device, kept for the backend's life: graph replays
        # read them by address, so scale updates fill them in place rather than replace them.
        self._scales: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.set_kv_scales(k_scale, v_scale)

    @property
    def kv_scales(self) -> tuple[float, float]:
        return self._k_scale, self._v_scale

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Sets the FP8 cache scales (stored value = x / scale); other cache dtypes ignore them.

        Values already in an FP8 cache were stored with the old scales: set scales before the
        cache is filled (calibration), not while requests hold blocks.
        """
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be a finite positive float, got {value!r}")
        self._k_scale, self._v_scale = float(k_scale), float(v_scale)
        for k, v in self._scales.values():
            k.fill_(self._k_scale)
            v.fill_(self._v_scale)

    def scale_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The ([1] fp32 k_scale, [1] fp32 v_scale) the ops read on `device`."""
        scales = self._scales.get(device)
        if scales is None:
            scales = (
                torch.full((1,), self._k_scale, dtype=torch.float32, device=device),
                torch.full((1,), self._v_scale, dtype=torch.float32, device=device),
            )
            self._scales[device] = scales
        return scales

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        k_scale, v_scale = self.scale_tensors(kv_cache.device)
        store_kv(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        return paged_attention(
            q,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            k_scale,
            v_scale,
            metadata.max_query_len,
        )
