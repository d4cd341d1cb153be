"""Which KV blocks each request holds: prefix-cache lookup, slot allocation, freeing.

The scheduler drives it with the one scheduling model (computed tokens catching up to owed tokens):
- admission: `get_computed_blocks(req)` finds the longest verified cached prefix, then
  `allocate_slots(req, n, hits)` takes references on the hits and allocates blocks for n more tokens;
- every later step: `allocate_slots(req, n)` grows the request's blocks for its next n tokens;
- finish, abort or preemption by recompute: `free(req)`. A preempted request is re-admitted with
  num_computed_tokens = 0 and usually hits its own cached full blocks again.

Only full blocks whose tokens are all known (in `all_token_ids`) and whose KV is written by the end
of the current step are cached. `all_token_ids` must never hold unverified draft tokens: drafts are
counted in `num_new_tokens` or `num_lookahead_tokens` only, so a block holding a draft's KV is never
cached.

A block cached in one step may be hit by another request in the same step, before its KV exists:
that is sound because every attention layer stores the whole batch's new K/V before it attends.

Invariants (`check_invariants` verifies them, with those of the block pool):
- a block's ref_cnt equals the number of requests whose block list holds it, and is never negative;
- a block is in the free queue iff its ref_cnt == 0 (the null block is neither held nor queued);
- no request holds the null block or the same block twice;
- hash-map entries point to blocks whose stored tokens hash to the entry's key;
- `allocate_slots` either succeeds or returns None having changed nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from libkk.cache.block_pool import BlockPool, KVCacheBlock
from libkk.cache.prefix_cache import BlockHash, RequestBlockHashes

if TYPE_CHECKING:
    from libkk.cache.offload import HostKVTier


class CacheRequest(Protocol):
    """What the cache needs to know of a request."""

    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]:  # prompt + generated tokens so far, no drafts
        ...


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Paged KV-cache bookkeeping for all requests over one `BlockPool`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        host_tier: HostKVTier | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Evicted cached blocks go to the host tier, and lookups that miss here ask it.
        self.host_tier = host_tier if enable_caching else None
        if self.host_tier is not None:
            tier = self.host_tier
            self.block_pool.on_evict = lambda b: tier.store(
                b.block_hash, b.parent_hash, b.token_ids, b.block_id
            )
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept in step so the scheduler gets them without copying.
        self._req_block_ids: dict[str, list[int]] = {}
        # Leading blocks of each request already offered to the hash map (cached, or found to
        # duplicate an already cached block); later steps start registering from there.
        self._num_registered: dict[str, int] = {}
        self._hashes = RequestBlockHashes(block_size)
        # Prefix-cache stats, in tokens, one lookup per admission: a waiting request that is
        # looked up again (its allocation failed) replaces its earlier, unadmitted lookup.
        self.prefix_cache_requests = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._unadmitted_lookups: dict[str, tuple[int, int]] = {}

    # -- pool-wide state ----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    # -- per-request state --------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> Sequence[KVCacheBlock]:
        """The request's blocks in position order (read-only view of the manager's list)."""
        return self._req_blocks.get(request_id, ())

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: block i holds its tokens [i*block_size, (i+1)*block_size).

        A live list owned by the manager (it grows as the request does): read it, never mutate it.
        """
        return self._req_block_ids.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._req_blocks.get(request_id, ()))

    # -- the scheduler's calls ----------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest verified cached prefix of the request's full blocks, and its token count.

        For a request holding no blocks (waiting, or preempted). The hit never covers every token:
        at most (num_tokens - 1) // block_size blocks, so at least one token is computed and the
        model produces logits. Takes no references (`allocate_slots` does). Counts the lookup in
        the prefix-cache stats, replacing this request's earlier lookup if it was not admitted.
        """
        if not self.enable_caching:
            return [], 0
        token_ids = request.all_token_ids
        hashes = self._hashes.get(request.request_id, token_ids)
        max_hit_blocks = min(len(hashes), (len(token_ids) - 1) // self.block_size)
        bs = self.block_size
        hits: list[KVCacheBlock] = []
        parent = None
        # Blocks referenced while host blocks are restored, so that taking a device block for a
        # restore cannot evict the hits found so far; released at the end.
        held: list[KVCacheBlock] = []
        # NOTE: stop at the first miss: a later block's KV depends on every earlier token.
        for i in range(max_hit_blocks):
            block_tokens = token_ids[i * bs : (i + 1) * bs]
            block = self.block_pool.get_cached_block(hashes[i], block_tokens, parent_hash=parent)
            if block is None and self.host_tier is not None:
                if not held:
                    self.block_pool.touch(hits)
                    held.extend(hits)
                block = self._restore(hashes[i], block_tokens, parent)  # referenced once
                if block is not None:
                    held.append(block)
            elif block is not None and held:
                self.block_pool.touch([block])
                held.append(block)
            if block is None:
                break
            hits.append(block)
            parent = hashes[i]
        if held:
            self.block_pool.free_blocks(reversed(held))
        num_hit_tokens = len(hits) * bs
        self._record_lookup(request.request_id, len(token_ids), num_hit_tokens)
        return hits, num_hit_tokens

    def _restore(
        self, block_hash: BlockHash, token_ids: Sequence[int], parent: BlockHash | None
    ) -> KVCacheBlock | None:
        """Copies a host-tier block into a fresh device block and caches it there (referenced
        once, for the caller); None when the tier misses or no device block is free."""
        assert self.host_tier is not None
        if self.block_pool.num_free_blocks == 0 or not self.host_tier.touch(block_hash):
            return None
        [block] = self.block_pool.get_new_blocks(1)  # may evict (and offload) another block
        restored = self.host_tier.restore(block_hash, parent, token_ids, block.block_id)
        if not restored or not self.block_pool.cache_full_block(
            block, block_hash, token_ids, parent
        ):
            self.block_pool.free_blocks([block])
            return None
        return block

    def _record_lookup(self, request_id: str, num_queried: int, num_hit: int) -> None:
        previous = self._unadmitted_lookups.get(request_id)
        if previous is not None:
            self.prefix_cache_requests -= 1
            self.prefix_cache_queries -= previous[0]
            self.prefix_cache_hits -= previous[1]
        self._unadmitted_lookups[request_id] = (num_queried, num_hit)
        self.prefix_cache_requests += 1
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Ensures blocks for num_computed_tokens + prefix hits + new + lookahead tokens.

        `new_computed_blocks` (from `get_computed_blocks`) is only for a request that holds no
        blocks and has num_computed_tokens == 0; they are referenced and become its first blocks.
        Returns the newly allocated blocks (possibly []: test the result with `is None`), or None
        when the pool cannot supply them, in which case nothing changed. Then caches every block
        that became full with known tokens whose KV is written by the end of this step.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"num_new_tokens ({num_new_tokens}) and num_lookahead_tokens "
                f"({num_lookahead_tokens}) must be >= 0"
            )
        request_id = request.request_id
        num_held = self.num_blocks_of(request_id)
        if new_computed_blocks and (num_held or request.num_computed_tokens):
            raise ValueError(
                f"request {request_id!r}: prefix hits need a request with no blocks and no computed "
                f"tokens, it holds {num_held} blocks and {request.num_computed_tokens} tokens"
            )
        if new_computed_blocks:
            self._check_hits_current(request, new_computed_blocks)
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_required = _cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs)
        num_new_blocks = max(0, num_required - num_held - len(new_computed_blocks))
        # NOTE: a hit on a free cached block takes it out of the free queue, so it cannot also be
        # handed out as a fresh block: count it against the free blocks before changing anything.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_revived:
            return None

        self._unadmitted_lookups.pop(request_id, None)
        req_blocks = self._req_blocks.setdefault(request_id, [])
        req_block_ids = self._req_block_ids.setdefault(request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            req_block_ids.extend(b.block_id for b in new_computed_blocks)
            self._num_registered[request_id] = len(new_computed_blocks)  # hits are cached already
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        req_block_ids.extend(b.block_id for b in new_blocks)

        if self.enable_caching:
            num_known = min(num_computed + num_new_tokens, len(request.all_token_ids))
            self._cache_full_blocks(request, req_blocks, num_known // bs)
        return new_blocks

    def _check_hits_current(self, request: CacheRequest, hits: Sequence[KVCacheBlock]) -> None:
        # A hit evicted and reused between lookup and allocation would serve another prefix's KV.
        hashes = self._hashes.get(request.request_id, request.all_token_ids)
        if len(hits) > len(hashes) or any(
            b.block_hash != h for b, h in zip(hits, hashes, strict=False)
        ):
            raise ValueError(
                f"request {request.request_id!r}: stale prefix hits; call get_computed_blocks "
                f"right before allocate_slots"
            )

    def free(self, request: CacheRequest) -> None:
        """Releases the request's blocks and forgets it; call it for every request that leaves.

        Blocks are released tail first, so among the request's cached blocks the tail is evicted
        before the head, which other requests are likelier to share.
        """
        self.free_request_id(request.request_id)

    def free_request_id(self, request_id: str) -> None:
        blocks = self._req_blocks.pop(request_id, None)
        self._req_block_ids.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._unadmitted_lookups.pop(request_id, None)
        self._hashes.pop(request_id)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def _cache_full_blocks(
        self, request: CacheRequest, req_blocks: list[KVCacheBlock], num_full: int
    ) -> None:
        request_id = request.request_id
        start = self._num_registered.get(request_id, 0)
        if num_full <= start:
            return
        token_ids = request.all_token_ids
        hashes = self._hashes.get(request_id, token_ids)
        bs = self.block_size
        for i in range(start, num_full):
            self.block_pool.cache_full_block(
                req_blocks[i],
                hashes[i],
                token_ids[i * bs : (i + 1) * bs],
                parent_hash=hashes[i - 1] if i else None,
            )
        self._num_registered[request_id] = num_full

    # -- checking -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError if an invariant in the module docstring is broken (tests, debug)."""
        self.block_pool.check_invariants()
        refs: Counter[int] = Counter()
        for request_id, blocks in self._req_blocks.items():
            ids = [b.block_id for b in blocks]
            if len(set(ids)) != len(ids) or any(b.is_null for b in blocks):
                raise AssertionError(f"request {request_id!r} holds a bad block list {ids}")
            if self._req_block_ids.get(request_id) != ids:
                raise AssertionError(f"request {request_id!r}: block ids out of step with blocks")
            refs.update(ids)
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{refs[block.block_id]} requests hold it"
                )
