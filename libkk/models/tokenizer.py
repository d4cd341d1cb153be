"""The tokenizer the engine uses: `tokenizer.json` through the `tokenizers` library, plus the
special tokens, BOS/EOS rules and chat template from the folder's config files.

Everything here is meant to give the same ids and text as Hugging Face's `AutoTokenizer` on the
same folder; chat templates render in a sandboxed Jinja environment because they come with
downloaded models and are untrusted code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from libkk.errors import CorruptCheckpointError, InvalidRequestError, ModelNotFoundError

# The roles a chat message may have: what chat templates are written for.
CHAT_ROLES = ("system", "user", "assistant", "tool")

_NAMED_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """Text <-> token ids for one model folder. Build it with `Tokenizer.from_folder(path)`."""

    def __init__(
        self,
        backend: Any,
        *,
        special_tokens: Mapping[str, str],
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        chat_template: str | None,
        chat_template_source: str,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend  # tokenizers.Tokenizer, post-processor already settled
        self._special_tokens = dict(special_tokens)
        self._eos_token_ids = eos_token_ids
        self._bos_token_id = bos_token_id
        self._chat_template = chat_template
        self._chat_template_source = chat_template_source
        self._clean_up = clean_up_tokenization_spaces
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and the optional tokenizer_config.json, generation_config.json,
        config.json and chat_template.jinja of an HF-layout folder."""
        folder = Path(path)
        if not folder.is_dir():
            raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelNotFoundError(
                f"model folder {str(folder)!r} has no tokenizer.json (libkk reads tokenizers from "
                "tokenizer.json only)"
            )
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise CorruptCheckpointError(f"cannot read {str(tokenizer_file)!r}: {exc}") from exc
        tok_config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        special = {
            name: token
            for name in _NAMED_SPECIAL
            if (token := _token_content(tok_config.get(name))) is not None
        }

        def token_id(token: str | None) -> int | None:
            return None if token is None else backend.token_to_id(token)

        # NOTE: whether BOS/EOS are added is tokenizer.json's post-processor alone. transformers
        # (>= 5) drops tokenizer_config's add_bos_token/add_eos_token whenever tokenizer.json
        # exists, and we match it; applying both could add BOS twice. libkk's GGUF converter
        # writes the two consistently.
        eos_ids: set[int] = set()
        for source in (gen_config.get("eos_token_id"), model_config.get("eos_token_id")):
            eos_ids.update(_id_list(source))
        if (eos_id := token_id(special.get("eos_token"))) is not None:
            eos_ids.add(eos_id)
        bos_id = token_id(special.get("bos_token"))
        if bos_id is None:
            for source in (gen_config.get("bos_token_id"), model_config.get("bos_token_id")):
                if isinstance(source, int):
                    bos_id = source
                    break

        template, template_source = _find_chat_template(folder, tok_config)
        return cls(
            backend,
            special_tokens=special,
            eos_token_ids=frozenset(eos_ids),
            bos_token_id=bos_id,
            chat_template=template,
            chat_template_source=template_source,
            clean_up_tokenization_spaces=bool(
                tok_config.get("clean_up_tokenization_spaces", False)
            ),
        )

    # ----------------------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: generation_config's and config's eos_token_id plus the
        tokenizer's eos_token."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens (bos_token, eos_token, ...) as strings."""
        return dict(self._special_tokens)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Every id that `decode(..., skip_special_tokens=True)` drops, plus the named ones."""
        ids = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        ids.update(
            i
            for t in self._special_tokens.values()
            if (i := self._backend.token_to_id(t)) is not None
        )
        return frozenset(ids)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja source, or None."""
        return self._chat_template

    # ---------------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS/EOS as the model's config says."""
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"text to encode must be a str, got {type(text).__name__}: {text!r:.80}"
            )
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # what `tokenizers` raises for a str that UTF-8 cannot encode
            check_utf8("text to encode", text)
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless skip_special_tokens is False."""
        ids = self._check_ids(ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        # transformers skips this clean-up for BPE models: it would eat real spaces there.
        if self._clean_up and type(self._backend.model).__name__ != "BPE":
            for before, after in (
                (" .", "."),
                (" ?", "?"),
                (" !", "!"),
                (" ,", ","),
                (" ' ", "'"),
                (" n't", "n't"),
                (" 'm", "'m"),
                (" 's", "'s"),
                (" 've", "'ve"),
                (" 're", "'re"),
            ):
                text = text.replace(before, after)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(self._check_ids([token_id])[0])

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        vocab = self._vocab_size
        # The common case first (a detokenizer's few-token window of the engine's own samples):
        # a list of plain ints in range passes in one sweep.
        if type(ids) is list and all(type(v) is int and 0 <= v < vocab for v in ids):
            return ids
        try:
            if isinstance(ids, (str, bytes, Mapping)):
                raise TypeError
            out = list(ids)
        except TypeError:
            raise InvalidRequestError(
                f"token ids must be a sequence of ints, got {type(ids).__name__}"
            ) from None
        for i, value in enumerate(out):
            # bool is an int subclass but never a token id; numpy ints pass via __index__.
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise InvalidRequestError(
                    f"token ids[{i}] must be an int, got {type(value).__name__}: {value!r:.40}"
                )
            value = out[i] = value.__index__()
            if not 0 <= value < self._vocab_size:
                raise InvalidRequestError(
                    f"token ids[{i}] = {value} is out of range [0, {self._vocab_size})"
                )
        return out

    # -------------------------------------------------------------------------- chat template

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template, as
        `transformers`' `apply_chat_template(..., tokenize=False)` does.

        Extra keyword arguments (e.g. `tools`, `documents`, `enable_thinking`) are passed to the
        template. Raises InvalidRequestError for bad messages, a model without a chat template,
        or a template that rejects the conversation.
        """
        if self._chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template (none in tokenizer_config.json or "
                "chat_template.jinja); pass a plain prompt instead of messages"
            )
        chat = _validate_messages(messages)
        template = self._compiled_template
        context: dict[str, Any] = dict(self._special_tokens)
        context.update(tools=None, documents=None)
        context.update(_plain(kwargs))
        context.update(messages=chat, add_generation_prompt=bool(add_generation_prompt))
        try:
            return template.render(**context)
        except jinja2.exceptions.SecurityError as exc:
            raise InvalidRequestError(
                f"the chat template ({self._chat_template_source}) attempted an unsafe operation "
                f"and was stopped by the sandbox: {exc}"
            ) from exc
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception(...) in the template lands here: the template's own message.
            raise InvalidRequestError(
                f"the chat template ({self._chat_template_source}) rejected the messages: {exc}"
            ) from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidRequestError(
                f"the chat template ({self._chat_template_source}) failed on these messages: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    @cached_property
    def _compiled_template(self) -> Any:
        env = _StrictSandbox(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        )

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(
            value: Any,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: Any = None,
            sort_keys: bool = False,
        ) -> str:
            # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
            return json.dumps(
                value,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        def make_dict(*args: Any, **kw: Any) -> dict[Any, Any]:
            return dict(*args, **kw)  # the type object itself stays out of the template's reach

        env.filters["tojson"] = tojson
        env.globals.update(
            raise_exception=raise_exception, strftime_now=strftime_now, dict=make_dict
        )
        try:
            return env.from_string(self._chat_template)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise CorruptCheckpointError(
                f"the chat template ({self._chat_template_source}) does not compile: "
                f"line {exc.lineno}: {exc.message}"
            ) from exc


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute raises at once instead of quietly becoming
    an undefined value that renders as ""; a template probing for internals fails loudly."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
    rendering it is just its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the chat is a list of {'role': str, 'content': str, ...} dicts; return a plain copy
    (the template never sees or mutates the caller's objects)."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(
            f"messages must be a list of dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidRequestError("messages is empty; expected at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{i}] must be a dict with 'role' and 'content', got "
                f"{type(message).__name__}: {message!r:.80}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise InvalidRequestError(f"messages[{i}] has no {key!r} key")
            if not isinstance(message[key], str):
                raise InvalidRequestError(
                    f"messages[{i}][{key!r}] must be a str, got {type(message[key]).__name__}: "
                    f"{message[key]!r:.80}"
                )
        if message["role"] not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}]['role'] is {message['role']!r:.40}: expected one of "
                f"{', '.join(CHAT_ROLES)}"
            )
        check_utf8(f"messages[{i}]['content']", message["content"])
        # Like transformers: a key set to None is dropped, templates handle absent keys better.
        out.append({str(k): _plain(v) for k, v in message.items() if v is not None})
    return out


def check_utf8(name: str, text: str) -> None:
    """Refuses a str that UTF-8 cannot encode (a lone surrogate such as "\\udcff", which a decode
    with errors="surrogateescape" leaves behind), naming `name` and the index."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{name} has a lone surrogate {text[e.start]!r} at index {e.start}: expected text "
            "that UTF-8 can encode"
        ) from None


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types, so templates cannot reach the methods of
    arbitrary caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"  # an inert placeholder, as transformers does


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise CorruptCheckpointError(
            f"{str(path)!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _find_chat_template(folder: Path, tok_config: Mapping[str, Any]) -> tuple[str | None, str]:
    """The chat template and where it came from: chat_template.jinja (transformers >= 4.49
    saves it there), chat_template.json, or tokenizer_config.json's `chat_template`."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), "chat_template.jinja"
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        template = _read_json(json_file).get("chat_template")
        if isinstance(template, str):
            return template, "chat_template.json"
    template = tok_config.get("chat_template")
    if isinstance(template, str):
        return template, "tokenizer_config.json"
    if isinstance(template, list):
        # Several named templates: the plain chat one is called "default".
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"], "tokenizer_config.json (default)"
    return None, "none"
