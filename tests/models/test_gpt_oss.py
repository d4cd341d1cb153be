"""gpt-oss against transformers (eager attention, fp32, CPU).

A tiny random GptOssForCausalLM saved with `save_pretrained` (transformers' float layout: stacked,
interleaved gate/up experts): sliding (window 8) and full layers alternating under 40-token
prompts, attention sinks large enough to take a real share of each softmax, YaRN RoPE, biases in
attention, router and experts, and the clamped SwiGLU with gate/up values past its limit.
Checked: prefill logits of a flat batch, 32 greedy tokens through the engine alone, batched, with
chunked prefill, with prefix-cache hits and under preemption; and the released MXFP4 layout
(`*_blocks` / `*_scales` with quantization_config mxfp4), which must give exactly what the
float checkpoint of the same dequantized experts gives.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from engine_parity import check_engine_greedy, hf_greedy
from libkk.kernels.moe import ExpertActivation
from paged_helpers import PagedKV
from torch import nn

from libkk import SamplingParams, Session
from libkk.errors import ConfigError
from libkk.models.arch_config import parse_arch_config
from libkk.models.loader import load_model
from tests.checkpoints import gpt_oss_mxfp4_and_dequantized, save_tiny_gpt_oss

GEN = 32
PROMPTS = [
    [(7 * i + 5) % 256 for i in range(40)],
    [(7 * i + 5) % 256 for i in range(24)] + [(11 * i + 3) % 256 for i in range(21)],  # shares 24
    [(13 * i + 2) % 256 for i in range(41)],
]


def _load_hf(path: Path) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    path = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"))
    return path, _load_hf(path)


def test_config_parse(saved) -> None:
    path, _ = saved
    arch = parse_arch_config(json.loads((path / "config.json").read_text()))
    assert arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [arch.window_of(i) for i in range(3)] == [8, None, 8]
    assert arch.attention_sinks and arch.router_bias and arch.expert_bias
    assert arch.qkv_bias and arch.o_proj_bias and not arch.tie_word_embeddings
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (1.5, 1.702)
    assert arch.rope.rope_type == "yarn" and not arch.rope.truncate
    assert arch.num_experts == 4 and arch.norm_topk_prob and not arch.mxfp4_experts


@torch.no_grad()
def test_prefill_logits_match_hf(saved) -> None:
    path, hf = saved
    kk, _ = load_model(path, torch.float32, torch.device("cpu"), progress=False)
    layers = kk.attention_layers()
    assert [a.sliding_window for a in layers] == [8, None, 8]
    assert all(a.sinks is not None for a in layers)
    logits = PagedKV(kk, block_size=4).prefill_logits(PROMPTS)  # one flat batch
    for prompt, got in zip(PROMPTS, logits, strict=True):
        want = hf(torch.tensor([prompt])).logits[0]
        assert (got - want).abs().max().item() < 1e-4


@torch.no_grad()
def test_every_part_matters(saved) -> None:
    """Sinks, the clamp and the expert biases each change the logits (a reference that ignored
    one of them would not match by accident)."""
    path, _ = saved
    kk, _ = load_model(path, torch.float32, torch.device("cpu"), progress=False)
    base = PagedKV(kk, block_size=4).prefill_logits(PROMPTS[:1])[0]
    unclamped = ExpertActivation("clamped_swiglu", limit=1e4)
    edits = (
        lambda layer: layer.self_attn.attn.sinks.fill_(-1e4),
        lambda layer: setattr(layer.mlp.experts, "activation", unclamped),
        lambda layer: layer.mlp.experts.w2_bias.zero_(),
    )
    changes = []
    for edit in edits:
        kk2, _ = load_model(path, torch.float32, torch.device("cpu"), progress=False)
        edit(kk2.model.layers[0])
        got = PagedKV(kk2, block_size=4).prefill_logits(PROMPTS[:1])[0]
        changes.append((got - base).abs().max().item())
    assert all(c > 1e-3 for c in changes), changes


def test_greedy_through_the_engine_matches_hf(saved) -> None:
    """32 greedy tokens: alone, batched, chunked (7-token steps), from the prefix cache and with
    preemption (a KV pool too small for all three at once)."""
    path, hf = saved
    want = [hf_greedy(hf, p, GEN) for p in PROMPTS]
    check_engine_greedy(path, PROMPTS, want)
    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    # Separate KV groups (sliding, sliding, full): a sequence needs 32 blocks of the full group
    # and 11 of each sliding one (16-token steps), 55 with the null block; three need more.
    common = dict(block_size=4, max_model_len=128, max_num_batched_tokens=16)
    with Session(str(path), num_gpu_blocks=60, enable_prefix_caching=False, **common) as s:
        outs = s.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == want
        assert sum(o.num_preemptions for o in outs) > 0


@torch.no_grad()
def test_mxfp4_layout_equals_its_dequantized_float_checkpoint(saved, tmp_path: Path) -> None:
    path, _ = saved
    mxfp4, dense = gpt_oss_mxfp4_and_dequantized(path, tmp_path)
    kk_q, arch = load_model(mxfp4, torch.float32, torch.device("cpu"), progress=False)
    assert arch.mxfp4_experts
    kk_d, _ = load_model(dense, torch.float32, torch.device("cpu"), progress=False)
    got = PagedKV(kk_q, block_size=4).prefill_logits(PROMPTS)
    want = PagedKV(kk_d, block_size=4).prefill_logits(PROMPTS)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    hf = _load_hf(dense)  # and the dequantized experts still match transformers
    for prompt, w in zip(PROMPTS, want, strict=True):
        assert (w - hf(torch.tensor([prompt])).logits[0]).abs().max().item() < 1e-4
    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    runs = []
    for p in (mxfp4, dense):
        with Session(str(p), block_size=4, max_model_len=128) as s:
            runs.append([o.token_ids for o in s.generate(PROMPTS, params)])
    assert runs[0] == runs[1]
    with pytest.raises(ConfigError, match="MXFP4 already"):
        load_model(mxfp4, torch.float32, torch.device("cpu"), moe_weight_format="nvfp4")
