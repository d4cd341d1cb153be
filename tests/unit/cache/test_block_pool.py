"""BlockPool bookkeeping and the chained block hashes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from libkk.cache import prefix_cache
from libkk.cache.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from libkk.cache.prefix_cache import (
    RequestBlockHashes,
    hash_block_tokens,
    hash_request_blocks,
)


def _cache(pool: BlockPool, block: KVCacheBlock, tokens: list[int], parent: bytes | None = None):
    h = hash_block_tokens(parent, tokens)
    assert pool.cache_full_block(block, h, tokens, parent_hash=parent)
    return h


# -- hashes ---------------------------------------------------------------------------------------


def test_hash_is_pinned_and_process_independent() -> None:
    # A fixed value pins the encoding; a child process with another hash seed must agree.
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root.hex() == "0c1d8f373d78aefbd0936e4dab6dc065"
    assert hash_block_tokens(root, [5, 6, 7, 8]).hex() == "602391f7bea6bf05a77cf8de292ed122"
    code = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('pc', sys.argv[1]); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); "
        "print(m.hash_block_tokens(None, [1, 2, 3, 4]).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, prefix_cache.__file__],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == root.hex()


def test_hash_is_chained() -> None:
    tokens = [5, 6, 7, 8]
    a = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), tokens)
    b = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), tokens)
    assert a != b
    assert hash_block_tokens(None, tokens) not in (a, b)
    # The encoding separates tokens: [1, 23] and [12, 3] must differ.
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])


def test_request_block_hashes_are_incremental_and_match_from_scratch() -> None:
    cache = RequestBlockHashes(block_size=4)
    tokens = list(range(6))
    assert cache.get("r", tokens) == hash_request_blocks(tokens, 4)
    assert len(cache.get("r", tokens)) == 1  # the partial tail block has no hash
    first = cache.get("r", tokens)[0]
    tokens += list(range(100, 111))  # 17 tokens: 4 full blocks
    hashes = cache.get("r", tokens)
    assert hashes == hash_request_blocks(tokens, 4)
    assert len(hashes) == 4 and hashes[0] == first
    assert cache.get("r", tokens[:9]) == hash_request_blocks(tokens[:9], 4)  # shrink drops tail
    cache.pop("r")
    assert "r" not in cache and len(cache) == 0


# -- allocation and ref counts --------------------------------------------------------------------


def test_allocation_never_hands_out_the_null_block() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    blocks = pool.get_new_blocks(5)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4, 5]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError, match="cannot take 1 blocks"):
        pool.get_new_blocks(1)
    pool.check_invariants()
    assert pool.null_block.block_id == NULL_BLOCK_ID and pool.null_block.ref_cnt == 0


def test_free_touch_and_ref_counts() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and a.block_id not in pool.free_block_ids()
    pool.free_blocks([a, b])
    assert a.ref_cnt == 0 and b.ref_cnt == 0 and pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([a])
    assert a.ref_cnt == 0  # never negative
    with pytest.raises(ValueError, match="null block"):
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError, match="null block"):
        pool.touch([pool.null_block])
    pool.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # in use per the queue, free per the count
    with pytest.raises(AssertionError, match="free-queue mismatch"):
        pool.check_invariants()


# -- prefix cache ---------------------------------------------------------------------------------


def test_lru_eviction_order_of_free_cached_blocks() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    h1 = _cache(pool, b1, [1, 1])
    h2 = _cache(pool, b2, [2, 2])
    h3 = _cache(pool, b3, [3, 3])
    pool.free_blocks([b2, b3, b1])  # cached, freed in this order: b2 is least recently freed
    pool.free_blocks([b4])  # no hash: reused before any cached block
    assert pool.free_block_ids() == [b4.block_id, b2.block_id, b3.block_id, b1.block_id]
    assert pool.get_cached_block(h2, [2, 2]) is b2  # free blocks stay findable

    assert pool.get_new_blocks(1) == [b4]
    assert pool.num_cached_blocks == 3
    assert pool.get_new_blocks(1) == [b2]  # evicts b2 and only b2
    assert b2.block_hash is None and b2.ref_cnt == 1
    assert pool.get_cached_block(h2, [2, 2]) is None
    assert pool.get_cached_block(h3, [3, 3]) is b3
    assert pool.get_cached_block(h1, [1, 1]) is b1
    assert pool.get_new_blocks(1) == [b3]
    assert pool.get_cached_block(h1, [1, 1]) is b1
    pool.check_invariants()


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = _cache(pool, a, [7, 8])
    pool.free_blocks([a, b])
    hit = pool.get_cached_block(h, [7, 8])
    assert hit is a
    pool.touch([hit])
    assert a.ref_cnt == 1 and pool.free_block_ids() == [b.block_id]
    assert pool.get_new_blocks(1) == [b]  # a, in use again, is not handed out
    assert a.block_hash == h
    pool.check_invariants()


def test_hits_are_verified_against_tokens_and_parent() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    parent = hash_block_tokens(None, [1, 2])
    (a,) = pool.get_new_blocks(1)
    h = _cache(pool, a, [3, 4], parent=parent)
    assert pool.get_cached_block(h, [3, 4], parent_hash=parent) is a
    assert pool.get_cached_block(h, [3, 5], parent_hash=parent) is None  # collision: tokens
    assert pool.get_cached_block(h, [3, 4], parent_hash=None) is None  # collision: parent
    other = hash_block_tokens(None, [9, 9])
    assert pool.get_cached_block(h, [3, 4], parent_hash=other) is None


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = _cache(pool, a, [1, 2])
    assert not pool.cache_full_block(b, h, [1, 2])
    assert b.block_hash is None and pool.get_cached_block(h, [1, 2]) is a
    assert pool.cache_full_block(a, h, [1, 2])  # idempotent
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_full_block(a, hash_block_tokens(None, [5]), [5])
    pool.free_blocks([a, b])
    with pytest.raises(ValueError, match="only a block in use"):
        pool.cache_full_block(b, hash_block_tokens(None, [3]), [3])
    pool.check_invariants()


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    h = _cache(pool, a, [1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h, [1]) is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h, [1]) is None and a.block_hash is None
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 2
    pool.check_invariants()


def test_caching_disabled() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    assert pool.cache_full_block(a, h, [1]) is False
    assert pool.get_cached_block(h, [1]) is None and a.block_hash is None


def test_too_few_blocks_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(num_blocks=1, enable_caching=True)
