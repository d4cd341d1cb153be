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

KV groups (`windows`, one entry per group; docs/memory.md). Most models have one group: every
attention layer reads the request's one block table. A hybrid model (Gemma 3, gpt-oss: sliding and
full layers) keeps its layers in groups of one kind, each with its own block table per request;
the pool is shared, and a block id names one block of the group's layers. Every group's table
has the same length (entry i names positions [i*block_size, (i+1)*block_size)), so a request
takes as many new blocks in each group.

Sliding window (a group whose window is W: its layers see only keys in (p - W, p] for a query at
p). Its table needs only the blocks that hold positions from `start - W + 1` on, where `start` is
the first position the step computes. Each `allocate_slots` releases the group's leading blocks
wholly before `min(previous start, start) - W + 1` and puts the null block in their table
entries, and the kernels, which begin at the window, never read the freed entries. The previous
step's start counts until `step_finished` says that step is done: under async scheduling it is
still in flight and, if it fails, is run again from that start. From its second decode step on
(its third under async scheduling) a request thus holds at most ceil(W / block_size) + 1 blocks of
the group; at any time at most `window_blocks_per_seq(W, block_size, max_step_tokens)`. A freed
block that was cached stays findable (its KV is a function of its prefix alone) until the pool
hands it out again. A prefix hit of k blocks needs, in each full group, blocks 0 .. k - 1 and, in
each windowed group, the blocks of the window before its end (blocks k - n .. k - 1, n =
ceil((W - 1) / block_size)); entries before that are the null block.

Invariants (`check_invariants` verifies them, with those of the block pool):
- a block's ref_cnt equals the number of (request, group) tables that hold it, never negative;
- a block is in the free queue iff its ref_cnt == 0 (the null block is neither held nor queued);
- no table holds the same block twice, and no block is held in two groups; the null block only
  as a leading run of released entries, and only in a windowed group;
- every group's table of a request has the same length;
- hash-map entries point to blocks whose stored tokens hash to the entry's key, cached in the
  group of the tables that hold them;
- `allocate_slots` either succeeds or returns None having changed nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    """The most blocks a request ever holds at once in a group whose layers have a `window`,
    when no step schedules it more than `max_step_tokens` tokens: it holds positions from the
    previous step's start - window + 1 to the end of this step (at most window - 1 + 2 *
    max_step_tokens positions), and a run of n positions touches at most cdiv(n, bs) + 1 blocks.
    During decode (one token a step) this is ceil(window / block_size) + 1 or less."""
    return _cdiv(window - 1 + 2 * max_step_tokens, block_size) + 1


# A prefix hit: per KV group, the table of cached blocks it starts the request with.
PrefixHit = list[list[KVCacheBlock]]


