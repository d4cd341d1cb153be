"""Paged attention: the layer models call, and the backends that run it.

The layer writes the step's new K/V into its paged cache by slot mapping, then attends each
request's queries over its whole context (cached + new, causal within the new tokens, GQA). The
backend is chosen once per process; the torch reference runs anywhere and is the CPU path.

A layer with a sliding window W lets a query at position p see keys at positions p - W < n <= p
(transformers' Mistral convention). Backends read no block wholly before the window of a step's
first query: the KV cache manager releases the blocks of a windowed KV group before its window and
points their block-table entries at the null block. A layer reads the block table and slot
mapping of its KV group (`kv_group`, set by the model runner; docs/memory.md).

A layer with attention sinks (gpt-oss) holds one learned logit per query head that joins each
softmax's denominator and contributes no value: softmax over [scores, sink], the sink's column
dropped.

FP8 (e4m3) caches hold k / k_scale and v / v_scale, saturated at +-448, and reads multiply back.
Each layer owns its [1] fp32 k_scale / v_scale (1.0 unless a checkpoint brings them or the layer
calibrates them from the first prefill it stores); other cache dtypes ignore the scales.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from libkk.distributed import get_tp_rank
from libkk.errors import CorruptCheckpointError
from libkk.kernels.norm import qk_norm_rope, qk_norm_rope_ref
from libkk.layers.forward_context import AttentionMetadata, get_forward_context
from libkk.layers.linear import takes_kernels
from libkk.layers.registry import IndexedLayer


class AttentionBackend(abc.ABC):
    """Computes attention for one layer and one step.

    Invariants: `forward` first stores k/v at `metadata.slot_mapping` (rows mapped to the null
    block's slots are padding and may be written there, never elsewhere), then returns the output
    for every query row; rows of different requests never see each other. `window` > 0 limits a
    query at position p to keys in (p - window, p]; 0 is full causal attention. `sinks`
    ([num_heads] fp32 logits) join every row's softmax denominator.
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
        k_scale: torch.Tensor | None = None,  # [1] fp32, FP8 caches only; None: 1.0
        v_scale: torch.Tensor | None = None,  # [1] fp32
        window: int = 0,  # sliding window; 0: none
        sinks: torch.Tensor | None = None,  # [num_heads] fp32 attention sinks; None: none
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def forward_qk_norm_rope(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim], before the norm and rotation
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim], likewise
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        prologue: QKNormRope,
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """`forward` after the prologue's norms and rotation of q and k. A backend may fuse
        them with the KV store; this one applies them first."""
        q, k = prologue.apply(q, k, positions)
        n, d = q.shape[0], prologue.head_dim
        return self.forward(
            q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d), kv_cache, metadata, scale,
            k_scale, v_scale, window, sinks,
        )  # fmt: skip


