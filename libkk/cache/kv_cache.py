"""The KV cache tensors: how big a block is, how many blocks fit, and allocating them."""

from __future__ import annotations

import os

import torch

from libkk.config import CacheConfig
from libkk.errors import ConfigError

_MEMINFO = "/proc/meminfo"
_MiB = 1 << 20
# Without an explicit budget the CPU cache takes at most this much (as vLLM's CPU backend does):
# RAM is shared with the rest of the host process.
CPU_DEFAULT_KV_BYTES = 4 << 30


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
    `seq_blocks`: the most blocks such a sequence holds at once, when fewer than
    ceil(max_model_len / block_size) (a model whose every layer has a sliding window).
    """
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    block_size = cache_config.block_size
    num_needed = 2 if max_model_len is None else -(-max_model_len // block_size) + 1
    if max_model_len is not None and seq_blocks is not None:
        num_needed = min(num_needed, seq_blocks + 1)
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
