"""The pool of paged KV-cache blocks: reference counts, an LRU free queue and the prefix-hash map.

Pure bookkeeping, no tensors. Block `i` is the run of `block_size` token slots at index `i` of
dimension 1 of every KV tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`. Where a
model's layers keep separate KV groups (docs/memory.md) a block serves one group at a time, and
cached blocks are found by (group, hash): the same tokens have different KV in each group.

Block 0 is the null block: padded rows of a batch write there, so it is never handed out, freed,
touched or cached.

A freed block keeps its KV and, if it was full and cached, stays findable by hash until it is
handed out again; handing it out evicts it. The free queue's head is taken first: free blocks with
no hash sit at the head (taking them loses nothing), then free cached blocks in the order they were
freed, least recently freed first: that is the LRU eviction order.

Invariants (`check_invariants` verifies them all):
- every ref_cnt >= 0; the null block's ref_cnt is 0 and it is never in the free queue or hash map;
- a block is in the free queue iff its ref_cnt == 0 and it is not the null block;
- in the free queue, every block without a hash comes before every block with one;
- the hash map holds `(g, h) -> block` iff `block.block_hash == h` and `block.group == g`; such a
  block stores the preimage of `h` (its parent's hash and its own token ids), against which every
  hit is verified.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from libkk.cache import prefix_cache
from libkk.cache.prefix_cache import BlockHash

NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)  # identity equality: two blocks are never "the same" by value
class KVCacheBlock:
    block_id: int
    # Number of requests using the block; 0 means it is in the pool's free queue.
    ref_cnt: int = 0
    # Set only while the block is full and registered in the hash map.
    block_hash: BlockHash | None = None
    # The preimage of block_hash (parent hash, own tokens), kept to verify hits.
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    # The KV group whose layers' KV the cached block holds (0: the only group of most models).
    group: int = 0

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def _clear_hash(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = None
        self.group = 0


class BlockPool:
    """Hands out, reference-counts and recycles KV blocks; maps chained hashes to cached blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (the null block and one more), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # NOTE: an OrderedDict keyed by block id gives O(1) pop-head, push-tail, push-head and
        # removal from the middle (a prefix hit on a free block) without hand-written links.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[tuple[int, BlockHash], KVCacheBlock] = {}
        # Called with a cached block just before it is evicted (its hash and preimage intact),
        # e.g. to keep its KV in a host tier.
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out now (free cached blocks included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Share of the usable blocks (all but the null block) held by at least one request."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be handed out) first."""
        return list(self._free)

    def get_cached_block(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None = None,
        group: int = 0,
    ) -> KVCacheBlock | None:
        """The group's cached block for this hash, if its stored preimage equals (parent_hash,
        token_ids).

        `parent_hash` is None for the first block of a sequence. Checking the whole preimage, not
        only the hash, means a hash collision can cost a miss but never serve wrong KV.
        """
        if not self.enable_caching:
            return None
        block = self._cached.get((group, block_hash))
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    # -- allocation ----------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes `num_blocks` from the free queue's head, each with ref_cnt 1 and no hash."""
        if not 0 <= num_blocks <= len(self._free):
            raise ValueError(f"cannot take {num_blocks} blocks: {len(self._free)} are free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes one more reference on each block (a prefix hit), reviving free ones."""
        for block in blocks:
            if block.is_null:
                raise ValueError("the null block cannot be touched")
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference on each block, in the given order; at 0 a block becomes free.

        A freed cached block goes to the tail (evicted last among free cached blocks); a freed block
        with no hash goes to the head, since reusing it first loses nothing.
        """
        for block in blocks:
            if block.is_null:
                raise ValueError("the null block is never freed")
            if block.ref_cnt <= 0:
                raise ValueError(
                    f"block {block.block_id} is already free (ref_cnt {block.ref_cnt})"
                )
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    # -- prefix cache --------------------------------------------------------------------------

    def cache_full_block(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None = None,
        group: int = 0,
    ) -> bool:
        """Registers a full, in-use block of a KV group under its chained hash; True if it is
        now findable.

        If another block already holds this hash (the same content computed twice concurrently,
        or a collision), the first one stays and this block remains private: False.
        """
        if not self.enable_caching:
            return False
        if block.is_null or block.ref_cnt == 0:
            raise ValueError(f"only a block in use can be cached, not block {block.block_id}")
        if block.block_hash is not None:
            if (block.group, block.block_hash) != (group, block_hash):
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return True
        if (group, block_hash) in self._cached:
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        block.group = group
        self._cached[group, block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for block in self._cached.values():
            block._clear_hash()
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block)
            del self._cached[block.group, block.block_hash]
            block._clear_hash()

    # -- checking ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError if any invariant in the module docstring is broken (tests, debug)."""

        def fail(msg: str) -> None:
            raise AssertionError(msg)

        null = self.null_block
        if null.ref_cnt != 0 or null.block_hash is not None or NULL_BLOCK_ID in self._free:
            fail("the null block was allocated, cached or queued")
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                fail(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.block_id in self._free) != (block.ref_cnt == 0):
                fail(f"block {block.block_id} (ref_cnt {block.ref_cnt}) free-queue mismatch")
            key = (block.group, block.block_hash)
            if block.block_hash is not None and self._cached.get(key) is not block:
                fail(f"block {block.block_id} has a hash the map does not point back to")
        for (group, block_hash), block in self._cached.items():
            if (block.group, block.block_hash) != (group, block_hash) or block.token_ids is None:
                fail(f"hash map entry for block {block.block_id} does not match the block")
            if prefix_cache.hash_block_tokens(block.parent_hash, block.token_ids) != block_hash:
                fail(f"block {block.block_id} stores tokens that do not hash to its key")
        seen_cached = False
        for block in self._free.values():
            if block.block_hash is not None:
                seen_cached = True
            elif seen_cached:
                fail(f"free block {block.block_id} without a hash is behind a cached one")
