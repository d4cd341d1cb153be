"""Paged attention on the Triton ops of libkk.kernels (the CUDA backend).

Same contract as the torch reference backend: store the step's K/V first, then attend (with
Qwen3's q/k norms and rotation, one kernel does those and the store). Padded rows
(slots in the null block, or negative) are not written at all. FP8 (e4m3) caches store x / scale
with the calling layer's [1] fp32 k_scale and v_scale, read by address: CUDA graphs captured
before the layer's scales change (calibration) read the new values on replay.
"""

from __future__ import annotations

import torch

from libkk.kernels import paged_attention, qk_norm_rope_store_kv, store_kv
from libkk.layers.attention import AttentionBackend
from libkk.layers.forward_context import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention: varlen for mixed batches, split-K for uniform decode batches."""

    def __init__(self) -> None:
        # Scales 1.0 for callers that pass none (caches outside any Attention layer), one pair
        # per device, kept for the backend's life so graphs may capture them.
        self._unit_scales: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def unit_scales(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        scales = self._unit_scales.get(device)
        if scales is None:
            one = torch.ones(1, dtype=torch.float32, device=device)
            scales = self._unit_scales[device] = (one, one.clone())
        return scales

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [1] fp32 on the cache's device; None: 1.0
        v_scale: torch.Tensor | None = None,
        window: int = 0,  # sliding window; 0: none
        sinks: torch.Tensor | None = None,  # [num_heads] fp32 attention sinks
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        k_scale, v_scale = self._scales(kv_cache.device, k_scale, v_scale)
        store_kv(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        return self._attend(q, kv_cache, metadata, scale, k_scale, v_scale, window, sinks)

    def forward_qk_norm_rope(
        self, q, k, v, prologue, positions, kv_cache, metadata, scale, k_scale=None, v_scale=None,
        window=0, sinks=None,
    ):  # fmt: skip
        """One kernel normalizes and rotates q and k and stores k and v (k never reaches
        memory outside the cache), then the attention kernel."""
        k_scale, v_scale = self._scales(kv_cache.device, k_scale, v_scale)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        qk_norm_rope_store_kv(
            q, k, v, *prologue.args(positions), kv_cache, metadata.slot_mapping, k_scale, v_scale,
            q_out,
        )  # fmt: skip
        q = q_out.view(q.shape[0], -1, prologue.head_dim)
        return self._attend(q, kv_cache, metadata, scale, k_scale, v_scale, window, sinks)

    def _scales(
        self, device: torch.device, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        unit_k, unit_v = self.unit_scales(device)
        return (unit_k if k_scale is None else k_scale), (unit_v if v_scale is None else v_scale)

    def _attend(
        self, q, kv_cache, metadata, scale, k_scale, v_scale, window=0, sinks=None
    ) -> torch.Tensor:
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
            window=window,
            sinks=sinks,
        )
