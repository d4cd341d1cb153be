"""Invariants the engine relies on: how a request is batched, chunked, cached or preempted never
changes its tokens."""

from __future__ import annotations

import random

import pytest
from e2e_prompts import PROMPTS

from libkk import SamplingParams, Session

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Each prompt run alone, one at a time, with a roomy cache and no prefix caching."""
    with Session(str(tiny_llama_dir), max_num_seqs=1, enable_prefix_caching=False) as s:
        return {
            name: [s.generate(p, params).token_ids for p in PROMPTS]
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))
        }


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_alone_equals_batch_of_eight(tiny_llama_dir, reference, mode):
    params = GREEDY if mode == "greedy" else SEEDED
    with Session(str(tiny_llama_dir), enable_prefix_caching=False) as s:
        outs = s.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == reference[mode]


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_chunked_prefill_equals_unchunked(tiny_llama_dir, reference, mode):
    params = GREEDY if mode == "greedy" else SEEDED
    with Session(str(tiny_llama_dir), max_num_batched_tokens=7, enable_prefix_caching=False) as s:
        outs = s.generate(PROMPTS, params)
        assert s.engine.num_steps > 30  # the prompts really were cut into chunks
    assert [o.token_ids for o in outs] == reference[mode]


def test_prefix_cache_hit_equals_fresh(tiny_llama_dir, reference):
    with Session(str(tiny_llama_dir), block_size=4) as s:
        first = s.generate(PROMPTS, GREEDY)
        again = s.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == reference["greedy"]
    assert [o.token_ids for o in again] == reference["greedy"]
    assert all(o.num_cached_tokens == 0 for o in first[:1])
    assert sum(o.num_cached_tokens for o in again) > 0.5 * sum(
        len(o.prompt_token_ids) for o in again
    )


def test_preempted_equals_never_preempted(tiny_llama_dir, reference):
    # 32 usable blocks of 4 tokens: one full-length sequence, far less than 8 requests need.
    with Session(
        str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=33,
        max_model_len=128,
        enable_prefix_caching=False,
    ) as s:
        outs = s.generate(PROMPTS, SEEDED)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == reference["seeded"]


def test_seeded_sampling_reproducible_and_seed_sensitive(tiny_llama_dir):
    with Session(str(tiny_llama_dir)) as s:
        a = s.generate(PROMPTS[0], SEEDED).token_ids
        b = s.generate(PROMPTS[0], SEEDED).token_ids
        other = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
        c = s.generate(PROMPTS[0], other).token_ids
    assert a == b
    assert a != c


def test_load_500_random_requests_through_a_small_pool(tiny_llama_dir):
    rng = random.Random(0)
    vocab = 49152
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(500)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 12),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            ignore_eos=True,
        )
        for i in range(500)
    ]
    with Session(
        str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=40,
        max_model_len=128,
        max_num_seqs=32,
        max_num_batched_tokens=64,
    ) as s:
        outs = s.generate(prompts, params)
        assert not s.has_unfinished_requests()
        assert s.engine.kv_cache_manager.num_free_blocks == 39
    assert len(outs) == 500
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert sum(o.num_preemptions for o in outs) > 0
    # A sample of them, run alone, gives the same tokens.
    with Session(str(tiny_llama_dir), max_num_seqs=1, enable_prefix_caching=False) as s:
        for i in range(0, 500, 25):
            assert s.generate(prompts[i], params[i]).token_ids == outs[i].token_ids
