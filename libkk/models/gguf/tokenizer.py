"""GGUF `tokenizer.*` metadata -> tokenizer.json, tokenizer_config.json, generation_config.json.

Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2": SmolLM2, Llama 3, Qwen, Phi-4,
gpt-oss's o200k harmony vocabulary) become a `tokenizers` BPE with the pre-tokenizer llama.cpp
uses for `tokenizer.ggml.pre`; SentencePiece
vocabularies ("llama": Llama 2, Mistral, Mixtral, Phi-3, Gemma 3 with its control tokens and no
space prefix) become the byte-fallback BPE that transformers builds for them, with merges derived
from the token scores.
"""

from __future__ import annotations

from typing import Any

from libkk.errors import CorruptCheckpointError, UnsupportedModelError
from libkk.models.gguf.metadata import Metadata

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

# llama.cpp's GGUF token types (gguf.TokenType).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_BYTE = 1, 2, 3, 4, 6

# Pre-tokenizer regexes, by `tokenizer.ggml.pre`. They must split text exactly as llama.cpp does
# for that name, or merges learned on other splits get applied.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: llama-3's with single digits.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's GPT-2 regex, i.e. what `ByteLevel(use_regex=True)` does on its own.
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
# llama.cpp splits every digit off (`\p{N}`) and then applies the GPT-2 regex.
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez", "hunyuan")
# o200k (GPT-4o, gpt-oss's harmony vocabulary): the regex of its tokenizer.json, which llama.cpp
# rewrites without Unicode case classes to the same effect.
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K_PRE = ("gpt-4o",)
# End-of-turn tokens the HF checkpoints' generation_config stops on besides EOS, which the GGUF
# does not always name (llama.cpp finds them by their text); added when they are control tokens.
_END_OF_TURN = {
    "gemma3_text": ("<end_of_turn>",),
    "gpt_oss": ("<|return|>", "<|call|>", "<|endoftext|>"),
    "phi3": ("<|end|>", "<|im_end|>", "<|endoftext|>"),
}


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
    if pre in _QWEN2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), False
    if pre in _O200K_PRE:
        # Whole pieces first, as tiktoken encodes (ignore_merges).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_O200K_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), True
    known = ", ".join(_GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE + _QWEN2_PRE + _O200K_PRE)
    raise UnsupportedModelError(
        f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: {known}"
    )


def _bpe_merges(meta: Metadata) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(meta.require("tokenizer.ggml.merges")):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CorruptCheckpointError(
                f"GGUF tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens separated by "
                "a space"
            )
        merges.append((parts[0], parts[1]))
    return merges


def _spm_merges(
    tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Merges equivalent to SentencePiece's score-driven joining, as transformers derives them:
    every split of a normal token into two vocabulary pieces, ranked by the joined token's score
    (highest first), then by the pieces' ids."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, kind, score in zip(tokens, types, scores, strict=True):
        if kind != _TOKEN_NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_tokenizer(
    meta: Metadata, config: dict[str, Any]
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """tokenizer.json (a `tokenizers.Tokenizer`), tokenizer_config.json and
    generation_config.json from the `tokenizer.*` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(repr(k) for k in SUPPORTED_TOKENIZER_MODELS)} "
            "(byte-level BPE, SentencePiece)"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CorruptCheckpointError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CorruptCheckpointError("GGUF tokenizer.ggml.tokens holds duplicate tokens")

    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre") or "default"
        pre_tokenizer, ignore_merges = _pre_tokenizer(pre)
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=_bpe_merges(meta), ignore_merges=ignore_merges)
        )
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
    else:  # SentencePiece: "▁" for spaces, a leading "▁", <0xNN> byte fallback
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        if len(scores) != len(tokens):
            raise CorruptCheckpointError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=_spm_merges(tokens, types, scores, vocab),
                unk_token=unk,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        steps = [normalizers.Replace(" ", "▁")]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(steps)
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                *(
                    [decoders.Strip(" ", 1, 0)]
                    if meta.get("tokenizer.ggml.add_space_prefix", True)
                    else []
                ),
            ]
        )
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
    elif kind == "gpt2":
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
    for text in _END_OF_TURN.get(config.get("model_type", ""), ()):
        index = vocab.get(text)
        if index is not None and types[index] == _TOKEN_CONTROL and index not in eos_ids:
            eos_ids.append(index)
    generation_config: dict[str, Any] = {"bos_token_id": bos_id}
    generation_config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids or None
    return tok, tokenizer_config, generation_config
