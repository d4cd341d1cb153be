"""Sliding windows in the paged KV cache, through the engine, against transformers.

A tiny random Mistral whose every layer has a window of 8 generates sequences many windows long
(block_size 4): each request holds at most ceil(8 / 4) + 1 = 3 blocks while it decodes (counted
in the block pool), its released entries point at the null block, and its greedy tokens equal
transformers' and those of the same run keeping every block, alone, batched, asynchronously
scheduled, from prefix hits whose head was evicted, and through preemption by recompute. A tiny
Gemma 3 (sliding and full layers) keeps separate KV groups: its sliding layers' groups hold a
window's worth of blocks while its full layers' group keeps every block, exact with prefix hits
and preemption.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from torch import nn

import libkk.engine.rank as rank_module
from libkk import SamplingParams, Session
from libkk.cache.kv_cache import plan_kv_groups
from libkk.cache.kv_cache_manager import KVCacheManager, window_blocks_per_seq
from libkk.errors import ConfigError
from tests.checkpoints import save_with_word_tokenizer

WINDOW, BS = 8, 4
DECODE_BOUND = -(-WINDOW // BS) + 1  # blocks a decoding request holds at most
_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=256,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
)
MISTRAL = dict(_COMMON, sliding_window=WINDOW)
GEMMA3 = dict(
    _COMMON,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=24,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
    },
)
GEN = 64
PROMPTS = [
    [(7 * i + 5) % 256 for i in range(40)],
    [(7 * i + 5) % 256 for i in range(24)] + [(11 * i + 3) % 256 for i in range(21)],
    [(13 * i + 2) % 256 for i in range(33)],
]
# Blocks of the longest sequence (its last token is never computed), all held without a window.
FULL_BLOCKS = -(-(max(map(len, PROMPTS)) + GEN - 1) // BS)
GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def _randomize(model: nn.Module, seed: int, gemma: bool) -> None:
    """Replaces HF's init so every parameter matters (Gemma: zero-centred norms, large post-norms,
    a small embedding, so the layers rather than the last token decide the next one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((float(".post_" in name) if gemma else 1.0) + 0.1 * noise)
            elif gemma:
                p.copy_((0.05 if "embed_tokens" in name else 0.2) * noise)
            else:
                p.copy_(0.1 * noise)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, tuple[Path, dict[tuple[int, ...], list[int]]]] = {}

    def get(family: str) -> tuple[Path, Any]:
        if family not in cache:
            gemma = family == "gemma3"
            config_cls = transformers.Gemma3TextConfig if gemma else transformers.MistralConfig
            config = config_cls(**(GEMMA3 if gemma else MISTRAL))
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config)
            _randomize(model, seed=7, gemma=gemma)
            path = save_with_word_tokenizer(model, tmp_path_factory.mktemp(family))
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
            cache[family] = path, _reference(hf)
        return cache[family]

    return get


def _reference(hf: nn.Module):
    """transformers' greedy continuation of a prompt (memoized: full recompute each token)."""
    memo: dict[tuple[int, ...], list[int]] = {}

    @torch.no_grad()
    def greedy(prompt: list[int], steps: int = GEN) -> list[int]:
        key = (*prompt, -steps)
        if key not in memo:
            ids = list(prompt)
            for _ in range(steps):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            memo[key] = ids[len(prompt) :]
        return memo[key]

    return greedy


def _held(mgr: KVCacheManager) -> int:
    """Blocks some request holds, counted in the block pool itself."""
    return sum(b.ref_cnt > 0 for b in mgr.block_pool.blocks)


