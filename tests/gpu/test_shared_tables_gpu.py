"""Shared host tables on CUDA: rows gathered on the host before each (graph-replayed) forward."""

from __future__ import annotations

import pytest
import torch

from libkk import SamplingParams, Session
from libkk.layers.host_embedding import HostRowsEmbedding

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_embedding_on_cuda_gives_the_same_tokens(tiny_qwen3_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LIBKK_SHM_DIR", str(tmp_path / "shm"))
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # fp32, as the other token-equality GPU tests: the two forwards compile to different kernels,
    # and a random tiny model's near-tied bf16 logits would flip on a rounding difference
    settings = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                    progress=False)  # fmt: skip
    with Session(str(tiny_qwen3_dir), **settings) as s:
        plain = [o.token_ids for o in s.generate(prompts, greedy)]
    with Session(str(tiny_qwen3_dir), shared_host_tables=True, **settings) as s:
        embeddings = [m for m in s.engine.model.modules() if isinstance(m, HostRowsEmbedding)]
        assert len(embeddings) == 1 and embeddings[0].table.device.type == "cpu"
        assert s.engine.runner.graphs is not None  # decode steps replay graphs reading the rows
        shared = [o.token_ids for o in s.generate(prompts, greedy)]
    assert shared == plain
    assert any((tmp_path / "shm").iterdir())  # the table lives in the shared folder
