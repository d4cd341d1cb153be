"""GGUF -> Hugging Face-layout folder.

A GGUF file is read once with `gguf.GGUFReader`, every tensor is dequantized to float32, renamed
from llama.cpp's names to Hugging Face's, and written as one `model.safetensors` next to a
`config.json`, a `tokenizer.json` rebuilt from the GGUF metadata, a `tokenizer_config.json` and a
`generation_config.json`. The rest of libkk then only ever reads HF-layout folders.

Only the `llama` architecture (which SmolLM2 uses) and byte-level BPE tokenizers are supported.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from libkk.errors import (
    CorruptCheckpointError,
    MissingDependencyError,
    ModelNotFoundError,
    UnsupportedModelError,
)

# NOTE: bump whenever the folder written for the same GGUF changes; cached conversions keyed on it
# are then redone instead of being trusted.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)

# llama.cpp's GGUF token types (gguf.TokenType).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")

# Pre-tokenizer regexes, by `tokenizer.ggml.pre`. They must split text exactly as llama.cpp does
# for that name, or merges learned on other splits get applied.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's GPT-2 regex, i.e. what `ByteLevel(use_regex=True)` does on its own.
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
# llama.cpp splits every digit off (`\p{N}`) and then applies the GPT-2 regex.
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx")


@dataclass(frozen=True)
class _TensorPlan:
    """One output tensor: where it comes from and what shape it must have."""

    hf_name: str
    source: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]  # HF layout, [out, in] for matrices
    unpermute_heads: int  # > 0: undo llama.cpp's q/k row permutation with this many heads


def convert_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], progress: bool = True
) -> None:
    """Convert a llama GGUF into an HF-layout folder (float32 safetensors + tokenizer files).

    Raises ModelNotFoundError (no such file), CorruptCheckpointError (truncated or unreadable file,
    missing metadata or tensors, wrong shapes) and UnsupportedModelError (architecture, tokenizer
    or feature that libkk cannot run).
    """
    gguf = _import_gguf()
    path = Path(gguf_path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/OSError on bad files
        raise CorruptCheckpointError(
            f"cannot read GGUF file {str(path)!r} (truncated or not a GGUF file): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    meta = _Metadata(reader, path)

    # Validate everything before writing anything, so a refusal is fast and leaves no files.
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF {str(path)!r} has architecture {arch!r} (general.architecture); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = _llama_config(meta, reader)
    plan = _tensor_plan(reader, config, path)
    tokenizer, tokenizer_config, generation_config = _build_tokenizer(meta, config)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_safetensors(out / "model.safetensors", plan, lambda t: _load_tensor(t, path), progress)


def _import_gguf() -> Any:
    try:
        import gguf
        import gguf.quants  # noqa: F401  (dequantize lives here)
    except ImportError as exc:
        raise MissingDependencyError(
            "reading GGUF files needs the `gguf` package: pip install 'gguf>=0.10'"
        ) from exc
    return gguf


class _Metadata:
    """GGUF key/value metadata as plain Python values (read without `ReaderField.contents`,
    which older gguf releases lack)."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        from gguf import GGUFValueType

        try:
            kind = field.types[0]
            if kind == GGUFValueType.ARRAY:
                if field.types[-1] == GGUFValueType.STRING:
                    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
                if len(field.types) != 2:
                    return None  # nested arrays: nothing libkk reads
                if not field.data:
                    return []
                return np.concatenate([field.parts[i] for i in field.data]).tolist()
            if kind == GGUFValueType.STRING:
                return bytes(field.parts[field.data[0]]).decode("utf-8")
            value = field.parts[field.data[0]][0].item()
            return bool(value) if kind == GGUFValueType.BOOL else value
        except (UnicodeDecodeError, IndexError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"GGUF {str(self._path)!r}: metadata key {key!r} cannot be decoded: {exc}"
            ) from exc

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CorruptCheckpointError(
                f"GGUF {str(self._path)!r} lacks the required metadata key {key!r}"
            )
        return value


def _int_key(meta: _Metadata, key: str, default: int | None = None) -> int:
    value = meta.get(key, default) if default is not None else meta.require(key)
    if isinstance(value, list):
        raise UnsupportedModelError(
            f"GGUF metadata {key!r} is a per-layer list {value[:4]}...; only one value for all "
            "layers is supported"
        )
    return int(value)