@dataclass
class _Table:
    """One request's blocks in one KV group."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    # The same as block ids, kept in step so the scheduler gets them without copying.
    block_ids: list[int] = field(default_factory=list)
    # Leading entries released (windowed groups): the null block.
    num_released: int = 0
    # Leading blocks already offered to the hash map (cached, or found to duplicate an already
    # cached block); later steps start registering from there.
    num_registered: int = 0


class KVCacheManager:
    """Paged KV-cache bookkeeping for all requests over one `BlockPool`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        host_tier: HostKVTier | None = None,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be one or more of None or >= 1, got {list(windows)}")
        if host_tier is not None and len(windows) > 1:
            raise ValueError("a host KV tier keeps every layer of a block: one KV group only")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Per KV group, the window its layers attend within; None: they see the whole context,
        # so the group keeps every block of a request.
        self.windows = tuple(windows)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Evicted cached blocks go to the host tier, and lookups that miss here ask it.
        self.host_tier = host_tier if enable_caching else None
        if self.host_tier is not None:
            tier = self.host_tier
            self.block_pool.on_evict = lambda b: tier.store(
                b.block_hash, b.parent_hash, b.token_ids, b.block_id
            )
        self._tables: dict[str, list[_Table]] = {}
        # Windowed groups: the first position of each request's previous allocation (its step
        # may still be in flight, and is run again from there if it fails).
        self._last_start: dict[str, int] = {}
        self._hashes = RequestBlockHashes(block_size)
        # Prefix-cache stats, in tokens, one lookup per admission: a waiting request that is
        # looked up again (its allocation failed) replaces its earlier, unadmitted lookup.
        self.prefix_cache_requests = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._unadmitted_lookups: dict[str, tuple[int, int]] = {}

    # -- pool-wide state ----------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.windows)

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

    def get_blocks(self, request_id: str, group: int = 0) -> Sequence[KVCacheBlock]:
        """The request's blocks in a group, in position order (read-only view of the manager's
        list)."""
        tables = self._tables.get(request_id)
        return tables[group].blocks if tables else ()

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in a group: block i holds its tokens
        [i*block_size, (i+1)*block_size).

        A live list owned by the manager (it grows as the request does): read it, never mutate it.
        In a windowed group, releasing leading blocks replaces the list by a new one whose
        released entries are the null block (0): a list once handed out only ever grows.
        """
        tables = self._tables.get(request_id)
        return tables[group].block_ids if tables else []

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """Every group's block table (`get_block_ids`: live lists), in group order."""
        tables = self._tables.get(request_id)
        return [t.block_ids for t in tables] if tables else [[] for _ in self.windows]

    def num_blocks_of(self, request_id: str) -> int:
        """The length of the request's block table, each group's (released entries included)."""
        tables = self._tables.get(request_id)
        return len(tables[0].blocks) if tables else 0

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference on, in every group (its tables less the
        released entries)."""
        tables = self._tables.get(request_id, ())
        return sum(not b.is_null for t in tables for b in t.blocks)

    def first_needed_block(self, start: int, group: int = 0) -> int:
        """Index of the first block of a group a step computing from position `start` reads (0
        without a window): every earlier block lies wholly before the window of every query."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, start - window + 1) // self.block_size

    # -- the scheduler's calls ----------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[PrefixHit, int]:
        """The longest verified cached prefix of the request's full blocks: per group its table
        of hits, and the prefix's token count.

        For a request holding no blocks (waiting, or preempted). The hit never covers every token:
        at most (num_tokens - 1) // block_size blocks, so at least one token is computed and the
        model produces logits. Takes no references (`allocate_slots` does). Counts the lookup in
        the prefix-cache stats, replacing this request's earlier lookup if it was not admitted.
        In a windowed group, entries before the hit's window are the null block.
        """
        if not self.enable_caching:
            return [[] for _ in self.windows], 0
        token_ids = request.all_token_ids
        hashes = self._hashes.get(request.request_id, token_ids)
        max_hit_blocks = min(len(hashes), (len(token_ids) - 1) // self.block_size)
        if self.host_tier is not None:  # one group
            hits = [self._prefix_hits(token_ids, hashes, max_hit_blocks)]
        else:
            hits = self._group_hits(token_ids, hashes, max_hit_blocks)
        num_hit_tokens = len(hits[0]) * self.block_size
        for group, table in enumerate(hits):
            first = self.first_needed_block(num_hit_tokens, group)
            table[:first] = [self.block_pool.null_block] * first
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

    def _group_hits(
        self, token_ids: Sequence[int], hashes: list[BlockHash], max_hit_blocks: int
    ) -> PrefixHit:
        """The longest prefix of k blocks that every group has cached: blocks 0 .. k - 1 in a
        full group; in a windowed group blocks k - n .. k - 1 (n = max(1, ceil((W - 1) /
        block_size)), the blocks a step computing from position k * block_size reads), or
        0 .. k - 1 when k < n. Entries before a window are the null block.

        Full groups bound k from the left (a later block's KV depends on every earlier token);
        windowed groups are searched from the right, as the blocks before a window may have
        been released and evicted while those of the window are still cached: a block i missing
        rules out every k whose window holds it, so the search goes on from k = i. Each block
        taken is verified against its stored preimage; the prefix before a window is named by
        the chained hash of the window's first block."""
        bs = self.block_size
        found: list[dict[int, KVCacheBlock | None]] = [{} for _ in self.windows]

        def cached(group: int, i: int) -> KVCacheBlock | None:
            if i not in found[group]:
                found[group][i] = self.block_pool.get_cached_block(
                    hashes[i],
                    token_ids[i * bs : (i + 1) * bs],
                    parent_hash=hashes[i - 1] if i else None,
                    group=group,
                )
            return found[group][i]

        spans = [None if w is None else max(1, _cdiv(w - 1, bs)) for w in self.windows]
        k = max_hit_blocks
        for group, span in enumerate(spans):
            if span is None:
                k = next((i for i in range(k) if cached(group, i) is None), k)
        missing: int | None = 0
        while k > 0 and missing is not None:
            missing = None
            for group, span in enumerate(spans):
                if span is not None:
                    window = range(k - 1, max(k - span, 0) - 1, -1)
                    missing = next((i for i in window if cached(group, i) is None), None)
                    if missing is not None:
                        k = missing
                        break
        null = self.block_pool.null_block
        hits = []
        for group, span in enumerate(spans):
            first = 0 if span is None else max(k - span, 0)
            hits.append([null] * first + [cached(group, i) for i in range(first, k)])
        return hits  # type: ignore[return-value]  # every block after `first` was found

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
        new_computed_blocks: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Ensures blocks for num_computed_tokens + prefix hits + new + lookahead tokens in
        every group.

        `new_computed_blocks` (from `get_computed_blocks`) is only for a request that holds no
        blocks and has num_computed_tokens == 0; they are referenced and become its first blocks.
        Returns the newly allocated blocks of every group (possibly []: test the result with
        `is None`), or None when the pool cannot supply them, in which case nothing changed. Then
        caches every block that became full with known tokens whose KV is written by the end of
        this step.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"num_new_tokens ({num_new_tokens}) and num_lookahead_tokens "
                f"({num_lookahead_tokens}) must be >= 0"
            )
        request_id = request.request_id
        num_held = self.num_blocks_of(request_id)
        hit_tables = self._checked_hits(request, new_computed_blocks, num_held)
        num_hits = len(hit_tables[0])
        bs = self.block_size
        num_computed = request.num_computed_tokens + num_hits * bs
        num_required = _cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs)
        num_new_blocks = max(0, num_required - num_held - num_hits)  # in each group
        # Windowed groups: the leading blocks no step reads any more (see the module docstring).
        start = min(self._last_start.get(request_id, num_computed), num_computed)
        tables = self._tables.get(request_id) or [_Table() for _ in self.windows]
        firsts, hits, releasing = [], [], []
        for group, table in enumerate(tables):
            first = self.first_needed_block(start, group)
            group_hits = list(hit_tables[group])
            group_hits[:first] = [self.block_pool.null_block] * min(first, num_hits)
            firsts.append(first)
            hits.append(group_hits)
            releasing.append([b for b in table.blocks[table.num_released : first] if not b.is_null])
        # NOTE: a hit on a free cached block takes it out of the free queue, so it cannot also be
        # handed out as a fresh block: count it against the free blocks before changing anything.
        # A released block only this request holds is free again for the new ones.
        num_revived = sum(b.ref_cnt == 0 and not b.is_null for group in hits for b in group)
        num_freed = sum(b.ref_cnt == 1 for group in releasing for b in group)
        if num_new_blocks * self.num_groups > (
            self.block_pool.num_free_blocks - num_revived + num_freed
        ):
            return None

        self._unadmitted_lookups.pop(request_id, None)
        if any(w is not None for w in self.windows):
            self._last_start[request_id] = num_computed
        self._tables[request_id] = tables
        for table, first, group_releasing, group_hits in zip(
            tables, firsts, releasing, hits, strict=True
        ):
            self._release_and_take_hits(table, first, group_releasing, group_hits)
        # NOTE: only now, once every group's hits are referenced: a free hit of one group must
        # not be handed out as another group's fresh block.
        new_blocks: list[KVCacheBlock] = []
        for group, table in enumerate(tables):
            fresh = self.block_pool.get_new_blocks(num_new_blocks)
            table.blocks.extend(fresh)
            table.block_ids.extend(b.block_id for b in fresh)
            new_blocks.extend(fresh)
            if self.enable_caching:
                num_known = min(num_computed + num_new_tokens, len(request.all_token_ids))
                self._cache_full_blocks(request, group, table, num_known // bs)
        return new_blocks

    def _checked_hits(
        self, request: CacheRequest, hits: PrefixHit | None, num_held: int
    ) -> PrefixHit:
        """The prefix hits `allocate_slots` was given, one (maybe empty) table per group."""
        if not hits:
            return [[] for _ in self.windows]
        if len(hits) != self.num_groups:
            raise ValueError(f"prefix hits for {len(hits)} KV groups, not {self.num_groups}")
        if hits[0] and (num_held or request.num_computed_tokens):
            raise ValueError(
                f"request {request.request_id!r}: prefix hits need a request with no blocks and "
                f"no computed tokens, it holds {num_held} blocks and "
                f"{request.num_computed_tokens} tokens"
            )
        if hits[0]:
            self._check_hits_current(request, hits)
        return hits

    def _release_and_take_hits(
        self,
        table: _Table,
        first: int,
        releasing: list[KVCacheBlock],
        hits: list[KVCacheBlock],
    ) -> None:
        """Releases a group's table entries before `first` and appends its hits."""
        if first > table.num_released and table.blocks:
            # Oldest first: among them the oldest cached block is evicted first.
            self.block_pool.free_blocks(releasing)
            table.blocks[table.num_released : first] = [self.block_pool.null_block] * (
                first - table.num_released
            )
            # NOTE: a new list, not the old one changed: a table handed out only ever grows (the
            # tensor-parallel step messages send what was appended to the list last sent).
            table.block_ids = [0] * first + table.block_ids[first:]
            table.num_released = first
        if hits:
            self.block_pool.touch(b for b in hits if not b.is_null)
            table.blocks.extend(hits)
            table.block_ids.extend(b.block_id for b in hits)
            table.num_registered = len(hits)  # hits are cached already
            table.num_released = min(first, len(hits))

    def _check_hits_current(self, request: CacheRequest, hits: PrefixHit) -> None:
        # A hit evicted and reused between lookup and allocation would serve another prefix's KV.
        hashes = self._hashes.get(request.request_id, request.all_token_ids)
        for group, table in enumerate(hits):
            if len(table) > len(hashes) or any(
                (b.group, b.block_hash) != (group, h)
                for b, h in zip(table, hashes, strict=False)
                if not b.is_null
            ):
                raise ValueError(
                    f"request {request.request_id!r}: stale prefix hits; call "
                    f"get_computed_blocks right before allocate_slots"
                )

    def step_finished(self, request_id: str, start: int) -> None:
        """A step of the request that computed from position `start` has finished and will not
        run again: in windowed groups, the next allocation may release the blocks only that
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
        tables = self._tables.pop(request_id, ())
        self._last_start.pop(request_id, None)
        self._unadmitted_lookups.pop(request_id, None)
        self._hashes.pop(request_id)
        for table in tables:
            self.block_pool.free_blocks(b for b in reversed(table.blocks) if not b.is_null)

    def _cache_full_blocks(
        self, request: CacheRequest, group: int, table: _Table, num_full: int
    ) -> None:
        start = table.num_registered
        if num_full <= start:
            return
        token_ids = request.all_token_ids
        hashes = self._hashes.get(request.request_id, token_ids)
        bs = self.block_size
        for i in range(start, num_full):
            if table.blocks[i].is_null:
                continue  # released before its last token was known
            self.block_pool.cache_full_block(
                table.blocks[i],
                hashes[i],
                token_ids[i * bs : (i + 1) * bs],
                parent_hash=hashes[i - 1] if i else None,
                group=group,
            )
        table.num_registered = num_full

    # -- checking -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError if an invariant in the module docstring is broken (tests, debug)."""
        self.block_pool.check_invariants()
        refs: Counter[int] = Counter()
        held_in: dict[int, int] = {}
        for request_id, tables in self._tables.items():
            if len({len(t.blocks) for t in tables}) != 1 or len(tables) != self.num_groups:
                raise AssertionError(f"request {request_id!r}: groups' tables differ in length")
            for group, table in enumerate(tables):
                ids = [b.block_id for b in table.blocks]
                released = table.num_released
                held = ids[released:]
                if (
                    len(set(held)) != len(held)
                    or any(b.is_null for b in table.blocks[released:])
                    or any(not b.is_null for b in table.blocks[:released])
                    or (released and self.windows[group] is None)
                    or any(
                        b.block_hash is not None and b.group != group
                        for b in table.blocks[released:]
                    )
                ):
                    raise AssertionError(
                        f"request {request_id!r} holds a bad block list {ids} in group {group}"
                    )
                if table.block_ids != ids:
                    raise AssertionError(f"request {request_id!r}: block ids out of step")
                for block_id in held:
                    if held_in.setdefault(block_id, group) != group:
                        raise AssertionError(f"block {block_id} is held in two KV groups")
                refs.update(held)
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{refs[block.block_id]} requests hold it"
                )
