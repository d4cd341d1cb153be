"""FP8 KV-cache scales on a whole model: calibration from the first prefill, and scales read from
the checkpoint.

The model's keys and values are made loud (k_proj and v_proj weights x GAIN, q_proj and o_proj
/ GAIN): with an fp32 cache it computes what it did before, but |k| and |v| reach thousands, far
beyond e4m3's 448, so an FP8 cache at scale 1.0 saturates them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from libkk.errors import CorruptCheckpointError
from libkk.layers.attention import FP8_MAX, calibrate_kv_scales_on_first_prefill
from libkk.models.loader import load_model
from tests.models.paged_helpers import PagedKV, PagedRequest

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
GAIN = 300.0
PROMPT = [5, 17, 99, 3, 42, 8, 150, 77, 23, 61, 9]
CONTINUATION = [31, 200, 4]  # fed after the prompt, one decode step each, in every run


@pytest.fixture(scope="module")
def loud_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight.mul_(GAIN)
            attn.q_proj.weight.div_(GAIN)
            attn.v_proj.weight.mul_(GAIN)
            attn.o_proj.weight.div_(GAIN)
    path = tmp_path_factory.mktemp("loud-llama")
    model.save_pretrained(path)
    return path


def _run(path: Path, cache_dtype: torch.dtype, calibrate: bool = False):
    """(model, log-probs [1 + len(CONTINUATION), vocab]): the prompt's last row, then one row
    per decode step of CONTINUATION."""
    model, _ = load_model(path, torch.float32, CPU, progress=False)
    if calibrate:
        calibrate_kv_scales_on_first_prefill(model)
    kv = PagedKV(model, num_blocks=16, block_size=4, dtype=cache_dtype)
    request = PagedRequest(list(PROMPT))
    rows = []
    for token in [*CONTINUATION, None]:
        hidden, last = kv.step([request])
        logits = model.compute_logits(hidden[last]).float()  # [1, vocab]
        rows.append(torch.log_softmax(logits, dim=-1))
        if token is not None:
            request.token_ids.append(token)
    return model, torch.cat(rows)


def _kl(logprobs: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """KL(want || logprobs) per row."""
    return (want.exp() * (want - logprobs)).sum(-1)


def test_calibrated_fp8_cache_tracks_the_fp32_cache(loud_llama_dir):
    _, want = _run(loud_llama_dir, torch.float32)
    model, calibrated = _run(loud_llama_dir, FP8, calibrate=True)
    _, plain = _run(loud_llama_dir, FP8)
    kl_calibrated, kl_plain = _kl(calibrated, want), _kl(plain, want)
    # e4m3's 3 mantissa bits cost a little (what this model loses at normal magnitudes, KL
    # <= 0.009 per row here); saturating at 448 costs a lot (KL >= 0.49 per row here).
    assert kl_calibrated.max() < 0.02, kl_calibrated
    assert kl_plain.min() > 10 * kl_calibrated.max(), (kl_plain, kl_calibrated)
    for layer in model.attention_layers():
        k_scale, v_scale = layer.kv_scales
        assert k_scale > 1.0 and v_scale > 1.0  # the loud keys needed scales well above 1.0
        assert not layer.calibration_pending


def test_calibration_matches_amax_of_the_first_prefill(loud_llama_dir):
    """Each layer's scales are amax(|k|) / 448 and amax(|v|) / 448 over the prompt's K/V (as the
    layer stores them: its inputs, k rotated), and decode steps leave them alone."""
    model, _ = load_model(loud_llama_dir, torch.float32, CPU, progress=False)
    calibrate_kv_scales_on_first_prefill(model)
    kv = PagedKV(model, num_blocks=16, block_size=4, dtype=FP8)
    inputs: list[tuple[torch.Tensor, ...]] = []
    layers = model.attention_layers()
    hooks = [
        layer.register_forward_pre_hook(lambda m, args: inputs.append(args)) for layer in layers
    ]
    request = PagedRequest(list(PROMPT))
    kv.step([request])
    for hook in hooks:
        hook.remove()
    first = [layer.kv_scales for layer in layers]
    for layer, (k_scale, v_scale), (q, k, v, positions) in zip(layers, first, inputs, strict=True):
        _, k = layer.qk_norm_rope.apply(q, k, positions)  # the rotation runs inside the layer
        assert k.shape[0] == len(PROMPT)
        assert k_scale == pytest.approx(k.abs().max().item() / FP8_MAX, rel=1e-6)
        assert v_scale == pytest.approx(v.abs().max().item() / FP8_MAX, rel=1e-6)
    assert first[0] != pytest.approx(first[1])  # each layer its own
    request.token_ids.append(7)
    kv.step([request])
    assert [layer.kv_scales for layer in layers] == first


def _with_tensors(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update(extra)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_scales_are_loaded_and_used(loud_llama_dir, tmp_path):
    """Scales stored in the checkpoint (vLLM / ModelOpt names) act as calibrated ones."""
    model, calibrated = _run(loud_llama_dir, FP8, calibrate=True)
    (k0, v0), (k1, v1) = [layer.kv_scales for layer in model.attention_layers()]
    path = _with_tensors(
        loud_llama_dir,
        tmp_path / "scaled",
        {
            "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(k0),
            "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([v0]),
            "model.layers.1.self_attn.k_scale": torch.tensor(k1, dtype=torch.bfloat16),
            "model.layers.1.self_attn.attn.v_scale": torch.tensor(v1),
        },
    )
    loaded, from_checkpoint = _run(path, FP8)
    layers = loaded.attention_layers()
    assert layers[0].kv_scales == (pytest.approx(k0), pytest.approx(v0))
    assert layers[1].kv_scales == (
        pytest.approx(k1, rel=2**-8),  # stored in bf16
        pytest.approx(v1),
    )
    torch.testing.assert_close(from_checkpoint, calibrated, atol=0.05, rtol=0.0)


def test_checkpoint_kv_scale_sets_both_and_absent_layers_keep_one(loud_llama_dir, tmp_path):
    path = _with_tensors(
        loud_llama_dir, tmp_path / "kv", {"model.layers.1.self_attn.kv_scale": torch.tensor(3.0)}
    )
    model, _ = load_model(path, torch.float32, CPU, progress=False)
    assert [layer.kv_scales for layer in model.attention_layers()] == [(1.0, 1.0), (3.0, 3.0)]


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, "finite and positive"),
        ({"model.layers.0.self_attn.v_scale": torch.tensor(float("inf"))}, "finite and positive"),
        ({"model.layers.5.self_attn.k_scale": torch.tensor(1.0)}, r"layer\(s\) \[5\]"),
    ],
)
def test_bad_checkpoint_scales_are_refused(loud_llama_dir, tmp_path, extra, match):
    path = _with_tensors(loud_llama_dir, tmp_path / "bad", extra)
    with pytest.raises(CorruptCheckpointError, match=match):
        load_model(path, torch.float32, CPU, progress=False)


def test_per_head_checkpoint_scales_are_unsupported(loud_llama_dir, tmp_path):
    from libkk.errors import UnsupportedModelError

    path = _with_tensors(
        loud_llama_dir, tmp_path / "heads", {"model.layers.0.self_attn.k_scale": torch.ones(2)}
    )
    with pytest.raises(UnsupportedModelError, match="one scale per"):
        load_model(path, torch.float32, CPU, progress=False)


def test_session_calibrates_from_its_first_prefill(loud_llama_dir, default_model_dir, tmp_path):
    """`calculate_kv_scales=True` through a Session: every layer calibrates on the first prefill,
    and the FP8 session's greedy tokens equal those of an fp32 cache."""
    from libkk import SamplingParams, Session

    path = tmp_path / "loud"
    shutil.copytree(loud_llama_dir, path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, path / f)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    settings = dict(device="cpu", dtype="float32", num_gpu_blocks=32, max_model_len=64)
    with Session(str(path), **settings) as s:
        want = s.generate(PROMPT, greedy).token_ids
    with Session(str(path), kv_cache_dtype="fp8", calculate_kv_scales=True, **settings) as s:
        layers = s.engine.model.attention_layers()
        assert all(layer.calibration_pending for layer in layers)
        got = s.generate(PROMPT, greedy).token_ids
        assert not any(layer.calibration_pending for layer in layers)
        assert all(min(layer.kv_scales) > 1.0 for layer in layers)
    assert got == want
