"""KVCacheManager with a sliding window: leading blocks released, window prefix hits, bounds."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from libkk.cache.kv_cache_manager import KVCacheManager, window_blocks_per_seq

BS = 4


@dataclass
class Req:
    request_id: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output


def admit(mgr: KVCacheManager, req: Req, chunk: int | None = None) -> int:
    hits, num_hit = mgr.get_computed_blocks(req)
    num_new = len(req.all_token_ids) - num_hit if chunk is None else chunk
    assert mgr.allocate_slots(req, num_new, hits) is not None
    req.num_computed_tokens = num_hit + num_new
    return num_hit


def decode(mgr: KVCacheManager, req: Req, token: int) -> None:
    """One synchronous decode step: scheduled, run, finished."""
    req.output.append(token)
    start = req.num_computed_tokens
    assert mgr.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1
    mgr.step_finished(req.request_id, start)


def held(mgr: KVCacheManager) -> int:
    return sum(b.ref_cnt > 0 for b in mgr.block_pool.blocks)


@pytest.mark.parametrize("window", [1, 5, 8, 9])
def test_decode_holds_at_most_the_window(window: int) -> None:
    mgr = KVCacheManager(num_blocks=40, block_size=BS, windows=(window,))
    req = Req("a", list(range(30)))
    admit(mgr, req)
    mgr.step_finished("a", 0)
    bound = -(-window // BS) + 1
    for t in range(200):
        decode(mgr, req, t)
        assert held(mgr) == mgr.num_held_blocks("a") <= bound
        table = mgr.get_block_ids("a")
        # Block i still holds positions [i*BS, (i+1)*BS): the table covers every computed token,
        # the entries before the window are the null block, those of the window are real.
        assert len(table) == -(-req.num_computed_tokens // BS)
        first = max(0, req.num_computed_tokens - window) // BS  # the next query's window
        assert set(table[:first]) <= {0} and 0 not in table[first:]
        mgr.check_invariants()
    mgr.free(req)
    assert held(mgr) == 0
    mgr.check_invariants()


def test_without_a_window_every_block_is_kept() -> None:
    mgr = KVCacheManager(num_blocks=80, block_size=BS)
    req = Req("a", list(range(30)))
    admit(mgr, req)
    for t in range(100):
        decode(mgr, req, t)
    assert mgr.num_held_blocks("a") == -(-129 // BS) and 0 not in mgr.get_block_ids("a")


def test_a_step_in_flight_keeps_its_window() -> None:
    """Until a step is finished, the blocks its start needs stay (it may be run again)."""
    mgr = KVCacheManager(num_blocks=40, block_size=BS, windows=(8,))
    req = Req("a", list(range(40)))
    admit(mgr, req)  # the prefill, computing from 0, is in flight
    req.output.append(7)
    assert mgr.allocate_slots(req, 1) is not None  # the next step is scheduled meanwhile
    assert mgr.num_held_blocks("a") == 11  # position 0 is still needed by the prefill
    mgr.step_finished("a", 0)
    req.num_computed_tokens += 1
    req.output.append(8)
    assert mgr.allocate_slots(req, 1) is not None
    # From the first decode step's start (40) on: positions 33.. -> blocks 8 to 10.
    assert mgr.get_block_ids("a")[:8] == [0] * 8 and mgr.num_held_blocks("a") == 3


def test_released_table_is_a_new_list() -> None:
    """The tensor-parallel step messages send what was appended to the list last sent."""
    mgr = KVCacheManager(num_blocks=40, block_size=BS, windows=(4,))
    req = Req("a", list(range(8)))
    admit(mgr, req)
    mgr.step_finished("a", 0)
    before = mgr.get_block_ids("a")
    snapshot = list(before)
    decode(mgr, req, 1)
    after = mgr.get_block_ids("a")
    assert after is not before and before == snapshot and after[0] == 0


def test_released_cached_blocks_stay_findable_until_reused() -> None:
    mgr = KVCacheManager(num_blocks=40, block_size=BS, windows=(8,))
    req = Req("a", list(range(20)))
    admit(mgr, req)
    mgr.step_finished("a", 0)
    decode(mgr, req, 99)
    assert mgr.get_block_ids("a")[:3] == [0, 0, 0] and mgr.num_held_blocks("a") == 3
    # A request sharing the first 12 tokens: blocks 1 and 2 hold its window (position 12 sees
    # 5..12), still cached though released.
    other = Req("b", list(range(12)) + [5, 5])
    hits, n = mgr.get_computed_blocks(other)
    table = hits[0]  # one KV group
    assert n == 12 and table[0].is_null and not table[1].is_null and not table[2].is_null
    assert mgr.allocate_slots(other, 2, hits) is not None
    assert mgr.get_block_ids("b")[0] == 0
    mgr.check_invariants()


def test_window_hit_past_an_evicted_head() -> None:
    """A lookup that stopped at the first miss would find nothing: block 0 was evicted."""
    mgr = KVCacheManager(num_blocks=12, block_size=BS, windows=(8,))
    a = Req("a", list(range(32)))
    admit(mgr, a, chunk=16)
    mgr.step_finished("a", 0)
    assert mgr.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 32
    mgr.step_finished("a", 16)
    decode(mgr, a, 1)  # releases blocks 0..5, oldest first (oldest evicted first)
    mgr.free(a)
    z = Req("z", [77] * 20)
    admit(mgr, z)  # 5 blocks: the 3 holding no full block first, then a's blocks 0 and 1
    probe = Req("p", list(range(32)) + [5])
    hashes = mgr._hashes.get("p", probe.all_token_ids)
    assert mgr.block_pool.get_cached_block(hashes[0], list(range(4))) is None
    hits, n = mgr.get_computed_blocks(probe)
    assert n == 32  # needs blocks 6 and 7 (position 32 sees 25..32) and they are cached
    assert all(h.is_null for h in hits[0][:6]) and not any(h.is_null for h in hits[0][6:])
    assert mgr.allocate_slots(probe, 1, hits) is not None
    mgr.check_invariants()


def test_window_hit_is_cut_where_the_window_is_missing() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS, windows=(8,))
    a = Req("a", list(range(24)))
    admit(mgr, a)
    mgr.free(a)
    # Evict block 4 only (positions 16..19): a hit may end at block 4 at most (blocks 2, 3).
    hashes = mgr._hashes.get("x", list(range(24)))
    block4 = mgr.block_pool.get_cached_block(hashes[4], list(range(16, 20)), hashes[3])
    assert block4 is not None
    mgr.block_pool.touch([block4])
    mgr.block_pool._evict(block4)
    mgr.block_pool.free_blocks([block4])
    _, n = mgr.get_computed_blocks(Req("b", list(range(24)) + [3]))
    assert n == 16


def test_allocation_failure_with_a_window_is_atomic() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS, windows=(4,))  # 5 usable
    a = Req("a", list(range(12)))
    admit(mgr, a)
    mgr.step_finished("a", 0)
    b = Req("b", list(range(100, 108)))
    admit(mgr, b)  # 2 blocks: none is free now
    state = (mgr.block_pool.free_block_ids(), list(mgr.get_block_ids("a")))
    # 12 more tokens for a: releasing blocks 0 and 1 frees only 2 of the 3 it needs.
    a.output.extend([1] * 12)
    assert mgr.allocate_slots(a, 13) is None
    assert (mgr.block_pool.free_block_ids(), list(mgr.get_block_ids("a"))) == state
    # One token fits once its released blocks are counted: none was free before.
    assert mgr.allocate_slots(a, 1) is not None
    mgr.check_invariants()


def test_window_blocks_per_seq() -> None:
    assert window_blocks_per_seq(8, 4, 1) == 4  # decode with a step of slack: 9 positions
    assert window_blocks_per_seq(4096, 16, 2048) == 513
    with pytest.raises(ValueError, match="windows"):
        KVCacheManager(num_blocks=4, block_size=BS, windows=(0,))
