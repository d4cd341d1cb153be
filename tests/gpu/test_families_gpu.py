"""Every model family on CUDA: FULL graph replay (decode and mixed batches) gives the tokens of the
eager forward, with the forward compiled and without.

Tiny random models built with transformers, fp32, greedy. Prompts are longer than the sliding
windows (8) and generate past them, so windowed layers read through the released blocks of the
paged cache (Mistral, Phi-3), and hybrid models (Gemma 3, Ministral) run separate KV groups: the
graphs' stacked block tables and slot mappings, each layer reading its group's. Qwen3, Qwen3-MoE
and gpt-oss have their own GPU tests (test_cuda_graphs.py, test_moe_gpu.py, test_gpt_oss_gpu.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 256
_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=0,
    eos_token_id=1, pad_token_id=None,
)  # fmt: skip
_LONGROPE = dict(
    rope_type="longrope", short_factor=[1.0, 1.3, 1.7, 2.5], long_factor=[1.0, 3.0, 7.0, 16.0],
    partial_rotary_factor=0.5,
)  # fmt: skip

# family -> (transformers config class name, model class name, fields beyond _COMMON)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=32)),
    "ministral": (
        "MinistralConfig", "MinistralForCausalLM",
        dict(sliding_window=8, head_dim=32,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    ),
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM",
        dict(sliding_window=8, original_max_position_embeddings=32, partial_rotary_factor=0.5,
             rope_parameters=_LONGROPE),
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             final_logit_softcapping=2.0, attn_logit_softcapping=2.0,
             rope_parameters={
                 "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
             }),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)
    ),
}  # fmt: skip
# Plain-torch experts read their routing counts on the host, so a model with them captures no
# graphs; the packed 4-bit experts (static tiles, as both sessions must run the same) replay.
SETTINGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(moe_weight_format="nvfp4", tune_moe_tiles=False),
}


@pytest.fixture(scope="module")
def family(request, tmp_path_factory) -> tuple[str, Path]:
    import transformers

    from tests.checkpoints import save_with_word_tokenizer

    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**_COMMON, **extra))
    # Wider than HF's init, so logits are well apart (no near-ties for the kernels to break
    # differently); Gemma's (1 + w) norms start near 1 as well.
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((0.0 if request.param == "gemma3" else 1.0) + 0.1 * noise)
            else:
                p.copy_((0.05 if "embed_tokens" in name else 0.2) * noise)
    return request.param, save_with_word_tokenizer(model, tmp_path_factory.mktemp(request.param))


def _generate(path: Path, mode: str, compile_: bool, settings: dict[str, Any]) -> list[list[int]]:
    from libkk import SamplingParams, Session

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 21, 40, 70)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with Session(
        str(path),
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        # Chunked prefill: steps that mix prefill chunks with decodes replay the mixed graphs.
        max_num_batched_tokens=32,
        cudagraph_mode=mode,
        torch_compile=compile_,
        progress=False,
        **settings,
    ) as s:
        if mode == "FULL":
            backends = s.engine.runner.step_backends
            assert s.engine.runner.graphs is not None and s.engine.runner.graphs.graphs
            assert backends.mixed_graphs is not None and backends.mixed_graphs.graphs
        return [o.token_ids for o in s.generate(prompts, params)]


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_graph_replay_equals_eager(family, compile_):
    name, path = family
    settings = SETTINGS.get(name, {})
    eager = _generate(path, "NONE", False, settings)
    assert all(len(t) == 40 for t in eager)
    assert _generate(path, "FULL", compile_, settings) == eager
