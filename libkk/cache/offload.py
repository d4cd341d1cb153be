"""A host-memory tier for the KV cache: evicted prefix blocks kept in RAM, findable by hash.

When the block pool evicts a cached block (hands it out again), its K/V of every layer is copied
into a host block and stays findable by the block's chained hash, with the preimage (parent hash,
token ids) kept to verify hits as the pool does. A later prefix lookup that misses on the device
asks this tier; a hit is copied back into a fresh device block, which is then cached like any
other. The host pool evicts its least recently used block when full.

The bookkeeping (which hash lives where) changes at once; the bytes move at `flush()`, which the
engine calls before each forward, in a few large copies: a host block holds every layer's K/V of
one device block as one contiguous run of bytes, so a batch of blocks moves as one copy per block
(one per run of adjacent host blocks) plus one gather or scatter kernel per layer through a
device staging buffer, instead of one small strided copy per block and layer.

On CUDA the copies run on a side stream and host memory is pinned. Ordering, with no host wait:
- the side stream first waits for the compute stream's enqueued work, so a store reads a block's
  final K/V and a restore never overwrites a block an earlier kernel still reads;
- the compute stream then waits for the side stream, so the forward that overwrites an evicted
  block or reads a restored one runs after its copy;
- stores are issued before restores on the one side stream, so a block evicted and handed to a
  restore in the same step is read before it is overwritten, and a host block is never refilled
  while an earlier copy still reads it.
On CPU the same copies run synchronously.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from libkk.cache.prefix_cache import BlockHash


@dataclass(slots=True)
class _HostEntry:
    host_block: int
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


class HostKVTier:
    # Bytes moved per staging round: bounds the device staging buffer.
    STAGING_BYTES = 64 << 20

    def __init__(self, kv_caches: Sequence[torch.Tensor], num_host_blocks: int) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        self.kv_caches = list(kv_caches)  # per layer: [2, num_blocks, block_size, heads, dim]
        device = kv_caches[0].device
        cuda = device.type == "cuda"
        # Each layer's [2, block_size, heads, dim] of one block, as bytes, side by side.
        self._layer_bytes = [c[:, 0].numel() * c.element_size() for c in kv_caches]
        self.bytes_per_block = sum(self._layer_bytes)
        self.host = torch.empty((num_host_blocks, self.bytes_per_block), dtype=torch.uint8,
                                pin_memory=cuda and torch.cuda.is_available())  # fmt: skip
        staging_blocks = max(1, min(self.STAGING_BYTES // self.bytes_per_block, num_host_blocks))
        self._staging = torch.empty((staging_blocks, self.bytes_per_block), dtype=torch.uint8,
                                    device=device)  # fmt: skip
        self.num_host_blocks = num_host_blocks
        self._entries: OrderedDict[BlockHash, _HostEntry] = OrderedDict()  # LRU first
        self._free = list(range(num_host_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2...
        # Queued copies, (device block, host block), moved at flush().
        self._stores: list[tuple[int, int]] = []
        self._restores: list[tuple[int, int]] = []
        self.num_stored = 0  # blocks copied to the host
        self.num_restored = 0  # blocks copied back (hits)
        self.bytes_moved = 0
        self._stream = torch.cuda.Stream(device) if cuda else None

    def __len__(self) -> int:
        return len(self._entries)

    def store(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        device_block: int,
    ) -> None:
        """Keeps a copy of device block `device_block` under its hash (evicting the host LRU).
        The bytes move at the next flush(), before the block can be overwritten."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        if not self._free:
            _, oldest = self._entries.popitem(last=False)
            self._free.append(oldest.host_block)
        host_block = self._free.pop()
        self._stores.append((device_block, host_block))
        self._entries[block_hash] = _HostEntry(host_block, parent_hash, tuple(token_ids))
        self.num_stored += 1
        self.bytes_moved += self.bytes_per_block

    def restore(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        device_block: int,
    ) -> bool:
        """Queues a copy of the block stored under this verified preimage into `device_block`;
        False on a miss (nothing queued). The bytes arrive at the next flush()."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.parent_hash != parent_hash or entry.token_ids != tuple(token_ids):
            return False
        self._restores.append((device_block, entry.host_block))
        self._entries.move_to_end(block_hash)
        self.num_restored += 1
        self.bytes_moved += self.bytes_per_block
        return True

    def flush(self) -> None:
        """Issues the queued copies (stores first) and orders the compute stream after them."""
        if not self._stores and not self._restores:
            return
        with self._copy_stream():
            for i in range(0, len(self._stores), len(self._staging)):
                self._store_round(self._stores[i : i + len(self._staging)])
            for i in range(0, len(self._restores), len(self._staging)):
                self._restore_round(self._restores[i : i + len(self._staging)])
        self._stores.clear()
        self._restores.clear()

    def _store_round(self, pairs: list[tuple[int, int]]) -> None:
        n = len(pairs)
        device_blocks = torch.tensor([d for d, _ in pairs], device=self._staging.device)
        for cache, staged in zip(self.kv_caches, self._layer_views(n), strict=True):
            staged.copy_(cache.index_select(1, device_blocks).transpose(0, 1))
        for start, stop, host_start in _runs([h for _, h in pairs]):
            self.host[host_start : host_start + stop - start].copy_(
                self._staging[start:stop], non_blocking=True
            )

    def _restore_round(self, pairs: list[tuple[int, int]]) -> None:
        n = len(pairs)
        for start, stop, host_start in _runs([h for _, h in pairs]):
            self._staging[start:stop].copy_(
                self.host[host_start : host_start + stop - start], non_blocking=True
            )
        device_blocks = torch.tensor([d for d, _ in pairs], device=self._staging.device)
        for cache, staged in zip(self.kv_caches, self._layer_views(n), strict=True):
            cache.index_copy_(1, device_blocks, staged.transpose(0, 1))

    def _layer_views(self, n: int) -> list[torch.Tensor]:
        """Each layer's slice of the first n staging rows, as [n, 2, block_size, heads, dim]."""
        views, offset = [], 0
        for cache, nbytes in zip(self.kv_caches, self._layer_bytes, strict=True):
            raw = self._staging[:n, offset : offset + nbytes]
            views.append(raw.view(cache.dtype).view(n, 2, *cache.shape[2:]))
            offset += nbytes
        return views

    @contextmanager
    def _copy_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            yield
        compute.wait_stream(self._stream)

    def touch(self, block_hash: BlockHash) -> bool:
        """True if the tier holds this hash; marks it most recently used, so stores made while
        a device block is found for its restore evict other entries first."""
        if block_hash not in self._entries:
            return False
        self._entries.move_to_end(block_hash)
        return True


def _runs(host_blocks: list[int]) -> Iterator[tuple[int, int, int]]:
    """(start, stop, first host block) for each run of consecutive host blocks in the list."""
    start = 0
    for i in range(1, len(host_blocks) + 1):
        if i == len(host_blocks) or host_blocks[i] != host_blocks[i - 1] + 1:
            yield start, i, host_blocks[start]
            start = i
