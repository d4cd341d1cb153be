"""IncrementalDetokenizer on a real byte-level BPE tokenizer (trained here, nothing downloaded)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from libkk.engine.detokenizer import IncrementalDetokenizer
from libkk.sample.params import SamplingParams

CORPUS = [
    "Hello world, this is a small test of streaming text.",
    "The quick brown fox jumps over the lazy dog. The end.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 😀🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵, café, naïve, Ångström, ß.",
    "Stop here STOP or continue; the end is near. 你好世界！",
]
TEXTS = CORPUS + [
    "Unseen: 🦄 rides a 🚲 through 東京 and Zürich — 42 €, ½ price, ∑ x².",
    "混合 mixed 文本 with 😀 between 字 and 😎😎😎 at the end 🎉",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,  # few merges: multi-byte characters stay split over several tokens
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decoded window."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.windows: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        self.windows.append(len(ids))
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)


def stream(
    tok: Tokenizer, ids: Sequence[int], params: SamplingParams, chunk: int = 1
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids `chunk` at a time, taking a delta after each update; returns the deltas."""
    detok = IncrementalDetokenizer(tok, [1, 2, 3], params)
    deltas: list[str] = []
    stop = None
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk])
        deltas.append(detok.take_delta())
        if stop is not None:
            break
    deltas.append(detok.flush())
    return detok, deltas, stop


def test_tokenizer_splits_characters_across_tokens(tok: Tokenizer) -> None:
    # Guards the other tests: many tokens decode to a partial character on their own, and some
    # hold a whole character plus part of the next one.
    ids = [i for text in TEXTS for i in tok.encode(text).ids]
    pieces = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) >= 50
    assert any("\ufffd" in p and p.replace("\ufffd", "").strip() for p in pieces)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stream_equals_full_decode_and_never_emits_half_characters(
    tok: Tokenizer, chunk: int
) -> None:
    for text in TEXTS:
        ids = tok.encode(text).ids
        detok, deltas, stop = stream(tok, ids, SamplingParams(), chunk)
        assert stop is None
        assert "".join(deltas) == detok.output_text == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)


def test_cost_per_token_is_bounded(tok: Tokenizer) -> None:
    counting = CountingTokenizer(tok)
    ids = tok.encode(" ".join(TEXTS * 8)).ids
    detok = IncrementalDetokenizer(counting, [], SamplingParams())
    for t in ids:
        detok.update([t])
    detok.flush()
    assert detok.output_text == tok.decode(ids)
    assert len(ids) > 500
    assert max(counting.windows) <= 8  # a few tokens, not the whole output
    assert len(counting.windows) <= 2 * len(ids) + 1


def test_several_tokens_per_update_decode_as_one_window(tok: Tokenizer) -> None:
    """A verification step appends several tokens: two decodes per update, not per token, unless
    the window ends inside a character (then each token's window, as one-by-one arrival)."""
    ids = tok.encode(" ".join([CORPUS[0], CORPUS[1]] * 4)).ids  # ASCII: no split characters
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, [], SamplingParams())
    updates = 0
    for i in range(0, len(ids), 4):
        detok.update(ids[i : i + 4])
        updates += 1
    detok.flush()
    assert detok.output_text == tok.decode(ids)
    assert len(counting.windows) <= 2 * updates + 1 < len(ids)


def test_invalid_byte_sequences_still_match_full_decode(tok: Tokenizer) -> None:
    # Random ids include lone continuation bytes and truncated sequences (genuine U+FFFD).
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        detok, deltas, _ = stream(tok, ids, SamplingParams())
        assert "".join(deltas) == detok.output_text == tok.decode(ids)
    # Long runs of tokens that are each part of a character (mostly invalid together): the
    # window ends in U+FFFD for many tokens in a row, and the text must still come out exact.
    partial = [i for i in range(vocab) if "\ufffd" in tok.decode([i])]
    for _ in range(30):
        ids = [rng.choice(partial) for _ in range(120)]
        for chunk in (1, 5):
            detok, deltas, _ = stream(tok, ids, SamplingParams(), chunk)
            assert "".join(deltas) == detok.output_text == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<eos>")
    ids = tok.encode("Hello world").ids + [eos]
    detok, deltas, _ = stream(tok, ids, SamplingParams())
    assert "".join(deltas) == "Hello world"
    detok, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "Hello world<eos>"


