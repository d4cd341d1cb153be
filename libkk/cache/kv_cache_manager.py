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

Sliding window (`sliding_window=W`: every attention layer of the model sees only keys in
(p - W, p] for a query at p). A request then needs only the blocks that hold positions from
`start - W + 1` on, where `start` is the first position its step computes. Each `allocate_slots`
releases the request's leading blocks wholly before `min(previous start, start) - W + 1` and
puts the null block in their table entries, so block i still holds positions
[i*block_size, (i+1)*block_size) and the kernels, which begin at the window, never read the
freed entries. The previous step's start counts until `step_finished` says that step is done:
under async scheduling it is still in flight and, if it fails, is run again from that start.
From its second decode step on (its third under async scheduling) a request thus holds at most
ceil(W / block_size) + 1 blocks; at any time at most
`window_blocks_per_seq(W, block_size, max_step_tokens)`. A freed block that was cached stays
findable (its KV is a function of its prefix alone) until the pool hands it out again. A prefix
hit needs only the cached blocks of the window before its end: `get_computed_blocks` finds the
longest prefix whose last ceil((W - 1) / block_size) blocks are cached (earlier blocks may be
gone) and returns the null block for the ones before them. Hybrid models (some layers with full
attention) keep every block: pass no window.

Invariants (`check_invariants` verifies them, with those of the block pool):
- a block's ref_cnt equals the number of requests whose block list holds it, and is never negative;
- a block is in the free queue iff its ref_cnt == 0 (the null block is neither held nor queued);
- no request holds the same block twice; the null block only as a leading run of released
  entries, and only with a sliding window;
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


def window_blocks_per_seq(window: int, block_size: int, max_step_tokens: int) -> int:
    """The most blocks a request of a model whose every layer has a `window` ever holds at once,
    when no step schedules it more than `max_step_tokens` tokens: it holds positions from the
    previous step's start - window + 1 to the end of this step (at most window - 1 + 2 *
    max_step_tokens positions), and a run of n positions touches at most cdiv(n, bs) + 1 blocks.
    During decode (one token a step) this is ceil(window / block_size) + 1 or less."""
    return _cdiv(window - 1 + 2 * max_step_tokens, block_size) + 1


