"""Gemma 3 against transformers (eager attention, fp32, CPU).

A tiny random Gemma3ForCausalLM saved with `save_pretrained`: sliding and full layers
interleaved, a window (8) far shorter than the 40-token prompts, two RoPE tables (the full layers'
with linear scaling), query_pre_attn_scalar unlike head_dim, and final logit soft-capping.
attn_logit_softcapping is set too: transformers' Gemma 3 does not apply it, and neither does
libkk. Checked: prefill logits of a flat batch, and 32 greedy tokens through the engine alone,
batched, with chunked prefill and with prefix-cache hits; the text tower of a tiny
Gemma3ForConditionalGeneration; the config parser's older spellings and refusals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from engine_parity import check_engine_greedy, hf_greedy
from paged_helpers import PagedKV
from safetensors.torch import load_file, save_file
from torch import nn

from libkk.errors import UnsupportedModelError
from libkk.models.arch_config import parse_arch_config
from libkk.models.loader import load_model
from tests.checkpoints import save_with_word_tokenizer

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
TEXT: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=256,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
    sliding_window=8,
    layer_types=LAYER_TYPES,
    query_pre_attn_scalar=24,
    final_logit_softcapping=2.0,
    attn_logit_softcapping=2.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
    },
)

GEN = 32
PROMPTS = [
    [(7 * i + 5) % 256 for i in range(40)],
    [(7 * i + 5) % 256 for i in range(24)] + [(11 * i + 3) % 256 for i in range(21)],  # shares 24
    [(13 * i + 2) % 256 for i in range(41)],
]


def _randomize(model: nn.Module, seed: int) -> None:
    """Replaces HF's init (zero norms) so every parameter matters. The embedding (also the head)
    is small and the post-norms large, so the layers, not the token's own embedding, decide the
    next token (greedy runs would otherwise repeat the last token)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(float(".post_" in name) + 0.1 * noise)
            else:
                p.copy_((0.05 if "embed_tokens" in name else 0.2) * noise)


def _load_hf(path: Path, cls: type = transformers.AutoModelForCausalLM, **kw: Any) -> nn.Module:
    kw.setdefault("dtype", torch.float32)
    return cls.from_pretrained(path, attn_implementation="eager", **kw).eval()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TEXT))
    _randomize(model, seed=3)
    path = save_with_word_tokenizer(model, tmp_path_factory.mktemp("gemma3"))
    return path, _load_hf(path)


@torch.no_grad()
def test_prefill_logits_match_hf(saved) -> None:
    path, hf = saved
    kk, arch = load_model(path, torch.float32, torch.device("cpu"), progress=False)
    assert arch.layer_types == tuple(LAYER_TYPES) and arch.final_logit_softcapping == 2.0
    assert [a.sliding_window for a in kk.attention_layers()] == [8, None, 8]
    assert [a.scale for a in kk.attention_layers()] == [24**-0.5] * 3
    logits = PagedKV(kk, block_size=4).prefill_logits(PROMPTS)  # one flat batch
    for prompt, got in zip(PROMPTS, logits, strict=True):
        want = hf(torch.tensor([prompt])).logits[0]
        assert want.abs().max() > 1.0  # the cap (2) shapes the logits
        assert (got - want).abs().max().item() < 1e-4


@torch.no_grad()
def test_bf16_tracks_hf_bf16(saved) -> None:
    path, _ = saved
    kk, _ = load_model(path, torch.bfloat16, torch.device("cpu"), progress=False)
    hf = _load_hf(path, dtype=torch.bfloat16)
    logits = PagedKV(kk, dtype=torch.bfloat16).prefill_logits(PROMPTS)
    for prompt, got in zip(PROMPTS, logits, strict=True):
        want = hf(torch.tensor([prompt])).logits[0].float()
        assert (got - want).abs().max().item() < 0.2


def test_greedy_through_the_engine_matches_hf(saved) -> None:
    """32 greedy tokens: alone, batched, chunked (7-token steps) and from the prefix cache."""
    path, hf = saved
    want = [hf_greedy(hf, p, GEN) for p in PROMPTS]
    check_engine_greedy(path, PROMPTS, want)


@torch.no_grad()
def test_conditional_generation_text_tower(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration: the text tower loads from `model.language_model.`, the
    vision weights are skipped, and text-only logits match (that model does not cap them)."""
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=vision, mm_tokens_per_image=4, image_token_index=255
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    _randomize(model, seed=4)
    # The word tokenizer takes the vocabulary size from `model.config` (here the text config's).
    text_view = SimpleNamespace(config=config.text_config, save_pretrained=model.save_pretrained)
    path = save_with_word_tokenizer(text_view, tmp_path)
    hf = _load_hf(path, transformers.Gemma3ForConditionalGeneration)
    kk, arch = load_model(path, torch.float32, torch.device("cpu"), progress=False)
    assert arch.architecture == "Gemma3ForConditionalGeneration"
    assert arch.final_logit_softcapping is None and arch.tie_word_embeddings
    logits = PagedKV(kk, block_size=4).prefill_logits(PROMPTS[:2])
    want = [hf(input_ids=torch.tensor([p])).logits[0] for p in PROMPTS[:2]]
    for got, w in zip(logits, want, strict=True):
        assert (got - w).abs().max().item() < 1e-4
    # save_pretrained writes the hub layout (language_model.model.*, vision_tower.*,
    # multi_modal_projector.*); transformers' module names are model.language_model.*,
    # model.vision_tower.*, model.multi_modal_projector.*: load those too.
    file = path / "model.safetensors"
    tensors = load_file(file)
    assert any(k.startswith("language_model.model.") for k in tensors)
    assert any(k.startswith("vision_tower.") for k in tensors)
    renamed = {
        "model.language_model." + k.removeprefix("language_model.model.")
        if k.startswith("language_model.model.")
        else "model." + k: v
        for k, v in tensors.items()
    }
    save_file(renamed, file, metadata={"format": "pt"})
    kk, _ = load_model(path, torch.float32, torch.device("cpu"), progress=False)
    logits = PagedKV(kk, block_size=4).prefill_logits(PROMPTS[:2])
    for got, w in zip(logits, want, strict=True):
        assert (got - w).abs().max().item() < 1e-4


def test_arch_config_spellings_and_refusals(saved) -> None:
    path, _ = saved
    raw = json.loads((path / "config.json").read_text())
    arch = parse_arch_config(raw)
    assert arch.rope.rope_type == "linear" and arch.rope.factor == 2.0
    assert arch.rope.theta == 1000.0 and arch.local_rope.theta == 50.0
    # The older spelling: rope_theta (+ rope_scaling) for the full layers, rope_local_base_freq
    # for the sliding ones, and the layer kinds from sliding_window_pattern.
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    old |= dict(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=2,
    )
    arch = parse_arch_config(old)
    assert arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (arch.rope.theta, arch.rope.factor, arch.local_rope.theta) == (1e6, 8.0, 1e4)
    assert arch.local_rope.rope_type == "default"
    for bad in (dict(hidden_activation="gelu"), dict(use_bidirectional_attention=True)):
        with pytest.raises(UnsupportedModelError, match=next(iter(bad))):
            parse_arch_config({**raw, **bad})
