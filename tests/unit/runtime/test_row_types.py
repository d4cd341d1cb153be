"""The runner declares steps of prompt tokens alone, so packed MoE layers may run their FP8
prefill kernels there and never for decode or verification rows."""

from __future__ import annotations

from libkk import SamplingParams, Session
from libkk.layers import quant_moe


def test_prefill_steps_are_declared_and_decode_steps_are_not(tiny_qwen3_dir):
    with Session(str(tiny_qwen3_dir), max_num_batched_tokens=16, progress=False) as s:
        model, seen = s.engine.model, []
        forward = model.forward

        def probe(ids, positions):
            seen.append((ids.shape[0], quant_moe._PREFILL_STEP.get()))
            return forward(ids, positions)

        model.forward = probe
        s.engine.runner.step_backends.eager.forward = probe
        prompt = list(range(2, 42))  # 40 tokens: three chunks of at most 16
        s.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [declared for _, declared in seen] == [True, True, True, False, False, False]
    assert sum(n for n, declared in seen if declared) == 40
