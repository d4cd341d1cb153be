"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama arithmetic with LongRoPE and optional partial rotary.

The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, in the row
order of libkk's stacked linears (q | k | v; gate | up): they load as already-merged tensors
(`MergedLinear` takes shard id None, and under tensor parallelism reads each rank's rows of every
part). LongRoPE, partial rotary and the sliding window come from the ArchConfig.
"""

from __future__ import annotations

from libkk.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: the Llama module tree with names matching the checkpoint's fused projections."""

    fused_on_cuda = False  # partial rotary (Phi-4-mini) rotates in torch ops; not yet measured