class QKNormRope(NamedTuple):
    """A model's step between its q/k projection and attention that the attention layer runs:
    each head of q and k RMS-normalized over head_dim (Qwen3; None: no norms), then rotated by
    RoPE over the whole head. Inside the layer a backend can write the rotated keys straight
    into the KV cache."""

    q_norm: nn.Module | None  # RMSNorm(head_dim)
    k_norm: nn.Module | None  # RMSNorm(head_dim)
    rotary: nn.Module  # RotaryEmbedding: cos_sin_cache [max_position, head_dim]

    @property
    def head_dim(self) -> int:
        return self.rotary.cos_sin_cache.shape[1]

    def args(self, positions: torch.Tensor) -> tuple:
        """The norm/rope ops' arguments after q and k."""
        if self.q_norm is None:
            return None, None, self.rotary.cos_sin_cache, positions, 0.0
        return (
            self.q_norm.weight, self.k_norm.weight, self.rotary.cos_sin_cache, positions,
            self.q_norm.eps,
        )  # fmt: skip

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) normalized and rotated: one kernel on CUDA, the torch reference elsewhere."""
        args = self.args(positions)
        norm_rope = qk_norm_rope if takes_kernels(q, k, *args[:2]) else qk_norm_rope_ref
        return norm_rope(q, k, *args)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x / scale in float8_e4m3fn, saturated at +-448 (e4m3fn has no inf: overflow would be NaN).

    Divides in fp32, as the Triton store does, so both write the same bytes.
    """
    x = x.float() if scale is None else x.float() / scale.float()
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache values (any dtype) back to `dtype`; FP8 values are multiplied by their scale."""
    if not is_fp8(x) or scale is None:
        return x.to(dtype)
    return (x.float() * scale.float()).to(dtype)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes new keys/values into the paged cache at flat slot indices.

    An FP8 cache stores k / k_scale and v / v_scale (None: 1.0), saturated at the format's range
    as the Triton store does; its bytes are copied through uint8 views, since CPU index ops have
    no fp8 kernels.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    if is_fp8(kv_cache):
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
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

    def forward(
        self, q, k, v, kv_cache, metadata, scale, k_scale=None, v_scale=None, window=0, sinks=None
    ):
        store_kv(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        if metadata.max_query_len == 1 and metadata.num_reqs > 1:
            return self._decode(q, kv_cache, metadata, scale, k_scale, v_scale, window, sinks)
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
            # otherwise the context comes from the cache, with an explicit mask. A window that
            # hides keys makes the mask explicit in every case.
            windowed = 0 < window < seq_len
            # Sinks take an explicit mask too (their column is added to it).
            explicit = windowed or sinks is not None
            mask, causal = None, query_len > 1 and query_len == seq_len and not explicit
            own_keys = query_len == seq_len
            key_start = 0  # position of the first key gathered
            if own_keys:
                keys, values = k[q_start:q_end], v[q_start:q_end]  # [seq_len, kv_heads, dim]
                if is_fp8(kv_cache):  # what the cache holds, as the kernels read it
                    keys = dequantize(quantize_fp8(keys, k_scale), k_scale, q.dtype)
                    values = dequantize(quantize_fp8(values, v_scale), v_scale, q.dtype)
            else:
                # Only from the block of the first query's window on: earlier blocks may have
                # been released (their table entries are the null block).
                lo = max(seq_len - query_len - window + 1, 0) // block_size if windowed else 0
                key_start = lo * block_size
                blocks = metadata.block_table[i, lo : -(-seq_len // block_size)].long()
                keys = gather_blocks(kv_cache[0], blocks).flatten(0, 1)[: seq_len - key_start]
                values = gather_blocks(kv_cache[1], blocks).flatten(0, 1)[: seq_len - key_start]
            # [num_kv_heads, seq_len, head_dim]
            keys = dequantize(keys, k_scale, q.dtype).transpose(0, 1)
            values = dequantize(values, v_scale, q.dtype).transpose(0, 1)
            if (query_len > 1 and not causal) or explicit:
                # Query row r sits at position seq_len - query_len + r and sees keys up to it
                # (and, with a window, after q_pos - window).
                q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
                k_pos = torch.arange(key_start, seq_len, device=q.device)[None, :]
                mask = k_pos <= q_pos
                if windowed:
                    mask &= k_pos > q_pos - window
            queries = q[q_start:q_end].transpose(0, 1)[None]
            if sinks is not None:
                keys, values, mask = _with_sink_column(keys, values, mask, sinks)
            # NOTE: 4-D inputs (a batch of one): CPU SDPA runs its fused kernel on them, but the
            # slow math path on 3-D ones (5x at 1.5K tokens).
            out[q_start:q_end] = F.scaled_dot_product_attention(
                queries,
                keys[None],
                values[None],
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=sinks is None,
            )[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, kv_cache, metadata, scale, k_scale, v_scale, window=0, sinks=None):
        num_reqs = metadata.num_reqs
        block_size = metadata.block_size
        max_blocks = -(-metadata.max_seq_len // block_size)
        # From the first block some request's window reaches (earlier ones may be released).
        lo = max(min(metadata.seq_lens_cpu) - window, 0) // block_size if window > 0 else 0
        blocks = metadata.block_table[:, lo:max_blocks].long()  # [num_reqs, max_blocks - lo]
        # [num_reqs, num_kv_heads, (max_blocks - lo) * block_size, head_dim]
        shape = (num_reqs, -1, *kv_cache.shape[3:])  # [num_reqs, max_len, num_kv_heads, D]
        keys = gather_blocks(kv_cache[0], blocks.flatten()).view(shape)
        values = gather_blocks(kv_cache[1], blocks.flatten()).view(shape)
        keys = dequantize(keys, k_scale, q.dtype).transpose(1, 2)
        values = dequantize(values, v_scale, q.dtype).transpose(1, 2)
        # Slots past each request's length, and released blocks (the null block) before another
        # request's window, hold whatever was there (maybe NaN, and masked weights of 0 times NaN
        # are still NaN): mask the scores and zero the gathered copies.
        k_pos = torch.arange(lo * block_size, lo * block_size + keys.shape[2], device=q.device)
        k_pos = k_pos[None, :]
        seq_lens = metadata.seq_lens.to(q.device)[:, None]
        mask = k_pos < seq_lens  # [num_reqs, max_len]
        if window > 0:  # the one query sits at seq_len - 1
            mask &= k_pos >= seq_lens - window
        invalid = ~mask[:, None, :, None]
        keys.masked_fill_(invalid, 0.0)
        values.masked_fill_(invalid, 0.0)
        attn_mask = mask[:, None, None, :]
        if sinks is not None:
            keys, values, attn_mask = _with_sink_column(keys, values, attn_mask, sinks)
        out = F.scaled_dot_product_attention(
            q.view(num_reqs, -1, 1, q.shape[-1]),
            keys,
            values,
            attn_mask=attn_mask,
            scale=scale,
            enable_gqa=sinks is None,
        )  # [num_reqs, num_heads, 1, head_dim]
        return out.view(num_reqs, -1, q.shape[-1])


def _with_sink_column(
    keys: torch.Tensor,  # [..., num_kv_heads, seq_len, head_dim]
    values: torch.Tensor,  # [..., num_kv_heads, seq_len, head_dim]
    mask: torch.Tensor,  # bool, broadcastable to [..., num_heads, query_len, seq_len]
    sinks: torch.Tensor,  # [num_heads] fp32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values with one more position per head whose score is the head's sink: a zero
    key (q.k = 0) with the sink as its additive mask, and a zero value. Repeated to every query
    head (each head has its own sink column). The mask becomes additive (0 / -inf / sink)."""
    num_heads = sinks.shape[0]
    group = num_heads // keys.shape[-3]
    keys = keys.repeat_interleave(group, dim=-3)
    values = values.repeat_interleave(group, dim=-3)
    zero = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])
    keys, values = torch.cat((keys, zero), dim=-2), torch.cat((values, zero), dim=-2)
    lead, (q_len, seq_len) = mask.shape[:-3], mask.shape[-2:]
    visible = mask.expand(*lead, num_heads, q_len, seq_len)
    bias = torch.zeros((*lead, num_heads, q_len, seq_len + 1), dtype=keys.dtype, device=keys.device)
    bias[..., :seq_len].masked_fill_(~visible, float("-inf"))
    bias[..., seq_len] = sinks.to(keys.dtype)[:, None]
    return keys, values, bias


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


