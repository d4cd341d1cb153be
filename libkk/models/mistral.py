"""Mistral (and Ministral checkpoints that name MistralForCausalLM): Llama with a sliding window.

Every layer attends over the last `sliding_window` positions (None: full attention), a setting of
the ArchConfig that LlamaAttention hands to its Attention layer. With a window, the KV cache
manager releases the blocks of a request that fell out of it (docs/memory.md).
"""

from __future__ import annotations

from libkk.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama module tree and arithmetic; the window comes from the ArchConfig."""