def _spans_tokens(tok: Tokenizer, text: str, sub: str) -> bool:
    """True if no single token of text decodes to a string containing sub."""
    return not any(sub in tok.decode([i]) for i in tok.encode(text).ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The quick brown fox jumps over the lazy dog. The end.", "lazy dog"),
        ("Stop here STOP or continue; the end is near. 你好世界！", "世界"),
        ("Emoji: 😀🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵, café", "🎉👩"),
        ("Hello world, this is a small test of streaming text.", "s a s"),
    ],
)
def test_stop_string_spanning_tokens(tok: Tokenizer, text: str, stop: str, include: bool) -> None:
    assert _spans_tokens(tok, text, stop)
    ids = tok.encode(text).ids
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    for chunk in (1, 3):
        detok, deltas, matched = stream(tok, ids, params, chunk)
        cut = text.index(stop) + (len(stop) if include else 0)
        assert matched == stop == detok.stop_reason
        assert detok.output_text == text[:cut]
        assert "".join(deltas) == text[:cut]


def test_stop_strings_never_leak_into_streamed_text(tok: Tokenizer) -> None:
    text = "Stop here STOP or continue; the end is near. 你好世界！"
    ids = tok.encode(text).ids
    for stop in ["STOP", "the end", "end is", "near. 你", "好世界", "continue;"]:
        params = SamplingParams(stop=[stop, "never appears"])
        detok = IncrementalDetokenizer(tok, [], params)
        streamed = ""
        for t in ids:
            matched = detok.update([t])
            streamed += detok.take_delta()
            # Everything handed out is final text: a prefix of the text cut before the stop.
            assert text[: text.index(stop)].startswith(streamed), (stop, streamed)
            if matched:
                break
        assert matched == stop
        assert streamed + detok.flush() == text[: text.index(stop)]


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. The end."
    ids = tok.encode(text).ids
    # Both complete within one update (all tokens at once); the earlier one in the text wins.
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["lazy", "fox"]))
    assert detok.update(ids) == "fox"
    assert detok.output_text == "The quick brown "


def test_stop_strings_ignored_under_min_tokens(tok: Tokenizer) -> None:
    text = "Stop here STOP or continue; the end is near."
    ids = tok.encode(text).ids
    first = len(tok.encode("Stop here STOP").ids) + 1
    params = SamplingParams(stop=["STOP", "end"], min_tokens=first)
    detok, deltas, matched = stream(tok, ids, params)
    assert matched == "end"
    assert "".join(deltas) == "Stop here STOP or continue; the "


def test_flush_releases_possible_stop_prefix(tok: Tokenizer) -> None:
    text = "Hello world, this is a small test"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["test of streaming"]))
    assert detok.update(ids) is None
    # "test" could still become the stop string: held back until the request finishes.
    assert detok.take_delta() == "Hello world, this is a small "
    assert detok.flush() == "test"
    assert detok.update(tok.encode(" of streaming").ids) is None  # finished: ignored
    assert detok.output_text == text


def test_flush_emits_trailing_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀").ids
    partial = ids[:-1]
    assert tok.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(partial)
    streamed = detok.take_delta()
    assert "\ufffd" not in streamed
    # A request cut off mid-character ends with what the full decode shows for it.
    rest = detok.flush()
    assert rest.endswith("\ufffd")
    assert streamed + rest == detok.output_text == tok.decode(partial)


def test_ids_past_the_tokenizers_vocabulary_have_no_text(tok: Tokenizer) -> None:
    """A model whose embedding is padded past the tokenizer can sample such an id: the stream's
    text is that of the other ids."""
    vocab = tok.get_vocab_size()
    ids = tok.encode(TEXTS[3]).ids
    padded = [t for i in ids for t in ((i, vocab + 7) if i % 3 == 0 else (i,))]
    assert len(padded) > len(ids)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(), vocab_size=vocab)
    deltas = [detok.update([t]) or detok.take_delta() for t in padded]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.output_text == TEXTS[3]
