"""Triton kernels; each public op has a torch reference `<op>_ref` with the same signature.

Ops are torch custom ops (`torch.ops.libkk.*`) with fake impls, so torch.compile traces around
them; called outside tracing they run their function directly (`_jit.KernelOp`). They run compiled on CUDA tensors and through Triton's interpreter on CPU tensors (slow:
for tests at small shapes).
"""

from __future__ import annotations

import sys

if __name__ == "libkk.kernels":
    from ._jit import NeedsWarmUp
    from .activation import silu_and_mul, silu_and_mul_ref
    from .attention import default_num_splits, paged_attention, paged_attention_ref
    from .gemv import gate_up_silu, gate_up_silu_ref, linear, linear_ref
    from .kv_cache import FP8_DTYPE, store_kv, store_kv_ref
    from .norm import (
        add_rms_norm,
        add_rms_norm_ref,
        qk_norm_rope,
        qk_norm_rope_ref,
        qk_norm_rope_store_kv,
        qk_norm_rope_store_kv_ref,
        rms_norm,
        rms_norm_ref,
    )
else:
    # This folder is the package libkk.kernels; with a checkout on sys.path it is also found as
    # `kernels` (transformers imports that name to probe for the Hugging Face package). Running
    # it again under that name would define every libkk:: op a second time, and torch's
    # dispatcher then crashes on their next call (a segfault, or `vector::reserve`).
    import importlib

    sys.modules[__name__] = importlib.import_module("libkk.kernels")

__all__ = [
    "FP8_DTYPE",
    "NeedsWarmUp",
    "add_rms_norm",
    "add_rms_norm_ref",
    "default_num_splits",
    "gate_up_silu",
    "gate_up_silu_ref",
    "linear",
    "linear_ref",
    "paged_attention",
    "paged_attention_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "qk_norm_rope_store_kv",
    "qk_norm_rope_store_kv_ref",
    "rms_norm",
    "rms_norm_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
]