class Attention(IndexedLayer):
    """Multi-head / grouped-query attention over the paged KV cache of one layer.

    `kv_cache` is bound by the model runner after the cache is allocated. `k_scale` / `v_scale`
    are the layer's FP8 cache scales: their storage never changes (CUDA graphs read them by
    address), so every update fills them in place. A model whose q and k are rotated (Qwen3:
    normalized first) right before attention sets `qk_norm_rope` and passes the step's positions:
    the layer applies them, so the backend can fuse them with the KV store. `sliding_window` W
    (None: full attention) lets a query at position p see keys at positions p - W < n <= p.
    With `sinks`, the layer holds `sinks` [num_heads] fp32, this rank's heads' sink logits
    (a checkpoint's `self_attn.sinks` holds every head's; the loader takes this rank's).
    """

    layer_kind = "attention"

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.window = sliding_window or 0  # what the backends take; 0: none
        # The KV group whose block table and slot mapping the layer reads (the model runner sets
        # it with the layer's KV tensor).
        self.kv_group = 0
        self.kv_cache: torch.Tensor | None = None
        # Not persistent: they are no model weights (a checkpoint's scales are read by the loader).
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.calibration_pending = False
        self.qk_norm_rope: QKNormRope | None = None  # not submodules: the model owns them
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(
                torch.empty(num_heads, dtype=torch.float32), requires_grad=False
            )
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]

    def _load_sinks(
        self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: object = None
    ) -> None:
        if loaded.dim() != 1 or loaded.shape[0] % self.num_heads:
            raise CorruptCheckpointError(
                f"tensor {name!r} has shape {tuple(loaded.shape)}, expected one sink per "
                "attention head"
            )
        if loaded.shape[0] != self.num_heads:  # every head's: take this rank's
            loaded = loaded.narrow(0, get_tp_rank() * self.num_heads, self.num_heads)
        param.data.copy_(loaded.float())

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Sets the FP8 cache scales (stored value = x / scale) in place.

        Values already in an FP8 cache were stored with the old scales: set them before the cache
        holds anything (loading, calibration), never while requests hold blocks.
        """
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be a finite positive float, got {value!r}")
        self.k_scale.fill_(k_scale)
        self.v_scale.fill_(v_scale)

    @property
    def kv_scales(self) -> tuple[float, float]:
        return self.k_scale.item(), self.v_scale.item()

    def calibrate_kv_scales_on_first_prefill(self) -> None:
        """The first step that stores real tokens sets the scales from its K/V, then never again."""
        self.calibration_pending = True

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        positions: torch.Tensor | None = None,  # [num_tokens]; with qk_norm_rope only
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        # NOTE: under torch.compile attention is one opaque op (`libkk::attention`): the model
        # traces as a single graph, Inductor fuses everything between attention calls, and the
        # op reads the step's metadata from the forward context at run time.
        if (positions is None) != (self.qk_norm_rope is None):
            raise ValueError("positions are given exactly when the layer has qk_norm_rope")
        if torch.compiler.is_compiling():
            return torch.ops.libkk.attention(q, k, v, positions, self.layer_key)
        return self.attend(q, k, v, positions)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound; the model runner binds it")
        metadata = get_forward_context().attn_metadata.for_group(self.kv_group)
        backend = attention_backend(q.device)
        n = q.shape[0]
        if positions is not None:
            if self.calibration_pending:  # calibration reads the rotated keys: apply it apart
                q, k = self.qk_norm_rope.apply(q, k, positions)
            else:
                out = backend.forward_qk_norm_rope(
                    q, k, v, self.qk_norm_rope, positions, self.kv_cache, metadata, self.scale,
                    self.k_scale, self.v_scale, self.window, self.sinks,
                )  # fmt: skip
                return out.reshape(n, self.num_heads * self.head_dim)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.calibration_pending:
            self._calibrate(k, v, metadata)
        out = backend.forward(
            q, k, v, self.kv_cache, metadata, self.scale, self.k_scale, self.v_scale, self.window,
            self.sinks,
        )  # fmt: skip
        return out.reshape(n, self.num_heads * self.head_dim)

    def _calibrate(self, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> None:
        """scale = amax(|x|) / 448 over the real rows this step stores, so they span e4m3.

        Runs eagerly: `attend` is called outside torch.compile (inside the opaque attention op
        when compiled), and only FULL decode graphs contain attention. Those are captured at
        start-up, before any real prefill, over padding rows: calibration is a no-op inside a
        capture (it syncs with the host), and replays read the calibrated values later from the
        same tensors. A replay runs no Python, so the runner must not replay graphs while
        `kv_scale_calibration_pending` (a first step of one-token prompts is a uniform decode
        batch).
        """
        if not is_fp8(self.kv_cache):  # other caches ignore scales: nothing to calibrate
            self.calibration_pending = False
            return
        if k.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        # Rows in the null block (or negative) are padding: warm-up and capture runs store only
        # those, and they must not calibrate.
        real = metadata.slot_mapping.to(k.device) >= metadata.block_size
        if not bool(real.any()):
            return
        for x, scale in ((k[real], self.k_scale), (v[real], self.v_scale)):
            amax = x.abs().amax().float()
            scale.copy_((amax / FP8_MAX).clamp(min=MIN_CALIBRATED_SCALE).reshape(1))
        self.calibration_pending = False


# Floor of a calibrated scale: an all-zero K or V of the first batch must not give scale 0.
MIN_CALIBRATED_SCALE = torch.finfo(torch.float32).tiny


def kv_scale_calibration_pending(layers: Iterable[Attention]) -> bool:
    """Whether any layer still waits for its first real store to calibrate its scales."""
    return any(layer.calibration_pending for layer in layers)


def calibrate_kv_scales_on_first_prefill(model: nn.Module) -> int:
    """Every Attention layer of `model` calibrates its FP8 scales on its first real store
    (`CacheConfig.calculate_kv_scales`); returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.calibrate_kv_scales_on_first_prefill()
    return len(layers)


# NOTE: mutates_args is empty although the op writes the layer's KV cache: the cache is not an
# argument (functionalizing it would copy the whole cache), and the op's output feeds the next
# layer, so the compiled graph keeps every layer's call in order.
@torch.library.custom_op("libkk::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | None,
    layer_key: int,
) -> torch.Tensor:
    layer = get_forward_context().layers.get(Attention.layer_kind, layer_key)
    return layer.attend(q, k, v, positions)


@_attention_op.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | None,
    layer_key: int,
) -> torch.Tensor:
    return torch.empty_like(q)
