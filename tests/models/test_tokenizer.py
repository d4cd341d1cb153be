"""libkk's Tokenizer against transformers' AutoTokenizer on the same folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from libkk.errors import CorruptCheckpointError, InvalidRequestError, ModelNotFoundError
from libkk.models.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is",
    "",
    " ",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nmixed\n\n\n",
    "I'm sure they'll say it's fine, don't you think?",
    "Café naïve résumé façade Ångström",
    "你好，世界！日本語のテキスト 한국어",
    "emoji 🤗 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "numbers 3.14159 and  2024 and 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>libkk<file_sep>x.py",
    "not special: <|im_start |> <im_end>",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2? 🤔"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in français."},
    ],
]


@pytest.fixture(scope="module")
def ours(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="module")
def hf(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


# ---------------------------------------------------------------- the default model's folder


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == hf.encode(
            text, add_special_tokens=special
        )
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


def test_special_ids_match_transformers(ours: Tokenizer, hf: Any) -> None:
    assert ours.eos_token_ids == frozenset({hf.eos_token_id}) == frozenset({2})
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.vocab_size == len(hf) == 49152
    assert ours.all_special_ids == frozenset(hf.all_special_ids)
    # SmolLM2 adds no BOS: the chat template writes <|im_start|> itself.
    assert ours.encode("hi")[0] != ours.bos_token_id
    assert ours.decode([1, 28, 2]) == ours.decode([28])


def test_decode_rejects_bad_ids(ours: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match=r"ids\[1\] = 49152 is out of range"):
        ours.decode([5, 49152])
    with pytest.raises(InvalidRequestError, match=r"ids\[0\] = -1"):
        ours.decode([-1])
    with pytest.raises(InvalidRequestError, match=r"ids\[0\] must be an int, got str"):
        ours.decode(["7"])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match="must be a str"):
        ours.encode(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, hf: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    got = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert got == want
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert ours.encode(got, add_special_tokens=False) == hf.encode(got, add_special_tokens=False)


def test_chat_template_default_adds_generation_prompt(ours: Tokenizer) -> None:
    text = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ("hello", r"messages must be a list of dicts, got str"),
        ([], r"messages is empty"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role' key"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\] has no 'content'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a str, got int"),
        ([{"role": None, "content": "x"}], r"messages\[0\]\['role'\] must be a str, got NoneType"),
    ],
)
def test_bad_messages(ours: Tokenizer, messages: Any, error: str) -> None:
    with pytest.raises(InvalidRequestError, match=error):
        ours.apply_chat_template(messages)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Tokenizer.from_folder(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CorruptCheckpointError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


# ------------------------------------------------------------------- small synthetic folders


def small_folder(
    path: Path, tokenizer_config: dict[str, Any], *, bos_post_processor: bool = False, **files: Any
) -> Path:
    """A byte-level BPE folder with a handful of tokens, fast for transformers to load."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<s>", "</s>", "<|eot|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(alphabet) + ["he", "Ġhe"])}
    backend = Backend(models.BPE(vocab=vocab, merges=[("h", "e"), ("Ġ", "he")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        **tokenizer_config,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (path / name.replace("__", ".")).write_text(
            content if isinstance(content, str) else json.dumps(content)
        )
    return path


@pytest.mark.parametrize(
    ("config", "post_processor_bos", "bos_count"),
    [
        ({}, False, 0),
        ({}, True, 1),  # tokenizer.json's post-processor adds BOS
        ({"add_bos_token": True}, True, 1),  # flag and post-processor: still one BOS
        # transformers >= 5 ignores tokenizer_config's flags when tokenizer.json exists.
        ({"add_bos_token": True}, False, 0),
        ({"add_bos_token": False}, True, 1),
        ({"add_bos_token": True, "add_eos_token": True}, False, 0),
    ],
)
def test_bos_rules_match_transformers(
    tmp_path: Path, config: dict[str, Any], post_processor_bos: bool, bos_count: int
) -> None:
    from transformers import AutoTokenizer

    folder = small_folder(tmp_path, config, bos_post_processor=post_processor_bos)
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    for text in ["he he", "", "<s>he"]:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
    assert ours.encode("he he").count(0) == bos_count
    assert ours.encode("he he", add_special_tokens=False) == [259, 260]


def test_eos_ids_are_the_union(tmp_path: Path) -> None:
    folder = small_folder(
        tmp_path,
        {},
        generation_config__json={"eos_token_id": [2, 1]},
        config__json={"eos_token_id": 2, "bos_token_id": 0},
    )
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_ids == frozenset({1, 2})
    assert tok.bos_token_id == 0


def test_no_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(small_folder(tmp_path, {}))
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


RICH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index0 > 8 %}{% break %}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] | trim }}"
    "{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}\n"
    "{% endfor %}"
    "{% if tools %}TOOLS {{ tools | tojson(indent=1) }}\n{% endif %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% if think %} <think>{% endif %}{% endif %}"
)


@pytest.mark.parametrize("where", ["tokenizer_config", "jinja_file"])
def test_rich_template_matches_transformers(tmp_path: Path, where: str) -> None:
    from transformers import AutoTokenizer

    if where == "tokenizer_config":
        folder = small_folder(tmp_path, {"chat_template": RICH_TEMPLATE})
    else:
        folder = small_folder(tmp_path, {}, chat_template__jinja=RICH_TEMPLATE)
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    messages = [
        {"role": "system", "content": "hidden"},
        {"role": "user", "content": "  héllo 🤗  ", "meta": {"ünï": "<b>&", "n": [1, 2.5]}},
        {"role": "assistant", "content": "ok", "tool_calls": None},
    ]
    tools = [{"name": "get_weather", "parameters": {"city": "Zürich"}}]
    for kwargs in ({}, {"tools": tools, "think": True}):
        got = ours.apply_chat_template(messages, **kwargs)
        want = hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert got == want
    assert '"ünï": "<b>&"' in got  # tojson keeps non-ASCII and HTML characters as they are
    assert got.startswith("<s>[USER] héllo 🤗 ")


def test_template_raise_exception(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    tok = Tokenizer.from_folder(small_folder(tmp_path, {"chat_template": template}))
    assert tok.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="roles must be user/assistant"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('touch PWNED').read() }}",
        "{{ ''.__class__.__base__.__subclasses__() }}",
        "{% set _ = messages.append({'role': 'x', 'content': 'y'}) %}{{ messages | length }}",
        "{% set _ = messages[0].update({'content': 'changed'}) %}{{ messages[0].content }}",
        "{{ raise_exception.__globals__ }}",
        "{{ dict.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
    ],
)
def test_sandbox_blocks_unsafe_templates(
    tmp_path: Path, template: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tok = Tokenizer.from_folder(small_folder(tmp_path / "m", {"chat_template": template}))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="unsafe operation"):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]
    assert not (tmp_path / "PWNED").exists()


def test_template_that_does_not_compile(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(
        small_folder(tmp_path, {"chat_template": "{% for m in messages %}"})
    )
    with pytest.raises(CorruptCheckpointError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_folder_copy_keeps_behaviour(
    tmp_path: Path, default_model_dir: Path, ours: Tokenizer
) -> None:
    """Only tokenizer.json + tokenizer_config.json (what other tests copy) behave the same."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    copy = Tokenizer.from_folder(tmp_path)
    assert copy.eos_token_ids == ours.eos_token_ids
    text = copy.apply_chat_template([{"role": "user", "content": "x"}])
    assert text == ours.apply_chat_template([{"role": "user", "content": "x"}])
    assert copy.encode(text) == ours.encode(text)
