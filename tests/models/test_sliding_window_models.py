"""Mistral, Ministral and Phi-3 against transformers (eager attention, fp32, CPU), with sliding
windows.

Tiny random models saved with `save_pretrained`; their windows (8) are far shorter than the
40-token prompts, so every layer's mask matters. The Phi-3 model uses LongRoPE with an original
context (32) shorter than the prompts, so the long factors rotate every position (transformers
picks them for any sequence past 32), and rotates half of each head (partial_rotary_factor 0.5).
Checked: prefill logits of a flat batch, and 32 greedy tokens through the engine alone,
batched, with chunked prefill and with prefix-cache hits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from engine_parity import check_engine_greedy, hf_greedy
from paged_helpers import PagedKV
from torch import nn

from libkk.errors import CorruptCheckpointError
from libkk.models.arch_config import parse_arch_config
from libkk.models.loader import load_model
from tests.checkpoints import save_with_word_tokenizer

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
)
_LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0, 1.3, 1.7, 2.5],
    long_factor=[1.0, 3.0, 7.0, 16.0],
)

# family id -> (config class, extra fields, sliding window libkk should use)
FAMILIES: dict[str, tuple[type, dict[str, Any], int | None]] = {
    "mistral": (transformers.MistralConfig, dict(sliding_window=8, head_dim=32), 8),
    "mistral_full": (transformers.MistralConfig, dict(sliding_window=None), None),
    # sliding layers around a full one: separate KV groups in the engine
    "ministral": (
        transformers.MinistralConfig,
        dict(
            sliding_window=8,
            head_dim=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        8,
    ),
    "phi3": (
        transformers.Phi3Config,
        dict(
            sliding_window=8,
            original_max_position_embeddings=32,
            partial_rotary_factor=0.5,
            rope_parameters=dict(_LONGROPE, partial_rotary_factor=0.5),
        ),
        8,
    ),
    # original context == max positions: the short factors and no attention scaling
    "phi3_short": (
        transformers.Phi3Config,
        dict(
            original_max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="longrope",
                short_factor=[1.0 + i / 8 for i in range(8)],
                long_factor=[2.0] * 8,
            ),
        ),  # fmt: skip
        None,
    ),
}

GEN = 32
PROMPTS = [
    [(7 * i + 5) % 256 for i in range(40)],
    [(7 * i + 5) % 256 for i in range(24)] + [(11 * i + 3) % 256 for i in range(21)],  # shares 24
    [(13 * i + 2) % 256 for i in range(41)],
]


def _randomize(model: nn.Module, seed: int) -> None:
    """Replaces HF's init (unit norms) so every parameter matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def _save(family: str, out_dir: Path) -> Path:
    config_cls, extra, _ = FAMILIES[family]
    config = config_cls(**{**_COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, seed=len(family))
    return save_with_word_tokenizer(model, out_dir)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, tuple[Path, nn.Module]] = {}

    def get(family: str) -> tuple[Path, nn.Module]:
        if family not in cache:
            path = _save(family, tmp_path_factory.mktemp(family))
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
            cache[family] = path, hf
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_prefill_logits_match_hf(saved, family: str) -> None:
    path, hf = saved(family)
    kk, arch = load_model(path, torch.float32, torch.device("cpu"), progress=False)
    assert arch.sliding_window == FAMILIES[family][2]
    windows = [a.sliding_window for a in kk.attention_layers()]
    assert windows == ([8, None, 8] if family == "ministral" else [arch.sliding_window] * 3)
    logits = PagedKV(kk, block_size=4).prefill_logits(PROMPTS)  # one flat batch
    for prompt, got in zip(PROMPTS, logits, strict=True):
        want = hf(torch.tensor([prompt])).logits[0]
        assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["mistral", "phi3"])
@torch.no_grad()
def test_bf16_tracks_hf_bf16(saved, family: str) -> None:
    path, _ = saved(family)
    kk, _ = load_model(path, torch.bfloat16, torch.device("cpu"), progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.bfloat16
    ).eval()
    logits = PagedKV(kk, dtype=torch.bfloat16).prefill_logits(PROMPTS)
    for prompt, got in zip(PROMPTS, logits, strict=True):
        want = hf(torch.tensor([prompt])).logits[0].float()
        assert (got - want).abs().max().item() < 0.2


@pytest.mark.parametrize("family", ["mistral", "ministral", "phi3"])
def test_greedy_through_the_engine_matches_hf(saved, family: str) -> None:
    """32 greedy tokens: alone, batched, chunked (7-token steps) and from the prefix cache."""
    path, hf = saved(family)
    want = [hf_greedy(hf, p, GEN) for p in PROMPTS]
    check_engine_greedy(path, PROMPTS, want)


def test_arch_config_fields(saved) -> None:
    path, _ = saved("phi3")
    import json

    raw = json.loads((path / "config.json").read_text())
    arch = parse_arch_config(raw)
    assert arch.rope.rope_type == "longrope" and arch.rope.use_long_factor
    assert arch.rope.partial_rotary_factor == 0.5 and arch.rope.factor == 4.0
    assert arch.rope.original_max_position_embeddings == 32
    # A window no narrower than the positions hides nothing: full attention.
    assert parse_arch_config({**raw, "sliding_window": 128}).sliding_window is None
    mistral = {**raw, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    del mistral["rope_parameters"]
    mistral.pop("partial_rotary_factor", None)
    mistral.pop("sliding_window")
    mistral["max_position_embeddings"] = 8192
    assert parse_arch_config(mistral).sliding_window == 4096  # MistralConfig's default


def test_ministral_layer_types(saved) -> None:
    import json

    path, _ = saved("ministral")
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["MinistralForCausalLM"]
    arch = parse_arch_config(raw)
    assert [arch.window_of(i) for i in range(3)] == [8, None, 8]
    del raw["layer_types"]  # MinistralConfig's default: every layer takes the window
    assert [parse_arch_config(raw).window_of(i) for i in range(3)] == [8, 8, 8]
    with pytest.raises(CorruptCheckpointError, match="layer_types"):
        parse_arch_config({**raw, "layer_types": ["sliding_attention"]})
