"""Separate KV groups (hybrid models): how layers are grouped, per-group block tables over one
pool, windowed groups releasing blocks while full groups keep them, prefix hits every group can
serve, atomic allocation, and sizing. The randomized test drives one windowed group (every layer
windowed) and hybrid layouts alike."""

from __future__ import annotations

import random

import pytest

from libkk.cache.kv_cache import kv_blocks_per_seq, plan_kv_groups
from libkk.cache.kv_cache_manager import KVCacheManager, window_blocks_per_seq
from tests.unit.cache.test_window_blocks import Req, admit, decode

BS = 4


def test_gemma3_12b_layers_form_one_full_group_and_five_sliding_ones() -> None:
    # 48 layers, every sixth one full (transformers' sliding_window_pattern 6).
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(48)]
    groups = plan_kv_groups(windows)
    assert groups.group_size == 8 and groups.windows == (1024,) * 5 + (None,)
    assert [groups.layer_groups[i] for i in (0, 4, 5, 6, 11, 47)] == [0, 0, 5, 0, 5, 5]
    # Layer j of every group uses tensor j: each tensor serves one layer of each group.
    for g in range(groups.num_groups):
        layers = [i for i in range(48) if groups.layer_groups[i] == g]
        assert [groups.layer_tensors[i] for i in layers] == list(range(8))


def test_a_kind_that_does_not_fill_its_last_group_leaves_it_short() -> None:
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # Gemma-3-1B: 22 + 4
    groups = plan_kv_groups(windows)
    assert groups.group_size == 4 and groups.windows == (512,) * 6 + (None,)
    assert sum(g == 5 for g in groups.layer_groups) == 2  # 22 = 5 * 4 + 2
    assert sorted(groups.layer_tensors) == sorted(list(range(4)) * 6 + [0, 1])


def test_one_group_when_layers_are_alike_or_groups_are_not_wanted() -> None:
    alternating = [128 if i % 2 == 0 else None for i in range(24)]  # gpt-oss
    assert plan_kv_groups(alternating).windows == (128, None)
    assert plan_kv_groups(alternating).group_size == 12
    kept = plan_kv_groups(alternating, separate=False)
    assert kept.windows == (None,) and kept.layer_tensors == tuple(range(24))
    assert plan_kv_groups([4096] * 3).windows == (4096,)
    assert plan_kv_groups([None] * 3).windows == (None,)
    assert plan_kv_groups([512, 4096], separate=False).windows == (4096,)  # the widest


def test_blocks_per_sequence_add_up_over_groups() -> None:
    groups = plan_kv_groups([None if (i + 1) % 6 == 0 else 1024 for i in range(48)])
    full = 32768 // 16
    sliding = window_blocks_per_seq(1024, 16, 512)
    assert kv_blocks_per_seq(groups, 32768, 16, 512) == full + 5 * sliding
    # KV of one 32K-token sequence in layer-blocks: 48 layers of every block before, now 8.
    assert (full + 5 * sliding) * 8 < 0.3 * full * 48


def _tables(mgr: KVCacheManager, rid: str) -> list[list[int]]:
    return [list(t) for t in mgr.get_block_tables(rid)]


