"""kv_cache_dtype="fp8": the cache holds float8_e4m3fn at a quarter of fp32's bytes, and the real
default model still answers from it."""

from __future__ import annotations

import torch

from libkk import SamplingParams, Session


def test_fp8_cache_quarter_bytes_and_same_answer(default_model_dir):
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
    with Session(num_gpu_blocks=64, max_model_len=256) as s:
        full = s.generate(prompt, params)
        full_bytes = s.engine.kv_cache_bytes
    with Session(num_gpu_blocks=64, max_model_len=256, kv_cache_dtype="fp8") as s:
        assert s.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        fp8 = s.generate(prompt, params)
        assert s.engine.kv_cache_bytes * 4 == full_bytes
    assert fp8.text.startswith(" Paris") and full.text.startswith(" Paris")
    # e4m3 keeps 3 mantissa bits: the answer's log-probability moves, but only a little.
    assert abs(full.logprobs[0].logprob - fp8.logprobs[0].logprob) < 0.5
