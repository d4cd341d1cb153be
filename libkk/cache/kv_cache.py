"""The KV cache tensors: how layers share them (KV groups), how big a block is, how many blocks
fit, and allocating them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libkk.cache.kv_cache_manager import window_blocks_per_seq
from libkk.config import CacheConfig
from libkk.errors import ConfigError

_MEMINFO = "/proc/meminfo"
_MiB = 1 << 20
# Without an explicit budget the CPU cache takes at most this much (as vLLM's CPU backend does):
# RAM is shared with the rest of the host process.
CPU_DEFAULT_KV_BYTES = 4 << 30


@dataclass(frozen=True)
class KVGroups:
    """How a model's attention layers keep their KV (docs/memory.md).

    One group (most models): each layer has its own KV tensor and every layer reads a request's
    one block table. A hybrid model (sliding and full layers: Gemma 3, gpt-oss) keeps separate
    groups: its layers of one kind (one window, or none) in groups of `group_size`, each group
    with its own block table per request, so its windowed groups release blocks before their
    window while its full groups keep every block. `group_size` KV tensors are allocated, and
    tensor j serves layer j of every group: a block id names a block of one group's layers, and
    the pool is shared by all groups.
    """

    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention)
    layer_groups: tuple[int, ...]  # per attention layer (the model's order): its group
    layer_tensors: tuple[int, ...]  # per attention layer: the KV tensor it uses
    group_size: int  # KV tensors: the layers a block id holds KV for

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def plan_kv_groups(layer_windows: Sequence[int | None], separate: bool = True) -> KVGroups:
    """The KV groups of a model whose attention layers have these windows (None: full).

    Layers of several kinds (windows) form separate groups when `separate` (a host KV tier,
    which copies a block's every layer, does not take them): the smallest kind's layer count is
    the group size, and each kind fills groups of that size in layer order (its last group may
    be short; its missing tensors' share of those blocks goes unused). Otherwise one group,
    windowed only when every layer is (the widest window)."""
    n = len(layer_windows)
    kinds = list(dict.fromkeys(layer_windows))  # in order of first appearance
    if len(kinds) <= 1 or not separate:
        windowed = n > 0 and all(w is not None for w in layer_windows)
        window = max(w for w in layer_windows if w is not None) if windowed else None
        return KVGroups((window,), (0,) * n, tuple(range(n)), n)
    size = min(layer_windows.count(kind) for kind in kinds)
    windows: list[int | None] = []
    layer_groups, layer_tensors = [0] * n, [0] * n
    for kind in kinds:
        layers = [i for i, w in enumerate(layer_windows) if w == kind]
        for at in range(0, len(layers), size):
            for j, layer in enumerate(layers[at : at + size]):
                layer_groups[layer], layer_tensors[layer] = len(windows), j
            windows.append(kind)
    return KVGroups(tuple(windows), tuple(layer_groups), tuple(layer_tensors), size)


def kv_blocks_per_seq(
    groups: KVGroups, max_model_len: int, block_size: int, max_step_tokens: int
) -> int:
    """The most blocks one sequence of `max_model_len` tokens holds at once, every group
    together: a full group holds all its blocks, a windowed group those of its window and of
    the last two steps (`window_blocks_per_seq`)."""
    full = -(-max_model_len // block_size)
    return sum(
        full if w is None else min(full, window_blocks_per_seq(w, block_size, max_step_tokens))
        for w in groups.windows
    )


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V together."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def determine_num_blocks(
    cache_config: CacheConfig,
    bytes_per_block: int,
    device: torch.device,
    weights_bytes: int,
    max_blocks_useful: int,
    *,
    max_model_len: int | None = None,
    seq_blocks: int | None = None,
) -> int:
    """How many KV blocks to allocate, the null block included.

    `cache_config.num_gpu_blocks` is taken exactly. Otherwise the budget is
    `kv_cache_memory_bytes`, or else a share of memory: on CUDA `gpu_memory_utilization * total`
    less what this process already uses (at least `weights_bytes`) and never more than is free; on
    CPU `gpu_memory_utilization * MemAvailable` (weights already loaded are outside MemAvailable).
    The count is capped at `max_blocks_useful` (max_num_seqs * ceil(max_model_len / block_size) + 1:
    more could never be used) and is at least 2. Raises ConfigError if the cache cannot hold one
    sequence of `max_model_len` tokens (when given) or, without it, fewer than 2 blocks fit.
    `seq_blocks`: the most blocks such a sequence holds at once (`kv_blocks_per_seq`), when not
    ceil(max_model_len / block_size) (windowed layers, separate KV groups).
    """
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    block_size = cache_config.block_size
    num_needed = 2 if max_model_len is None else -(-max_model_len // block_size) + 1
    if max_model_len is not None and seq_blocks is not None:
        num_needed = seq_blocks + 1
    what = (
        "the cache" if max_model_len is None else f"one sequence of max_model_len={max_model_len}"
    )

    if cache_config.num_gpu_blocks is not None:
        num_blocks = cache_config.num_gpu_blocks
        if num_blocks < num_needed:
            raise ConfigError(
                f"num_gpu_blocks={num_blocks} is too small: {what} needs "
                f"{num_needed} blocks of block_size={block_size} (the null block included); raise "
                f"num_gpu_blocks or lower max_model_len"
            )
        return num_blocks

    if cache_config.kv_cache_memory_bytes is not None:
        budget = cache_config.kv_cache_memory_bytes
        source = f"kv_cache_memory_bytes={budget}"
    elif device.type == "cuda":
        budget, source = _cuda_budget(cache_config.gpu_memory_utilization, device, weights_bytes)
    else:
        available = _cpu_available_bytes()
        budget = min(int(cache_config.gpu_memory_utilization * available), CPU_DEFAULT_KV_BYTES)
        source = (
            f"gpu_memory_utilization={cache_config.gpu_memory_utilization} of "
            f"{available / _MiB:.1f} MiB available RAM, at most {CPU_DEFAULT_KV_BYTES >> 20} MiB"
        )

    num_fit = max(budget, 0) // bytes_per_block
    if num_fit < num_needed:
        raise ConfigError(
            f"the KV cache budget of {budget / _MiB:.1f} MiB ({source}) holds {num_fit} blocks of "
            f"{bytes_per_block / _MiB:.3f} MiB, but {what} needs {num_needed} "
            f"blocks ({num_needed * bytes_per_block / _MiB:.1f} MiB, block_size={block_size}); "
            f"raise gpu_memory_utilization or kv_cache_memory_bytes, or lower max_model_len"
        )
    return max(2, min(num_fit, max_blocks_useful))


def _cuda_budget(utilization: float, device: torch.device, weights_bytes: int) -> tuple[int, str]:
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    # NOTE: the weights are usually resident already and so inside `allocated`; the larger of the
    # two counts them once whether or not they are loaded yet.
    in_use = max(weights_bytes, allocated)
    budget = int(utilization * total) - in_use
    # Never plan for more than can be had now: another process may hold part of the device.
    # Memory this process's caching allocator reserved but is not using can be reused.
    obtainable = free + (reserved - allocated) - max(0, weights_bytes - allocated)
    budget = min(budget, obtainable)
    source = (
        f"gpu_memory_utilization={utilization} of {total / _MiB:.1f} MiB on {device}, less "
        f"{in_use / _MiB:.1f} MiB of weights and other tensors, {free / _MiB:.1f} MiB free"
    )
    return budget, source


def _cpu_available_bytes() -> int:
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor (K, V) per layer.

    NOTE: on CUDA the caches are zeroed: kernels may load whole blocks and mask afterwards, and
    uninitialized memory may hold NaN/Inf (0 * NaN = NaN). On CPU only the null block is zeroed,
    so untouched blocks cost no resident memory; the CPU path reads only slots it has written.
    """
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type == "cuda":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    for cache in caches:
        cache[:, 0].zero_()
    return caches
