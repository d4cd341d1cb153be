"""A host-memory tier for the KV cache: evicted prefix blocks kept in RAM, findable by hash.

When the block pool evicts a cached block (hands it out again), its K/V of every layer is copied
into a host block and stays findable by the block's chained hash, with the preimage (parent hash,
token ids) kept to verify hits as the pool does. A later prefix lookup that misses on the device
asks this tier; a hit is copied back into a fresh device block, which is then cached like any
other. The host pool evicts its least recently used block when full.

On CUDA the copies run on a side stream and host memory is pinned. Ordering, with no host wait:
- the side stream first waits for the compute stream's enqueued work, so a store reads a block's
  final K/V and a restore never overwrites a block an earlier kernel still reads;
- `wait_copies()` (called before each forward) makes the compute stream wait for the copies
  issued so far, so the forward that overwrites an evicted block or reads a restored one runs after
  its copy;
- stores and restores share the side stream, so a host block is never refilled while an earlier
  copy still reads it.
The host pool's bookkeeping (which hash lives where) changes at once; only the bytes move later.
On CPU the copies are plain synchronous copies.
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
    def __init__(self, kv_caches: Sequence[torch.Tensor], num_host_blocks: int) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        self.kv_caches = list(kv_caches)  # per layer: [2, num_blocks, block_size, heads, dim]
        pin = any(c.is_cuda for c in kv_caches) and torch.cuda.is_available()
        self.host = [
            torch.empty((2, num_host_blocks, *c.shape[2:]), dtype=c.dtype, pin_memory=pin)
            for c in kv_caches
        ]
        self.num_host_blocks = num_host_blocks
        self.bytes_per_block = sum(c[:, 0].numel() * c.element_size() for c in kv_caches)
        self._entries: OrderedDict[BlockHash, _HostEntry] = OrderedDict()  # LRU first
        self._free = list(range(num_host_blocks))
        self.num_stored = 0  # blocks copied to the host
        self.num_restored = 0  # blocks copied back (hits)
        self.bytes_moved = 0
        cuda = any(c.is_cuda for c in kv_caches)
        self._stream = torch.cuda.Stream(kv_caches[0].device) if cuda else None
        self._pending: torch.cuda.Event | None = None  # the side stream's last copy

    def __len__(self) -> int:
        return len(self._entries)

    def store(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        device_block: int,
    ) -> None:
        """Keeps a copy of device block `device_block` under its hash (evicting the host LRU)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        if not self._free:
            _, oldest = self._entries.popitem(last=False)
            self._free.append(oldest.host_block)
        host_block = self._free.pop()
        with self._copy_stream():
            for host, cache in zip(self.host, self.kv_caches, strict=True):
                host[:, host_block].copy_(cache[:, device_block], non_blocking=True)
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
        """Copies the block stored under this verified preimage into `device_block`; False on a
        miss (nothing copied)."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.parent_hash != parent_hash or entry.token_ids != tuple(token_ids):
            return False
        with self._copy_stream():
            for host, cache in zip(self.host, self.kv_caches, strict=True):
                cache[:, device_block].copy_(host[:, entry.host_block], non_blocking=True)
        self._entries.move_to_end(block_hash)
        self.num_restored += 1
        self.bytes_moved += self.bytes_per_block
        return True

    def wait_copies(self) -> None:
        """Orders the compute stream after every copy issued so far (no host wait)."""
        if self._pending is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._pending)
            self._pending = None

    @contextmanager
    def _copy_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            yield
            self._pending = torch.cuda.Event()
            self._pending.record(self._stream)

    def touch(self, block_hash: BlockHash) -> bool:
        """True if the tier holds this hash; marks it most recently used, so stores made while
        a device block is found for its restore evict other entries first."""
        if block_hash not in self._entries:
            return False
        self._entries.move_to_end(block_hash)
        return True