def _run_watching(
    s: Session, prompts: list[list[int]], group: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Steps the session to the end; returns the tokens and, after each step, the most blocks a
    decoding request held in KV group `group` (one past its first decode step, whose step
    before, the prefill, may still be in flight under async scheduling)."""
    engine = s.engine
    mgr = engine.kv_cache_manager
    ids = [s.submit(p, GREEDY) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    widest = []
    while s.has_unfinished_requests():
        for out in s.step():
            tokens[out.request_id] = list(out.token_ids)
        running = engine.scheduler.running
        held = [
            sum(b != 0 for b in mgr.get_block_ids(r.request_id, group))
            for r in running
            if r.num_output_tokens >= 2
        ]
        if held:
            widest.append(max(held))
        # The pool agrees: the blocks in use are those the running requests' tables name.
        named = {
            b for r in running for table in mgr.get_block_tables(r.request_id) for b in table
        } - {0}
        assert _held(mgr) == len(named)
        mgr.check_invariants()
    return [tokens[rid] for rid in ids], widest


def test_windowed_model_holds_its_window_and_matches_hf(saved, monkeypatch) -> None:
    path, greedy = saved("mistral")
    want = [greedy(p) for p in PROMPTS]
    assert all(len(set(w)) > 8 for w in want), "degenerate reference"
    common = dict(block_size=BS, max_model_len=256, enable_prefix_caching=False)

    with Session(str(path), max_num_seqs=1, **common) as s:
        assert s.engine.kv_cache_manager.windows == (WINDOW,)
        got, widest = _run_watching(s, [PROMPTS[0]])
        assert got == want[:1]
        assert len(widest) > GEN // 2 and max(widest) <= DECODE_BOUND
    # Batched, and with async scheduling (a step in flight while the next is scheduled).
    for extra in ({}, {"async_scheduling": True}):
        with Session(str(path), **common, **extra) as s:
            got, widest = _run_watching(s, PROMPTS)
            assert got == want and max(widest) <= DECODE_BOUND
            # The table still indexes by position: the released entries are the null block.
            assert s.engine.kv_cache_manager.usage == 0.0
    # The same run keeping every block gives the same tokens, and holds the whole sequence.
    monkeypatch.setattr(
        rank_module,
        "plan_kv_groups",
        lambda windows, separate: plan_kv_groups([None] * len(windows), separate),
    )
    with Session(str(path), **common) as s:
        assert s.engine.kv_cache_manager.windows == (None,)
        got, widest = _run_watching(s, PROMPTS)
        assert got == want and max(widest) == FULL_BLOCKS


def test_released_entries_are_the_null_block(saved) -> None:
    path, _ = saved("mistral")
    with Session(str(path), block_size=BS, max_model_len=256) as s:
        mgr = s.engine.kv_cache_manager
        rid = s.submit(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        for _ in range(25):
            s.step()
        request = s.engine.scheduler.requests[rid]
        table = mgr.get_block_ids(rid)
        # The last step computed one token from `start`; its window began at start - 7.
        start = request.num_computed_tokens - 1
        first = (start - WINDOW + 1) // BS
        assert len(table) == -(-request.num_computed_tokens // BS)
        assert first > 5 and table[:first] == [0] * first and 0 not in table[first:]
        assert mgr.num_held_blocks(rid) == len(table) - first <= DECODE_BOUND
        while s.has_unfinished_requests():
            s.step()


def test_prefix_hit_after_the_head_was_evicted(saved) -> None:
    """The blocks before a finished request's last window were released first, so they are
    evicted first; a request continuing it still hits its last window, past the evicted head."""
    path, greedy = saved("mistral")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Session(
        str(path), block_size=BS, max_model_len=256, num_gpu_blocks=30, max_num_batched_tokens=32
    ) as s:
        mgr = s.engine.kv_cache_manager
        first = s.generate(PROMPTS[0], params)
        assert first.token_ids == greedy(PROMPTS[0], 24)
        # 64 tokens in 16 blocks, all cached and free; another request evicts the oldest.
        other = s.generate([(3 * i + 1) % 256 for i in range(52)], params)
        assert len(other.token_ids) == 24
        cont = PROMPTS[0] + list(first.token_ids)[:20] + [9, 9, 9]
        out = s.generate(cont, params)
        assert out.token_ids == greedy(cont, 24)
        assert out.num_cached_tokens >= 56  # past the window, from the still cached tail
        # The head is gone: a lookup that stops at the first miss would have hit nothing.
        head = mgr._hashes.get("probe", cont)[0]
        assert mgr.block_pool.get_cached_block(head, cont[:BS]) is None


def test_preemption_with_sequences_longer_than_the_window(saved) -> None:
    path, greedy = saved("mistral")
    want = [greedy(p) for p in PROMPTS]
    # Chunks of 16: a request holds at most window_blocks_per_seq(8, 4, 16) = 11 blocks, the
    # least the cache may have; a prefilling request and two decoding ones need more.
    with Session(
        str(path), block_size=BS, max_model_len=256, num_gpu_blocks=12, max_num_batched_tokens=16
    ) as s:
        got, widest = _run_watching(s, PROMPTS)
        assert got == want
        assert s.stats()["num_preemptions"] > 0 and max(widest) <= DECODE_BOUND


def test_capacity_counts_the_window(saved, tmp_path: Path) -> None:
    """A cache far smaller than one sequence of max_model_len is enough for a windowed model,
    and refused for a model with full attention."""
    path, greedy = saved("mistral")
    # Steps of at most 16 tokens: window_blocks_per_seq(8, 4, 16) = 11 blocks and the null block.
    with Session(
        str(path), block_size=BS, max_model_len=256, num_gpu_blocks=12, max_num_batched_tokens=16
    ) as s:
        assert s.engine.num_blocks == 12
        out = s.generate(PROMPTS[0], GREEDY)
        assert out.token_ids == greedy(PROMPTS[0])
    config = transformers.MistralConfig(**dict(MISTRAL, sliding_window=None))
    full = save_with_word_tokenizer(transformers.MistralForCausalLM(config), tmp_path / "full")
    with pytest.raises(ConfigError, match="num_gpu_blocks=12 is too small"):
        Session(
            str(full),
            block_size=BS,
            max_model_len=256,
            num_gpu_blocks=12,
            max_num_batched_tokens=16,
        )


def test_hybrid_model_releases_its_sliding_groups_and_stays_exact(saved) -> None:
    path, greedy = saved("gemma3")
    want = [greedy(p) for p in PROMPTS]
    assert all(len(set(w)) > 8 for w in want), "degenerate reference"
    with Session(str(path), block_size=BS, max_model_len=256) as s:
        # Layers sliding, full, sliding: groups of one layer, the two sliding ones first.
        mgr = s.engine.kv_cache_manager
        assert mgr.windows == (WINDOW, WINDOW, None)
        assert [a.kv_group for a in s.engine.model.attention_layers()] == [0, 2, 1]
        first = s.generate(PROMPTS[0], GREEDY)
        assert first.token_ids == want[0]
        for group, bound in ((0, DECODE_BOUND), (1, DECODE_BOUND), (2, FULL_BLOCKS)):
            got, widest = _run_watching(s, PROMPTS, group)  # PROMPTS[0] whole, [1] 24 hit
            assert got == want and max(widest) == bound, group
        cont = PROMPTS[0] + list(first.token_ids)[:50]
        out = s.generate(cont, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        assert out.token_ids == greedy(cont, 24) and out.num_cached_tokens >= 88
    with Session(str(path), block_size=BS, max_model_len=256, async_scheduling=True) as s:
        got, widest = _run_watching(s, PROMPTS, group=1)
        assert got == want and max(widest) == DECODE_BOUND
    # One sequence needs 32 blocks of its full group and 11 of each sliding one (steps of 16
    # tokens): 55 with the null block; two decoding requests need more than 60.
    with Session(
        str(path), block_size=BS, max_model_len=128, num_gpu_blocks=60, max_num_batched_tokens=16
    ) as s:
        got, _ = _run_watching(s, PROMPTS)
        assert got == want and s.stats()["num_preemptions"] > 0


def test_window_hit_from_the_host_tier(saved) -> None:
    """With a host tier the lookup restores from the first block on, then keeps the window."""
    path, greedy = saved("mistral")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Session(
        str(path),
        block_size=BS,
        max_model_len=256,
        num_gpu_blocks=30,
        max_num_batched_tokens=32,
        kv_offload_bytes=1 << 20,
    ) as s:
        first = s.generate(PROMPTS[0], params)
        for i in range(3):  # push every block of the first request out to the host tier
            s.generate([(5 * j + i) % 256 for j in range(60)], params)
        cont = PROMPTS[0] + list(first.token_ids)[:20] + [9, 9, 9]
        rid = s.submit(cont, params)
        s.step()
        mgr = s.engine.kv_cache_manager
        assert mgr.num_held_blocks(rid) <= window_blocks_per_seq(WINDOW, BS, 32)
        assert mgr.get_block_ids(rid)[0] == 0
        last = {}
        while s.has_unfinished_requests():
            last.update((o.request_id, o) for o in s.step())
        out = last[rid]
        assert list(out.token_ids) == greedy(cont, 24) and out.num_cached_tokens == 60
        assert s.stats()["offload_blocks_restored"] >= 2


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_speculative_verification_with_a_window(saved, family: str) -> None:
    """n-gram drafts ride on decode steps (1 + n tokens a step; rejected drafts' slots are
    written again later): still transformers' tokens, still a window's worth of blocks (in
    Gemma 3's sliding groups)."""
    path, greedy = saved(family)
    want = [greedy(p) for p in PROMPTS]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "draft_backoff": False}
    with Session(str(path), block_size=BS, max_model_len=256, speculative=spec) as s:
        got, widest = _run_watching(s, PROMPTS)  # group 0: sliding in both
        assert got == want
        assert s.stats()["spec_num_verify_steps"] > 0
        assert max(widest) <= -(-(WINDOW + 4) // BS) + 1  # the window and 1 + 4 tokens