def _llama_config(meta: _Metadata, reader: Any) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from `llama.*` metadata."""
    p = "llama."
    if int(meta.get(p + "expert_count", 0) or 0) > 0:
        raise UnsupportedModelError(
            f"GGUF llama with {meta.get(p + 'expert_count')} experts ({p}expert_count): "
            "mixture-of-experts llama GGUFs are not supported"
        )
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(
            f"GGUF rope scaling {scaling!r} ({p}rope.scaling.type) is not supported; "
            "only plain RoPE is"
        )
    hidden = _int_key(meta, p + "embedding_length")
    heads = _int_key(meta, p + "attention.head_count")
    kv_heads = _int_key(meta, p + "attention.head_count_kv", heads)
    head_dim = _int_key(meta, p + "attention.key_length", hidden // heads)
    value_dim = _int_key(meta, p + "attention.value_length", head_dim)
    rope_dim = _int_key(meta, p + "rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise UnsupportedModelError(
            f"GGUF head sizes key={head_dim} value={value_dim} rope={rope_dim} differ; "
            "only equal key/value/rope head sizes are supported"
        )
    if heads % kv_heads:
        raise CorruptCheckpointError(
            f"GGUF {p}attention.head_count={heads} is not a multiple of head_count_kv={kv_heads}"
        )
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise CorruptCheckpointError("GGUF lacks the tensor 'token_embd.weight'")
    vocab_size = int(embed.shape[-1])  # GGUF dims are [hidden, vocab]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _int_key(meta, p + "feed_forward_length"),
        "num_hidden_layers": _int_key(meta, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.require(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": _int_key(meta, p + "context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def _tensor_plan(reader: Any, config: dict[str, Any], path: Path) -> list[_TensorPlan]:
    """Map every GGUF tensor to its HF name and expected HF shape; refuse unknown tensors."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    q_dim, kv_dim = heads * config["head_dim"], kv_heads * config["head_dim"]
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    expected_layer = {
        "attn_norm": (hidden,),
        "ffn_norm": (hidden,),
        "attn_q": (q_dim, hidden),
        "attn_k": (kv_dim, hidden),
        "attn_v": (kv_dim, hidden),
        "attn_output": (hidden, q_dim),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    expected_global = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    plan: list[tuple[tuple[int, int], _TensorPlan]] = []
    unknown: list[str] = []
    seen: set[str] = set()
    for tensor in reader.tensors:
        name = tensor.name
        heads_for_unpermute = 0
        if name in _GLOBAL_TENSORS:
            hf_name, shape = _GLOBAL_TENSORS[name], expected_global[name]
            order = (-1, 0) if name == "token_embd.weight" else (layers, 0 if "norm" in name else 1)
        elif (
            (m := _LAYER_RE.fullmatch(name))
            and m.group(2) in _LAYER_TENSORS
            and int(m.group(1)) < layers
        ):
            layer, kind = int(m.group(1)), m.group(2)
            hf_name = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.weight"
            shape = expected_layer[kind]
            order = (layer, list(_LAYER_TENSORS).index(kind))
            # llama.cpp permutes q with num_attention_heads and k with num_key_value_heads.
            heads_for_unpermute = {"attn_q": heads, "attn_k": kv_heads}.get(kind, 0)
        else:
            unknown.append(name)
            continue
        # The reader's numpy shape is the GGUF dims reversed, i.e. HF's [out, in].
        got = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if got != shape:
            raise CorruptCheckpointError(
                f"GGUF {str(path)!r}: tensor {name!r} has shape {list(got)}, expected "
                f"{list(shape)} from the model's metadata"
            )
        seen.add(name)
        plan.append((order, _TensorPlan(hf_name, tensor, shape, heads_for_unpermute)))
    if unknown:
        hint = " (rope_freqs: llama-3 rope scaling)" if "rope_freqs.weight" in unknown else ""
        raise UnsupportedModelError(
            f"GGUF {str(path)!r} has tensors libkk's llama converter does not know{hint}: "
            f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}"
        )
    required = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{kind}.weight" for i in range(layers) for kind in _LAYER_TENSORS
    }
    missing = sorted(required - seen)
    if missing:
        raise CorruptCheckpointError(
            f"GGUF {str(path)!r} lacks {len(missing)} tensors, e.g. {', '.join(missing[:4])}"
        )
    return [item for _, item in sorted(plan, key=lambda pair: pair[0])]


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved-pair RoPE -> HF's half-split RoPE).

    llama.cpp writes `w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)`; this is the
    inverse: GGUF row `h * head_dim + 2 * i + j` goes back to HF row
    `h * head_dim + j * head_dim // 2 + i`.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise CorruptCheckpointError(
            f"q/k weight with {rows} rows cannot be split into {n_head} heads of even size"
        )
    w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


