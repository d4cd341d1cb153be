"""Paged attention: the layer models call, and the backends that run it.

The layer writes the step's new K/V into its paged cache by slot mapping, then attends each
request's queries over its whole context (cached + new, causal within the new tokens, GQA). The
backend is chosen once per process; the torch reference runs anywhere and is the CPU path.
"""

from __future__ import annotations

import abc
import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from libkk.layers.forward_context import AttentionMetadata, get_forward_context


class AttentionBackend(abc.ABC):
    """Computes attention for one layer and one step.

    Invariants: `forward` first stores k/v at `metadata.slot_mapping` (rows mapped to the null
    block's slots are padding and may be written there, never elsewhere), then returns the output
    for every query row; rows of different requests never see each other.
    """

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes new keys/values into the paged cache at flat slot indices.

    An FP8 cache stores values with scale 1.0, saturated at the format's range (as the Triton
    store does); its bytes are copied through uint8 views, since CPU index ops have no fp8 kernels.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    if kv_cache.dtype == torch.float8_e4m3fn:
        k, v = k.clamp(-FP8_MAX, FP8_MAX), v.clamp(-FP8_MAX, FP8_MAX)
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.element_size() == 1:
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] along dim 0 (one of K or V: [num_blocks, block_size, heads, head_dim])."""
    if cache.element_size() == 1:  # fp8: gather the bytes, as in store_kv
        return cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype)
    return cache.index_select(0, blocks)


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention in plain torch.

    Decode batches of several requests (one query each) run as one padded SDPA call; anything
    else runs one SDPA call per request, with a causal mask over its new tokens.
    """

    def forward(self, q, k, v, kv_cache, metadata, scale):
        store_kv(k, v, kv_cache, metadata.slot_mapping)
        if metadata.max_query_len == 1 and metadata.num_reqs > 1:
            return self._decode(q, kv_cache, metadata, scale)
        block_size = metadata.block_size
        out = torch.empty_like(q)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            q_start, q_end = starts[i], starts[i + 1]
            query_len = q_end - q_start
            if query_len == 0:
                continue
            # A single query sees its whole context; queries with no cached context are plain
            # causal (SDPA then skips the masked half) and their keys are this step's own;
            # otherwise the context comes from the cache, with an explicit mask.
            mask, causal = None, query_len > 1 and query_len == seq_len
            if causal:
                keys, values = k[q_start:q_end], v[q_start:q_end]  # [seq_len, kv_heads, dim]
            else:
                blocks = metadata.block_table[i, : -(-seq_len // block_size)].long()
                keys = gather_blocks(kv_cache[0], blocks).flatten(0, 1)[:seq_len]
                values = gather_blocks(kv_cache[1], blocks).flatten(0, 1)[:seq_len]
            # [num_kv_heads, seq_len, head_dim]
            keys, values = keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype)
            if query_len > 1 and not causal:
                # Query row r sits at position seq_len - query_len + r and sees keys up to it.
                q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
            # NOTE: 4-D inputs (a batch of one): CPU SDPA runs its fused kernel on them, but the
            # slow math path on 3-D ones (5x at 1.5K tokens).
            out[q_start:q_end] = F.scaled_dot_product_attention(
                q[q_start:q_end].transpose(0, 1)[None],
                keys[None],
                values[None],
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, kv_cache, metadata, scale):
        num_reqs = metadata.num_reqs
        max_blocks = -(-metadata.max_seq_len // metadata.block_size)
        blocks = metadata.block_table[:, :max_blocks].long()  # [num_reqs, max_blocks]
        # [num_reqs, num_kv_heads, max_blocks * block_size, head_dim]
        shape = (num_reqs, -1, *kv_cache.shape[3:])  # [num_reqs, max_len, num_kv_heads, D]
        keys = gather_blocks(kv_cache[0], blocks.flatten()).view(shape)
        values = gather_blocks(kv_cache[1], blocks.flatten()).view(shape)
        keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
        # Slots past each request's length hold whatever was there (maybe NaN, and masked
        # weights of 0 times NaN are still NaN): mask the scores and zero the gathered copies.
        mask = (
            torch.arange(keys.shape[2], device=q.device)[None, :]
            < metadata.seq_lens.to(q.device)[:, None]
        )  # [num_reqs, max_len]
        invalid = ~mask[:, None, :, None]
        keys.masked_fill_(invalid, 0.0)
        values.masked_fill_(invalid, 0.0)
        out = F.scaled_dot_product_attention(
            q.view(num_reqs, -1, 1, q.shape[-1]),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )  # [num_reqs, num_heads, 1, head_dim]
        return out.view(num_reqs, -1, q.shape[-1])


_BACKENDS: dict[str, AttentionBackend] = {"cpu": TorchAttentionBackend()}


def attention_backend(device: torch.device) -> AttentionBackend:
    """The backend for a device type: Triton kernels on CUDA, the torch reference elsewhere."""
    backend = _BACKENDS.get(device.type)
    if backend is None:
        if device.type == "cuda":
            from libkk.layers.triton_attention import TritonAttentionBackend

            backend = TritonAttentionBackend()
        else:
            backend = _BACKENDS["cpu"]
        _BACKENDS[device.type] = backend
    return backend


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache of one layer.

    `kv_cache` is bound by the model runner after the cache is allocated.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.layer_key = _register_layer(self)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        # NOTE: under torch.compile attention is one opaque op (`libkk::attention`): the model
        # traces as a single graph, Inductor fuses everything between attention calls, and the
        # op reads the step's metadata from the forward context at run time.
        if torch.compiler.is_compiling():
            return torch.ops.libkk.attention(q, k, v, self.layer_key)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound; the model runner binds it")
        metadata = get_forward_context().attn_metadata
        n = q.shape[0]
        out = attention_backend(q.device).forward(
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            metadata,
            self.scale,
        )
        return out.reshape(n, self.num_heads * self.head_dim)


# Every Attention layer of the process by key, so the compiled graph names a layer by an int. Keys
# follow construction order, so the model a process builds first gets the same keys (and compiled
# graphs that hit the on-disk caches) in every process.
_LAYERS: dict[int, weakref.ref[Attention]] = {}
_next_key = itertools.count()


def _register_layer(layer: Attention) -> int:
    key = next(_next_key)
    _LAYERS[key] = weakref.ref(layer, lambda _: _LAYERS.pop(key, None))
    return key


# NOTE: mutates_args is empty although the op writes the layer's KV cache: the cache is not an
# argument (functionalizing it would copy the whole cache), and the op's output feeds the next
# layer, so the compiled graph keeps every layer's call in order.
@torch.library.custom_op("libkk::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_key: int
) -> torch.Tensor:
    layer = _LAYERS[layer_key]()
    if layer is None:
        raise RuntimeError(f"attention layer {layer_key} no longer exists")
    return layer.attend(q, k, v)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_key: int) -> torch.Tensor:
    return torch.empty_like(q)
