"""The host tier of the KV cache: prefix blocks evicted from the device pool come back from RAM
with the same tokens as a fresh run."""

from __future__ import annotations

import pytest
import torch

from libkk import ConfigError, SamplingParams, Session
from libkk.cache.kv_cache_manager import KVCacheManager
from libkk.cache.offload import HostKVTier, _runs

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = "In the beginning the universe was created. This has made a lot of people very angry " * 2


def test_evicted_blocks_are_restored_bit_exact():
    # 1 layer, 6 blocks of 2 slots; fill every block with its own id, evict, restore elsewhere.
    cache = torch.arange(6.0).view(1, 6, 1, 1, 1).expand(2, 6, 2, 1, 1).contiguous()
    tier = HostKVTier([cache], num_host_blocks=8)
    kv = KVCacheManager(6, 2, enable_caching=True, host_tier=tier)

    class Req:
        def __init__(self, rid, tokens):
            self.request_id, self.all_token_ids, self.num_computed_tokens = rid, tokens, 0

    a = Req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5) is not None
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    b = Req("b", list(range(100, 110)))  # takes all 5 blocks: a's two full blocks are evicted
    assert kv.allocate_slots(b, 10) is not None
    assert tier.num_stored == 2  # a's two full blocks (its partial third was never cached)
    kv.free(b)
    tier.flush()  # as the engine does before a forward: the bytes move now
    cache.zero_()  # the device copy is gone: only the host tier still has a's K/V
    hits, num_tokens = kv.get_computed_blocks(Req("a2", [1, 2, 3, 4, 5]))
    assert num_tokens == 4 and tier.num_restored == 2
    tier.flush()
    for hit, original in zip(hits[0], a_blocks[:2], strict=True):
        assert torch.equal(cache[:, hit.block_id], torch.full((2, 2, 1, 1), float(original)))
    kv.block_pool.check_invariants()


def test_batched_copies_across_rounds_and_layer_layouts(monkeypatch):
    # Two layers of different dtypes and shapes; a staging buffer of 3 blocks, so 7 stores and 7
    # restores take several rounds; stores fill adjacent host blocks (one copy per run), restores
    # come in reverse order (one copy per block).
    g = torch.Generator().manual_seed(0)
    caches = [
        torch.randn(2, 10, 4, 2, 8, generator=g),
        torch.randn(2, 10, 4, 1, 4, generator=g).half(),
    ]
    bytes_per_block = sum(c[:, 0].numel() * c.element_size() for c in caches)
    monkeypatch.setattr(HostKVTier, "STAGING_BYTES", 3 * bytes_per_block)
    tier = HostKVTier(caches, num_host_blocks=12)
    assert len(tier._staging) == 3
    assert list(_runs([0, 1, 2, 5, 4, 5])) == [(0, 3, 0), (3, 4, 5), (4, 6, 4)]
    original = [c.clone() for c in caches]
    sources = [9, 0, 3, 4, 5, 7, 1]
    for i, block in enumerate(sources):
        tier.store(("h", i), None, (i,), block)
    tier.flush()
    for c in caches:
        c.zero_()
    targets = [2, 8, 6, 0, 1, 3, 5]
    for i, block in reversed(list(enumerate(targets))):
        assert tier.restore(("h", i), None, (i,), block)
    tier.flush()
    for c, o in zip(caches, original, strict=True):
        for source, target in zip(sources, targets, strict=True):
            assert torch.equal(c[:, target], o[:, source])
        assert not c[:, [4, 7, 9]].any()  # blocks nothing was restored into stay untouched


def test_prefix_from_the_host_tier_equals_a_fresh_run(tiny_llama_dir):
    others = [
        f"Unrelated prompt number {i} about something else entirely, with enough words to fill "
        f"several blocks of the small device pool {i}"
        for i in range(12)
    ]
    with Session(str(tiny_llama_dir), enable_prefix_caching=False) as s:
        fresh = s.generate(LONG, GREEDY).token_ids
    # A device pool that holds about one sequence: the others push LONG's blocks out to RAM.
    with Session(str(tiny_llama_dir), block_size=4, num_gpu_blocks=40, max_model_len=128,
                 kv_offload_bytes=8 << 20) as s:  # fmt: skip
        assert s.generate(LONG, GREEDY).token_ids == fresh
        s.generate(others, GREEDY)
        again = s.generate(LONG, GREEDY)
        stats = s.stats()
    assert again.token_ids == fresh
    assert again.num_cached_tokens >= 16
    assert stats["offload_blocks_restored"] >= 4 and stats["offload_bytes_moved"] > 0


def test_a_small_host_tier_loses_nothing(tiny_llama_dir):
    prompts = [f"Variant {i}: {LONG}" for i in range(5)]  # distinct from the first block on
    with Session(str(tiny_llama_dir), enable_prefix_caching=False) as s:
        fresh = [o.token_ids for o in s.generate(prompts, GREEDY)]
    # Room for a few blocks only: the tier itself evicts, requests still finish unchanged.
    with Session(str(tiny_llama_dir), block_size=4, num_gpu_blocks=40, max_model_len=128,
                 kv_offload_bytes=3 * 2048) as s:  # 3 blocks of 2 KiB  # fmt: skip
        for _ in range(2):
            assert [o.token_ids for o in s.generate(prompts, GREEDY)] == fresh
        assert len(s.engine.host_tier) == s.engine.host_tier.num_host_blocks == 3
        assert s.stats()["offload_blocks_stored"] > 3  # the tier evicted its own LRU blocks


def test_offload_settings_are_checked(tiny_llama_dir):
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        Session(str(tiny_llama_dir), kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="holds no KV block"):
        Session(str(tiny_llama_dir), kv_offload_bytes=1)