def _load_tensor(item: _TensorPlan, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    tensor = item.source
    try:
        data = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which the "
            f"installed gguf package cannot dequantize: {exc}"
        ) from exc
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"GGUF {str(path)!r}: tensor {tensor.name!r} cannot be decoded: {exc}"
        ) from exc
    data = np.asarray(data, dtype=np.float32).reshape(item.shape)
    if item.unpermute_heads:
        data = unpermute_qk(data, item.unpermute_heads)
    return data


def _write_safetensors(
    path: Path,
    plan: Sequence[_TensorPlan],
    load: Callable[[_TensorPlan], np.ndarray],
    progress: bool,
) -> None:
    """Stream float32 tensors into one safetensors file; peak memory is one tensor."""
    from tqdm import tqdm

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan:
        nbytes = 4 * math.prod(item.shape)
        header[item.hf_name] = {
            "dtype": "F32",
            "shape": list(item.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        bar = tqdm(
            plan,
            desc="Converting GGUF",
            unit="tensor",
            file=sys.stderr,
            disable=not progress,
            leave=False,
        )
        for item in bar:
            data = np.ascontiguousarray(load(item), dtype="<f4")
            f.write(memoryview(data).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _pre_tokenizer(pre: str) -> tuple[Any, bool]:
    """The tokenizers pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre`, and whether BPE
    should look whole words up before merging (llama-3's `ignore_merges`)."""
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ), False
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), True
    known = ", ".join(_GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE)
    raise UnsupportedModelError(
        f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: {known}"
    )


def _build_tokenizer(
    meta: _Metadata, config: dict[str, Any]
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """tokenizer.json (a `tokenizers.Tokenizer`), tokenizer_config.json and
    generation_config.json from the `tokenizer.*` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(repr(k) for k in SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE)"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(meta.require("tokenizer.ggml.merges")):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CorruptCheckpointError(
                f"GGUF tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens separated by "
                "a space"
            )
        merges.append((parts[0], parts[1]))
    if len(types) != len(tokens):
        raise CorruptCheckpointError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CorruptCheckpointError("GGUF tokenizer.ggml.tokens holds duplicate tokens")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    pre_tokenizer, ignore_merges = _pre_tokenizer(pre)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    # Control tokens (e.g. <|im_start|>) stay whole and count as special; user-defined ones stay
    # whole too, as llama.cpp matches them in text, but are ordinary text when decoded.
    special = [
        t for t, ty in zip(tokens, types, strict=True) if ty in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    ]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise CorruptCheckpointError("GGUF asks to add a BOS/EOS token but does not name it")
    if add_bos or add_eos:
        # Same template transformers builds from add_bos_token/add_eos_token.
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = (
            f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1"
            f"{' ' + eos + ':1' if add_eos else ''}"
        )
        ids = [(bos, vocab[bos])] if add_bos else []
        ids += [(eos, vocab[eos])] if add_eos else []
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=ids
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if (value := token(key)) is not None:
            tokenizer_config[name] = value
    named = {tokenizer_config.get(n) for n in ("bos_token", "eos_token", "unk_token", "pad_token")}
    tokenizer_config["extra_special_tokens"] = [t for t in special if t not in named]
    if add_bos is not None:
        tokenizer_config["add_bos_token"] = bool(add_bos)
    if add_eos is not None:
        tokenizer_config["add_eos_token"] = bool(add_eos)
    if (template := meta.get("tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = template

    # Chat models end a turn with an end-of-turn token; generation must stop on it too.
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and value not in eos_ids:
            eos_ids.append(value)
    generation_config: dict[str, Any] = {"bos_token_id": bos_id}
    generation_config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids or None
    return tok, tokenizer_config, generation_config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