class KVCacheManager:
    """Paged KV-cache bookkeeping for all requests over one `BlockPool`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        host_tier: HostKVTier | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The window every attention layer attends within; None: some layer sees the whole
        # context, so every block of a request is kept.
        self.sliding_window = sliding_window
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
        # Sliding window: the first position of each request's previous allocation (its step may
        # still be in flight, and is run again from there if it fails).
        self._last_start: dict[str, int] = {}
        # Sliding window: how many leading entries of each request's table are released.
        self._num_released: dict[str, int] = {}
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
        With a sliding window, releasing leading blocks replaces the list by a new one whose
        released entries are the null block (0): a list once handed out only ever grows.
        """
        return self._req_block_ids.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        """The length of the request's block table (released leading entries included)."""
        return len(self._req_blocks.get(request_id, ()))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference on (its table less the released entries)."""
        return sum(not b.is_null for b in self._req_blocks.get(request_id, ()))

    def first_needed_block(self, start: int) -> int:
        """Index of the first block a step computing from position `start` reads (0 without a
        sliding window): every earlier block lies wholly before the window of every query."""
        if self.sliding_window is None:
            return 0
        return max(0, start - self.sliding_window + 1) // self.block_size

    # -- the scheduler's calls ----------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest verified cached prefix of the request's full blocks, and its token count.

        For a request holding no blocks (waiting, or preempted). The hit never covers every token:
        at most (num_tokens - 1) // block_size blocks, so at least one token is computed and the
        model produces logits. Takes no references (`allocate_slots` does). Counts the lookup in
        the prefix-cache stats, replacing this request's earlier lookup if it was not admitted.
        With a sliding window, entries before the hit's window are the null block.
        """
        if not self.enable_caching:
            return [], 0
        token_ids = request.all_token_ids
        hashes = self._hashes.get(request.request_id, token_ids)
        max_hit_blocks = min(len(hashes), (len(token_ids) - 1) // self.block_size)
        if self.sliding_window is not None and self.host_tier is None:
            hits = self._window_hits(token_ids, hashes, max_hit_blocks)
        else:
            hits = self._prefix_hits(token_ids, hashes, max_hit_blocks)
        num_hit_tokens = len(hits) * self.block_size
        first = self.first_needed_block(num_hit_tokens)
        hits[:first] = [self.block_pool.null_block] * first
        self._record_lookup(request.request_id, len(token_ids), num_hit_tokens)
        return hits, num_hit_tokens

    def _prefix_hits(
        self, token_ids: Sequence[int], hashes: list[BlockHash], max_hit_blocks: int
    ) -> list[KVCacheBlock]:
        """Every block of the longest cached prefix, from the device pool or the host tier."""
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
        return hits

    def _window_hits(
        self, token_ids: Sequence[int], hashes: list[BlockHash], max_hit_blocks: int
    ) -> list[KVCacheBlock]:
        """The longest prefix of k blocks whose window is cached, for a sliding-window model:
        blocks k - n .. k - 1 (n = ceil((W - 1) / block_size), the blocks a step computing from
        position k * block_size reads), or blocks 0 .. k - 1 when k < n. Entries before the
        window are the null block. Searched from the right, as the blocks before a window may
        have been released and evicted while those of the window are still cached.

        Each block taken is verified against its stored preimage; the prefix before the window
        is named by the chained hash of the window's first block."""
        assert self.sliding_window is not None
        bs = self.block_size
        need = max(1, _cdiv(self.sliding_window - 1, bs))
        run: list[KVCacheBlock] = []  # consecutive cached blocks, right to left
        for i in range(max_hit_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(
                hashes[i],
                token_ids[i * bs : (i + 1) * bs],
                parent_hash=hashes[i - 1] if i else None,
            )
            if block is None:
                run.clear()
                continue
            run.append(block)
            if len(run) == need:
                return [self.block_pool.null_block] * i + run[::-1]
        return run[::-1]  # a run from block 0, shorter than a window

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
        # Sliding window: the leading blocks no step reads any more (see the module docstring).
        first = self.first_needed_block(
            min(self._last_start.get(request_id, num_computed), num_computed)
        )
        hits = list(new_computed_blocks)
        hits[:first] = [self.block_pool.null_block] * min(first, len(hits))
        num_released = self._num_released.get(request_id, 0)
        req_blocks = self._req_blocks.get(request_id, [])
        releasing = [b for b in req_blocks[num_released:first] if not b.is_null]
        # NOTE: a hit on a free cached block takes it out of the free queue, so it cannot also be
        # handed out as a fresh block: count it against the free blocks before changing anything.
        # A released block only this request holds is free again for the new ones.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
        num_freed = sum(1 for b in releasing if b.ref_cnt == 1)
        if num_new_blocks > self.block_pool.num_free_blocks - num_revived + num_freed:
            return None

        self._unadmitted_lookups.pop(request_id, None)
        if self.sliding_window is not None:
            self._last_start[request_id] = num_computed
        req_blocks = self._req_blocks.setdefault(request_id, [])
        req_block_ids = self._req_block_ids.setdefault(request_id, [])
        if first > num_released and req_blocks:
            # Oldest first: among them the oldest cached block is evicted first.
            self.block_pool.free_blocks(releasing)
            req_blocks[num_released:first] = [self.block_pool.null_block] * (first - num_released)
            # NOTE: a new list, not the old one changed: a table handed out only ever grows (the
            # tensor-parallel step messages send what was appended to the list last sent).
            req_block_ids = self._req_block_ids[request_id] = [0] * first + req_block_ids[first:]
            self._num_released[request_id] = first
        if hits:
            self.block_pool.touch(b for b in hits if not b.is_null)
            req_blocks.extend(hits)
            req_block_ids.extend(b.block_id for b in hits)
            self._num_registered[request_id] = len(hits)  # hits are cached already
            self._num_released[request_id] = min(first, len(hits))
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
            b.block_hash != h for b, h in zip(hits, hashes, strict=False) if not b.is_null
        ):
            raise ValueError(
                f"request {request.request_id!r}: stale prefix hits; call get_computed_blocks "
                f"right before allocate_slots"
            )

    def step_finished(self, request_id: str, start: int) -> None:
        """A step of the request that computed from position `start` has finished and will not
        run again: with a sliding window, the next allocation may release the blocks only that
        step read."""
        if self._last_start.get(request_id) == start:
            del self._last_start[request_id]

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
        self._num_released.pop(request_id, None)
        self._last_start.pop(request_id, None)
        self._unadmitted_lookups.pop(request_id, None)
        self._hashes.pop(request_id)
        if blocks:
            self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)

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
            if req_blocks[i].is_null:
                continue  # released before its last token was known
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
            released = self._num_released.get(request_id, 0)
            held = ids[released:]
            if (
                len(set(held)) != len(held)
                or any(b.is_null for b in blocks[released:])
                or any(not b.is_null for b in blocks[:released])
                or (released and self.sliding_window is None)
            ):
                raise AssertionError(f"request {request_id!r} holds a bad block list {ids}")
            if self._req_block_ids.get(request_id) != ids:
                raise AssertionError(f"request {request_id!r}: block ids out of step with blocks")
            refs.update(held)
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{refs[block.block_id]} requests hold it"
                )
