"""Several CUDA sessions in one process, stepped from their own threads at once, with compiled
forwards and CUDA graphs: each request's tokens equal the same session's alone. Sessions of one
model share the compiled forward; graphs and KV caches are each their own."""

from __future__ import annotations

import threading

import pytest
import torch

from libkk import SamplingParams, Session

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8], [9, 10], list(range(20, 60)), [3] * 17]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
]


def _run(session: Session) -> list[list[int]]:
    outs = session.generate([p for p in PROMPTS for _ in PARAMS], PARAMS * len(PROMPTS))
    return [o.token_ids for o in outs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("capture", ["startup", "lazy"])
def test_graph_sessions_in_threads_equal_each_alone(tiny_qwen3_dir, tiny_moe_dirs, capture):
    """Lazy: uncompiled forwards whose graphs are captured as steps first need them, so the
    sessions stepped from the threads (the last two never ran alone) capture while the others
    run."""
    # Two models with no downloaded tokenizer (the GPU machine has none): dense and MoE.
    dirs = [tiny_qwen3_dir, tiny_moe_dirs["bf"], tiny_qwen3_dir, tiny_moe_dirs["bf"]]
    settings = dict(device="cuda", max_model_len=256, max_num_seqs=8, torch_compile=True)
    if capture == "lazy":
        settings |= dict(torch_compile=False, cudagraph_capture="lazy")
    sessions = [Session(str(d), progress=False, **settings) for d in dirs]
    try:
        alone = [_run(s) for s in sessions[:2]]
        results: list[list[list[list[int]]]] = [[] for _ in sessions]
        errors: list[BaseException] = []
        start = threading.Barrier(len(sessions))

        def work(i: int) -> None:
            try:
                start.wait()
                for _ in range(3):
                    results[i].append(_run(sessions[i]))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sessions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        for i, per_session in enumerate(results):
            assert len(per_session) == 3
            for result in per_session:
                assert result == alone[i % 2]
    finally:
        for s in sessions:
            s.close()