def test_sliding_groups_release_while_the_full_group_keeps_every_block() -> None:
    mgr = KVCacheManager(num_blocks=64, block_size=BS, windows=(8, None))
    req = Req("a", list(range(10)))
    admit(mgr, req)
    for t in range(50):
        decode(mgr, req, 100 + t)
        sliding, full = _tables(mgr, "a")
        assert len(sliding) == len(full) == -(-req.num_computed_tokens // BS)
        assert 0 not in full
        first = (req.num_computed_tokens - 1 - 8 + 1) // BS  # the last step's window
        assert sliding[: max(first, 0)] == [0] * max(first, 0)
        assert 0 not in sliding[max(first, 0) :]
        assert set(sliding) & set(full) <= {0}  # no block serves two groups
        mgr.check_invariants()
    held_sliding = sum(b != 0 for b in mgr.get_block_ids("a", 0))
    assert held_sliding <= -(-8 // BS) + 1
    assert mgr.num_held_blocks("a") == held_sliding + len(mgr.get_block_ids("a", 1))
    mgr.free(req)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 63


def test_allocation_takes_blocks_in_every_group_or_none() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, windows=(4, None))  # 7 usable
    a = Req("a", list(range(12)))  # 3 blocks a group: 6
    admit(mgr, a)
    mgr.step_finished("a", 0)
    before = (_tables(mgr, "a"), mgr.num_free_blocks)
    a.output.extend([1, 2, 3, 4, 5])
    # Positions 12 .. 16: 2 new blocks in each group, but 1 is free and the window (from
    # position 9) releases the sliding group's blocks 0 and 1: 3 < 4, and nothing changes.
    assert mgr.allocate_slots(a, 5) is None
    assert (_tables(mgr, "a"), mgr.num_free_blocks) == before
    mgr.check_invariants()
    assert mgr.allocate_slots(a, 3) is not None  # positions 12 .. 14: 1 new block a group
    assert _tables(mgr, "a")[0][:2] == [0, 0] and mgr.num_free_blocks == 1
    mgr.check_invariants()


def test_a_prefix_hit_needs_the_full_groups_prefix_and_the_sliding_groups_window() -> None:
    mgr = KVCacheManager(num_blocks=64, block_size=BS, windows=(8, None))
    a = Req("a", list(range(30)))
    admit(mgr, a)
    for t in range(10):
        decode(mgr, a, 200 + t)
    mgr.free(a)  # every block free; the cached ones stay findable
    b = Req("b", a.all_token_ids[:37] + [7, 7])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 36  # 9 full blocks; 39 tokens, the last one always computed
    sliding, full = hits
    assert all(not blk.is_null for blk in full) and len(full) == 9
    # The sliding group needs blocks 7 and 8 (positions 29 .. 35: the window of position 36).
    assert [blk.is_null for blk in sliding] == [True] * 7 + [False] * 2
    assert all(blk.group == 0 for blk in sliding[7:]) and all(blk.group == 1 for blk in full)
    assert mgr.allocate_slots(b, 3, hits) is not None
    mgr.check_invariants()


def test_evicted_tail_of_a_sliding_group_limits_the_hit() -> None:
    """Blocks 4, 5 of the sliding group gone, 0 .. 3 cached: the longest hit is 4 blocks."""
    mgr = KVCacheManager(num_blocks=64, block_size=BS, windows=(8, None))
    a = Req("a", list(range(24)))
    admit(mgr, a)
    sliding = list(mgr.get_blocks("a", 0))
    mgr.free(a)
    pool = mgr.block_pool
    for block in sliding[4:]:  # taken by another request: their hashes go
        pool.touch([block])
        pool._evict(block)
        pool.free_blocks([block])
    hits, num_hit = mgr.get_computed_blocks(Req("b", list(range(24)) + [5]))
    assert num_hit == 16
    assert [b.is_null for b in hits[0]] == [True, True, False, False]
    assert len(hits[1]) == 4


class GroupKV:
    """What each slot would hold: (group, the token prefix up to its position). A request is
    right iff every slot its next query reads, in every group, holds its own prefix."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.slots: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}

    def write(self, req: Req, start: int, end: int) -> None:
        tokens = req.all_token_ids
        for group in range(self.mgr.num_groups):
            blocks = self.mgr.get_blocks(req.request_id, group)
            for pos in range(start, min(end, len(tokens))):
                block = blocks[pos // BS]
                assert not block.is_null and block.ref_cnt == 1
                self.slots[block.block_id, pos % BS] = (group, tuple(tokens[: pos + 1]))

    def check(self, req: Req) -> None:
        tokens = req.all_token_ids
        end = req.num_computed_tokens
        for group, window in enumerate(self.mgr.windows):
            blocks = self.mgr.get_blocks(req.request_id, group)
            lo = 0 if window is None else max(0, end - window + 1)
            for pos in range(lo, end):
                block = blocks[pos // BS]
                assert not block.is_null, f"{req.request_id} group {group} pos {pos} released"
                got = self.slots.get((block.block_id, pos % BS))
                assert got == (group, tuple(tokens[: pos + 1])), (req.request_id, group, pos)

    def check_cached(self) -> None:
        """Every cached block holds its own tokens' KV, of the group it is cached in."""
        for block in self.mgr.block_pool.blocks:
            if block.token_ids is not None:
                stored = [self.slots[block.block_id, i] for i in range(BS)]
                assert all(group == block.group for group, _ in stored)
                assert tuple(prefix[-1] for _, prefix in stored) == block.token_ids


# One windowed group (every layer windowed: Mistral), and hybrid layouts of several groups.
LAYOUTS = [(3,), (6,), (8,), (6, None), (3, 3, None), (None, 8, 5)]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("windows", LAYOUTS, ids=str)
def test_randomized_requests_keep_every_invariant(windows: tuple, seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = 16 * len(windows)
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=BS, windows=windows)
    kv = GroupKV(mgr)
    prefixes = [[rng.randrange(30) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    waiting: list[Req] = []
    running: list[Req] = []
    counts = {"failed": 0, "hit_tokens": 0, "finished": 0, "released": 0}

    def preempt(req: Req) -> None:
        running.remove(req)
        mgr.free(req)
        req.num_computed_tokens = 0
        waiting.insert(0, req)

    for step in range(800):
        op = rng.random()
        if op < 0.12 or not (waiting or running):
            prompt = rng.choice(prefixes) + [rng.randrange(30) for _ in range(rng.randrange(0, 9))]
            waiting.append(Req(f"r{step}", prompt))
        elif op < 0.35 and waiting:
            req = waiting[0]
            hits, num_hit = mgr.get_computed_blocks(req)
            chunk = rng.randint(1, min(8, len(req.all_token_ids) - num_hit))
            if mgr.allocate_slots(req, chunk, hits) is None:
                counts["failed"] += 1
                continue
            waiting.pop(0)
            running.append(req)
            req.num_computed_tokens = num_hit
            kv.check(req)  # every group's part of the hit holds exactly this prefix
            counts["hit_tokens"] += num_hit
            kv.write(req, num_hit, num_hit + chunk)
            req.num_computed_tokens += chunk
            mgr.step_finished(req.request_id, num_hit)
        elif op < 0.9 and running:
            req = rng.choice(running)
            if req.num_computed_tokens == len(req.all_token_ids):
                req.output.append(rng.randrange(30))
            start = req.num_computed_tokens
            num_new = rng.randint(1, min(6, len(req.all_token_ids) - start))
            before = ([list(t) for t in mgr.get_block_tables(req.request_id)], mgr.num_free_blocks)
            if mgr.allocate_slots(req, num_new) is None:
                after = (
                    [list(t) for t in mgr.get_block_tables(req.request_id)],
                    mgr.num_free_blocks,
                )
                assert after == before  # a refused allocation changes nothing
                counts["failed"] += 1
                preempt(req)
                continue
            counts["released"] += any(t[:1] == [0] for t in mgr.get_block_tables(req.request_id))
            kv.check(req)
            kv.write(req, start, start + num_new)
            req.num_computed_tokens += num_new
            mgr.step_finished(req.request_id, start)
            for group, window in enumerate(windows):
                held = sum(b != 0 for b in mgr.get_block_ids(req.request_id, group))
                if window is not None:
                    assert held <= window_blocks_per_seq(window, BS, 8)
            if len(req.all_token_ids) > 60:
                running.remove(req)
                mgr.free(req)
                counts["finished"] += 1
        elif running:
            req = rng.choice(running)
            if rng.random() < 0.5:
                preempt(req)
            else:
                running.remove(req)
                mgr.free(req)
                counts["finished"] += 1

        mgr.check_invariants()
        kv.check_cached()
        for req in running:
            kv.check(req)
        in_use = {b for r in running for t in mgr.get_block_tables(r.request_id) for b in t} - {0}
        assert mgr.num_free_blocks + len(in_use) == num_blocks - 1

    assert counts["failed"] and counts["hit_tokens"] and counts["finished"] and counts["released"]
    for req in running:
        mgr.free(req)
    assert mgr.num_free_blocks == num_blocks - 1


def test_a_host_tier_takes_one_group_only() -> None:
    with pytest.raises(ValueError, match="one KV group"):
        KVCacheManager(num_blocks=8, block_size=BS, host_tier=object(), windows=(4, None))  # type: ignore[arg-type]
