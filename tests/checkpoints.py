"""Random tiny checkpoints for tests: a transformers model saved with a tokenizer, so the real
loader runs and nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def save_with_word_tokenizer(model, path: Path) -> Path:
    """Saves `model` with a word-level tokenizer "t0".."t{V-1}" (token ids serve as prompts;
    "t1" is EOS, as the tiny configs' eos_token_id)."""
    from tokenizers import Tokenizer, models

    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))
    return path


def save_with_tokenizer_of(model, path: Path, source: Path) -> Path:
    """Saves `model` with the tokenizer files of the checkpoint in `source` (text prompts)."""
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


def tiny_llama_config(**overrides):
    """A 2-layer Llama with the default model's vocabulary; weights drawn wider than HF's default
    init so logits are well separated (greedy equivalence tests must not hinge on near-ties)."""
    from transformers import LlamaConfig

    base = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaConfig(**(base | overrides))


# A tiny gpt-oss: sliding (window 8) and full layers alternating, YaRN, sinks, biases everywhere,
# a clamped SwiGLU whose limit the tiny model's values cross.
GPT_OSS_CONFIG: dict = dict(

    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
    swiglu_limit=1.5,  # low, so the tiny model's gate/up values cross it
    rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0,
    },
)  # fmt: skip


def save_tiny_gpt_oss(path: Path, seed: int = 3) -> Path:
    """A random tiny GptOssForCausalLM in transformers' float layout, initialized wider than HF
    does so every part matters: sinks around the scores' size, router and expert weights large
    enough for distinct routing and clamped activations."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**GPT_OSS_CONFIG))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "sinks" in name:
                p.copy_(1.5 * noise)
            else:
                p.copy_((0.05 if "embed_tokens" in name else 0.3) * noise)
    return save_with_word_tokenizer(model, path)


def gpt_oss_mxfp4_and_dequantized(src: Path, tmp: Path) -> tuple[Path, Path]:
    """(the released layout: MXFP4 blocks and scales, the float checkpoint of the same
    dequantized experts) from the float checkpoint in `src`."""
    import torch
    from safetensors.torch import load_file, save_file

    from libkk.quant.formats import dequantize_mxfp4, quantize_mxfp4

    tensors = load_file(src / "model.safetensors")
    packed, dense = {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = dense[name] = t
            continue
        rows = t.transpose(1, 2)  # [E, out, in]: the released layout's row order
        q = [quantize_mxfp4(w) for w in rows]
        e, n, k = rows.shape
        packed[name + "_blocks"] = torch.stack([x.weight for x in q]).reshape(e, n, k // 32, 16)
        packed[name + "_scales"] = torch.stack([x.scale for x in q])
        dense[name] = torch.stack([dequantize_mxfp4(x) for x in q]).transpose(1, 2).contiguous()
    config = json.loads((src / "config.json").read_text())
    out = []
    for kind, weights, quant in (
        ("mxfp4", packed, {"quant_method": "mxfp4"}),
        ("dense", dense, None),
    ):
        path = tmp / kind
        path.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (path / f).write_bytes((src / f).read_bytes())
        cfg = dict(config, quantization_config=quant) if quant else config
        (path / "config.json").write_text(json.dumps(cfg))
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        out.append(path)
    return out[0], out[1]
