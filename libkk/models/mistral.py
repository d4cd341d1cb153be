"""Mistral and Ministral: Llama with a sliding window.

Every layer (Ministral: each layer its `layer_types` entry calls sliding) attends over the last
`sliding_window` positions (None: full attention), a setting of the ArchConfig that
LlamaAttention hands to its Attention layer. The KV cache manager releases the blocks that fell
out of the window (a Ministral with full layers too keeps those in a KV group of their own,
docs/memory.md).
"""

from __future__ import annotations

from libkk.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama module tree and arithmetic; the window comes from the ArchConfig."""
