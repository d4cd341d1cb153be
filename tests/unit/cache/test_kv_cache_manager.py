"""KVCacheManager: allocation, prefix hits, freeing, atomic failure; KV cache sizing."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from libkk.cache import kv_cache, prefix_cache
from libkk.cache.kv_cache import (
    allocate_kv_caches,
    determine_num_blocks,
    kv_cache_bytes_per_block,
)
from libkk.cache.kv_cache_manager import KVCacheManager
from libkk.config import CacheConfig
from libkk.errors import ConfigError

BS = 4


@dataclass
class FakeRequest:
    request_id: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output


def admit(mgr: KVCacheManager, req: FakeRequest, chunk: int | None = None) -> int:
    """Looks up hits and allocates for the rest of the prompt (or `chunk` tokens); returns hits."""
    hits, num_hit = mgr.get_computed_blocks(req)
    num_new = len(req.all_token_ids) - num_hit if chunk is None else chunk
    assert mgr.allocate_slots(req, num_new, hits) is not None
    req.num_computed_tokens = num_hit + num_new
    return num_hit


def decode(mgr: KVCacheManager, req: FakeRequest, token: int) -> list[Any] | None:
    """One decode step: the sampled token joins the sequence, then its KV slot is allocated."""
    req.output.append(token)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def snapshot(mgr: KVCacheManager, request_ids: list[str]) -> tuple[Any, ...]:
    pool = mgr.block_pool
    return (
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
        {rid: list(mgr.get_block_ids(rid)) for rid in request_ids},
        mgr.num_free_blocks,
    )


# -- allocation -----------------------------------------------------------------------------------


def test_prefill_then_decode_allocates_and_caches_full_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = FakeRequest("a", list(range(10)))
    assert admit(mgr, req) == 0
    blocks = mgr.get_blocks("a")
    assert mgr.num_blocks_of("a") == 3 and mgr.num_free_blocks == 6
    assert 0 not in mgr.get_block_ids("a")
    # Blocks 0 and 1 are full and known; block 2 holds 2 tokens.
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert blocks[1].token_ids == (4, 5, 6, 7)

    assert decode(mgr, req, 100) == []  # token 10 fits in block 2
    assert blocks[2].block_hash is None
    assert decode(mgr, req, 101) == []  # token 11 fills block 2: its KV is written this step
    assert blocks[2].token_ids == (8, 9, 100, 101)
    new = decode(mgr, req, 102)
    assert new is not None and len(new) == 1 and mgr.num_blocks_of("a") == 4
    mgr.check_invariants()


def test_lookahead_blocks_are_allocated_but_never_cached() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = FakeRequest("a", list(range(3)))
    hits, _ = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, 3, hits, num_lookahead_tokens=6)
    assert new is not None and len(new) == 3  # 9 slots
    req.num_computed_tokens = 3
    assert all(b.block_hash is None for b in mgr.get_blocks("a"))  # no full known block yet
    # Drafts are not in all_token_ids: scheduling 1 + 3 drafts caches nothing past known tokens.
    req.output.append(50)
    assert mgr.allocate_slots(req, 4) == []
    assert [b.block_hash is not None for b in mgr.get_blocks("a")] == [True, False, False]
    mgr.check_invariants()


def test_allocation_failure_is_atomic() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable blocks
    a = FakeRequest("a", list(range(12)))
    admit(mgr, a)
    b = FakeRequest("b", list(range(100, 106)))
    before = snapshot(mgr, ["a", "b"])
    assert mgr.allocate_slots(b, 6) is None  # needs 2, 1 free
    assert snapshot(mgr, ["a", "b"]) == before
    a.output.append(1)
    assert mgr.allocate_slots(a, 1, num_lookahead_tokens=4) is None  # needs 2 more, 1 free
    assert snapshot(mgr, ["a", "b"]) == before
    mgr.check_invariants()


def test_hits_on_free_blocks_count_against_free_blocks() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable blocks
    a = FakeRequest("a", list(range(12)))
    admit(mgr, a)  # 3 cached blocks, 1 free
    mgr.free(a)  # all 4 free; 3 of them cached
    b = FakeRequest("b", list(range(12)) + [7, 7, 7, 7, 7, 7])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and all(h.ref_cnt == 0 for h in hits[0])  # one KV group
    before = snapshot(mgr, ["b"])
    # 2 more blocks needed, 4 free, but 3 of those are the hits themselves: only 1 is left.
    assert mgr.allocate_slots(b, 6, hits) is None
    assert snapshot(mgr, ["b"]) == before
    assert mgr.allocate_slots(b, 4, hits) is not None  # 1 more block fits exactly
    assert mgr.num_free_blocks == 0 and [h.ref_cnt for h in hits[0]] == [1, 1, 1]
    mgr.check_invariants()


def test_prefix_hits_need_a_fresh_request() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = FakeRequest("a", list(range(9)))
    admit(mgr, a)
    hits, _ = mgr.get_computed_blocks(FakeRequest("x", list(range(9))))
    with pytest.raises(ValueError, match="prefix hits need"):
        mgr.allocate_slots(a, 1, hits)


def test_stale_prefix_hits_are_refused() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    a = FakeRequest("a", list(range(9)))
    admit(mgr, a)
    mgr.free(a)
    b = FakeRequest("b", list(range(9)))
    hits, _ = mgr.get_computed_blocks(b)
    admit(mgr, FakeRequest("z", [5] * 12))  # evicts and reuses every free block
    before = snapshot(mgr, ["b", "z"])
    with pytest.raises(ValueError, match="stale prefix hits"):
        mgr.allocate_slots(b, 1, hits)
    assert snapshot(mgr, ["b", "z"]) == before


# -- prefix cache ---------------------------------------------------------------------------------


def test_shared_prefix_shares_blocks_and_survives_the_other_free() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = FakeRequest("a", list(range(9)))
    b = FakeRequest("b", list(range(8)) + [50, 51, 52])
    admit(mgr, a)
    assert admit(mgr, b) == 8
    shared = mgr.get_blocks("a")[:2]
    assert list(mgr.get_blocks("b")[:2]) == list(shared)
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    assert mgr.get_blocks("a")[2] is not mgr.get_blocks("b")[2]
    mgr.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    assert all(blk.block_id not in mgr.block_pool.free_block_ids() for blk in shared)
    assert mgr.get_block_ids("a") == [] and mgr.num_blocks_of("b") == 3
    mgr.check_invariants()


def test_never_a_hit_on_all_tokens() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    admit(mgr, FakeRequest("a", list(range(8))))  # 2 full cached blocks
    hits, n = mgr.get_computed_blocks(FakeRequest("b", list(range(8))))
    assert n == 4 and len(hits[0]) == 1  # the last token must still be computed
    _, n = mgr.get_computed_blocks(FakeRequest("c", list(range(4))))
    assert n == 0
    _, n = mgr.get_computed_blocks(FakeRequest("d", list(range(9))))
    assert n == 8


def test_same_block_after_another_prefix_is_not_a_hit() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    admit(mgr, FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    _, n = mgr.get_computed_blocks(FakeRequest("b", [0, 0, 0, 0, 5, 6, 7, 8, 9]))
    assert n == 0
    hb = prefix_cache.hash_request_blocks([0, 0, 0, 0, 5, 6, 7, 8], BS)
    assert mgr.block_pool.get_cached_block(hb[1], [5, 6, 7, 8], parent_hash=hb[0]) is None


def test_hash_collision_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, tokens: b"\x07" * 16)
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    admit(mgr, FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Every block hashes alike: a different first block must miss, the same one may hit.
    _, n = mgr.get_computed_blocks(FakeRequest("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]))
    assert n == 0
    _, n = mgr.get_computed_blocks(FakeRequest("c", [1, 2, 3, 4, 0, 0, 0, 0, 9]))
    assert n == 4
    mgr.check_invariants()


def test_hit_with_right_tokens_but_wrong_parent_is_not_a_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hash that ignores the parent: only the stored parent tells the two "X" blocks apart.
    real = prefix_cache.hash_block_tokens
    monkeypatch.setattr(
        prefix_cache, "hash_block_tokens", lambda parent, tokens: real(None, tokens)
    )
    p, q, x, y = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    admit(mgr, FakeRequest("a", p + y + [0]))
    admit(mgr, FakeRequest("c", q + x + [0]))  # caches "x after q"
    _, n = mgr.get_computed_blocks(FakeRequest("b", p + x + [0]))
    assert n == 4  # p hits; x after p is not the cached x after q


def test_free_releases_in_reverse_order() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)  # 7 usable blocks
    a = FakeRequest("a", list(range(14)))  # 3 full blocks + 2 tokens
    admit(mgr, a)
    ids = mgr.get_block_ids("a")[:]
    mgr.free(a)
    free = mgr.block_pool.free_block_ids()
    # The uncached tail block is reused first; cached blocks are evicted tail first.
    assert free[0] == ids[3]
    assert free[-3:] == [ids[2], ids[1], ids[0]]
    # A request taking all but 2 free blocks evicts a's third block and keeps its first two.
    admit(mgr, FakeRequest("z", [99] * 4 * 5))
    assert mgr.num_free_blocks == 2
    _, n = mgr.get_computed_blocks(FakeRequest("c", list(range(14))))
    assert n == 8


def test_preempted_request_hits_its_own_blocks_again() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = FakeRequest("a", list(range(10)))
    admit(mgr, req)
    for t in (100, 101, 102):
        decode(mgr, req, t)
    mgr.free(req)  # preemption by recompute
    req.num_computed_tokens = 0
    assert admit(mgr, req) == 12  # all 3 full blocks of the 13 tokens
    assert req.num_computed_tokens == 13
    mgr.check_invariants()


def test_stats_count_one_lookup_per_admission() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    admit(mgr, FakeRequest("a", list(range(9))))
    b = FakeRequest("b", list(range(8)) + [1] * 20)
    hits, n = mgr.get_computed_blocks(b)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (9 + 28, 8)
    assert mgr.allocate_slots(b, 20, hits) is None  # no room: b keeps waiting
    mgr.get_computed_blocks(b)  # looked up again next step: replaces, does not add
    assert (mgr.prefix_cache_requests, mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (
        2,
        37,
        8,
    )
    assert mgr.prefix_cache_hit_rate == pytest.approx(8 / 37)


def test_caching_disabled_never_hits() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    admit(mgr, FakeRequest("a", list(range(9))))
    assert all(b.block_hash is None for b in mgr.get_blocks("a"))
    assert admit(mgr, FakeRequest("b", list(range(9)))) == 0
    mgr.check_invariants()


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = FakeRequest("a", list(range(9)))
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(FakeRequest("b", list(range(9))))[1] == 0


# -- randomized property test ---------------------------------------------------------------------


class KVModel:
    """What each slot of the cache would hold: the full token prefix up to that position.

    A slot's KV depends on every earlier token, so a prefix hit or a shared block is right iff
    each slot below num_computed_tokens holds exactly the request's own prefix.
    """

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, req: FakeRequest, start: int, end: int) -> None:
        blocks = self.mgr.get_blocks(req.request_id)
        tokens = req.all_token_ids
        for pos in range(start, min(end, len(tokens))):
            block = blocks[pos // BS]
            assert not block.is_null
            assert block.ref_cnt == 1, "a shared (cached) block is never written again"
            self.slots[block.block_id, pos % BS] = tuple(tokens[: pos + 1])

    def check(self, req: FakeRequest) -> None:
        blocks = self.mgr.get_blocks(req.request_id)
        assert len(blocks) * BS >= req.num_computed_tokens
        tokens = req.all_token_ids
        for pos in range(req.num_computed_tokens):
            got = self.slots.get((blocks[pos // BS].block_id, pos % BS))
            assert got == tuple(tokens[: pos + 1]), f"{req.request_id} pos {pos}"

    def check_cached(self) -> None:
        for block in self.mgr.block_pool.blocks:
            if block.token_ids is not None:
                stored = [self.slots[block.block_id, i][-1] for i in range(BS)]
                assert tuple(stored) == block.token_ids


@pytest.mark.parametrize("seed", range(6))
def test_randomized_requests_keep_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    kv = KVModel(mgr)
    prefixes = [[rng.randrange(30) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    waiting: list[FakeRequest] = []
    running: list[FakeRequest] = []
    counts = {"failed": 0, "hit_tokens": 0, "finished": 0}
    all_ids: list[str] = []

    def preempt(req: FakeRequest) -> None:
        running.remove(req)
        mgr.free(req)
        req.num_computed_tokens = 0
        waiting.insert(0, req)

    for step in range(700):
        op = rng.random()
        if op < 0.15 or not (waiting or running):
            prompt = rng.choice(prefixes) + [rng.randrange(30) for _ in range(rng.randrange(0, 7))]
            waiting.append(FakeRequest(f"r{step}", prompt))
            all_ids.append(f"r{step}")
        elif op < 0.4 and waiting:
            req = waiting[0]
            hits, num_hit = mgr.get_computed_blocks(req)
            assert num_hit % BS == 0 and num_hit < len(req.all_token_ids)
            chunk = rng.randint(1, len(req.all_token_ids) - num_hit)
            before = snapshot(mgr, all_ids)
            if mgr.allocate_slots(req, chunk, hits) is None:
                assert snapshot(mgr, all_ids) == before
                counts["failed"] += 1
            else:
                waiting.pop(0)
                running.append(req)
                req.num_computed_tokens = num_hit
                kv.check(req)  # the hit blocks hold exactly this request's prefix
                counts["hit_tokens"] += num_hit
                kv.write(req, num_hit, num_hit + chunk)
                req.num_computed_tokens += chunk
        elif op < 0.9 and running:
            req = rng.choice(running)
            if req.num_computed_tokens == len(req.all_token_ids):
                req.output.append(rng.randrange(30))  # the token sampled after the last step
            start = req.num_computed_tokens
            num_new = rng.randint(1, len(req.all_token_ids) - start)
            lookahead = rng.choice([0, 0, 0, 3])
            before = snapshot(mgr, all_ids)
            if mgr.allocate_slots(req, num_new, num_lookahead_tokens=lookahead) is None:
                assert snapshot(mgr, all_ids) == before
                counts["failed"] += 1
                preempt(req)
            else:
                kv.write(req, start, start + num_new)
                req.num_computed_tokens += num_new
                if len(req.all_token_ids) > 40:
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
        held = {b for r in running for b in mgr.get_block_ids(r.request_id)}
        assert mgr.num_free_blocks + len(held) == 19  # waiting requests hold no blocks

    # The run must have exercised hits, failures and completions to mean anything.
    assert counts["failed"] > 0 and counts["hit_tokens"] > 0 and counts["finished"] > 0
    for req in running:
        mgr.free(req)
    assert mgr.num_free_blocks == 19 and mgr.usage == 0.0
    mgr.check_invariants()


# -- KV cache tensors and sizing ------------------------------------------------------------------


def test_bytes_per_block_and_allocation() -> None:
    assert kv_cache_bytes_per_block(2, 16, 4, 64, torch.float32) == 2 * 2 * 16 * 4 * 64 * 4
    assert kv_cache_bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    caches = allocate_kv_caches(3, 5, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert len(caches) == 3 and len({c.data_ptr() for c in caches}) == 3
    for c in caches:
        assert c.shape == (2, 5, 4, 2, 8) and c.dtype == torch.float32
        # The null block is zeroed: padded rows read it. Other CPU blocks are left untouched
        # (no resident memory until used).
        assert not c[:, 0].any()


MiB = 1 << 20


def test_num_gpu_blocks_is_exact() -> None:
    cfg = CacheConfig(block_size=16, num_gpu_blocks=7)
    dev = torch.device("cpu")
    assert determine_num_blocks(cfg, MiB, dev, 0, max_blocks_useful=3, max_model_len=64) == 7
    with pytest.raises(ConfigError, match="num_gpu_blocks=7 is too small"):
        determine_num_blocks(cfg, MiB, dev, 0, max_blocks_useful=100, max_model_len=200)


def test_kv_cache_memory_bytes_budget_and_caps() -> None:
    dev = torch.device("cpu")
    cfg = CacheConfig(block_size=16, kv_cache_memory_bytes=10 * MiB)
    assert determine_num_blocks(cfg, MiB, dev, 0, max_blocks_useful=1000) == 10
    assert determine_num_blocks(cfg, MiB, dev, 0, max_blocks_useful=4) == 4  # useless beyond
    assert determine_num_blocks(cfg, MiB, dev, 0, max_blocks_useful=1) == 2  # at least 2
    assert determine_num_blocks(cfg, MiB, dev, 0, max_blocks_useful=100, max_model_len=144) == 10
    with pytest.raises(ConfigError, match=r"10\.0 MiB .*max_model_len=145 needs 11 blocks"):
        determine_num_blocks(cfg, MiB, dev, 0, max_blocks_useful=100, max_model_len=145)
    tiny = CacheConfig(block_size=16, kv_cache_memory_bytes=MiB)
    with pytest.raises(ConfigError, match="the cache needs 2 blocks"):
        determine_num_blocks(tiny, MiB, dev, 0, max_blocks_useful=100)


def test_cpu_budget_reads_memavailable(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  99999999 kB\nMemAvailable:   102400 kB\n")  # 100 MiB
    monkeypatch.setattr(kv_cache, "_MEMINFO", str(meminfo))
    cfg = CacheConfig(block_size=16, gpu_memory_utilization=0.5)
    dev = torch.device("cpu")
    assert determine_num_blocks(cfg, MiB, dev, 0, max_blocks_useful=1000) == 50
    monkeypatch.setattr(kv_cache, "_MEMINFO", str(tmp_path / "missing"))
    assert kv_cache._cpu_available_bytes() > 0  # falls back to sysconf


def test_cuda_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    state = {"free": 70 * gib, "allocated": 8 * gib, "reserved": 10 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    cfg = CacheConfig(block_size=16, gpu_memory_utilization=0.5)
    dev = torch.device("cuda")
    # Weights (6 GiB) are loaded, inside the 8 GiB allocated: 40 - 8 = 32 GiB for the cache.
    assert determine_num_blocks(cfg, gib, dev, 6 * gib, max_blocks_useful=1000) == 32
    # Weights not loaded yet: 40 - 20 = 20 GiB.
    assert determine_num_blocks(cfg, gib, dev, 20 * gib, max_blocks_useful=1000) == 20
    # Another process holds most of the device: only free memory (+ our unused reserve) counts.
    state["free"] = 5 * gib
    assert determine_num_blocks(cfg, gib, dev, 6 * gib, max_blocks_useful=1000) == 7
    with pytest.raises(ConfigError, match="MiB on cuda"):
        determine_num_blocks(cfg, gib, dev, 6 * gib, max_blocks_useful=1000, max_model_len=1000)
