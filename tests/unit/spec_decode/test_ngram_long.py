"""ngram_lookup on long sequences against a brute-force search (many earlier occurrences)."""

import random

from libkk.spec_decode.ngram import ngram_lookup


def _brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def test_long_sequences_match_brute_force():
    rng = random.Random(1)
    found = 0
    for _ in range(150):
        vocab = rng.choice([3, 20, 500])
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 150))]
        if rng.random() < 0.5:  # repeated phrases: many long matches
            tokens += phrase * rng.randint(1, 10) + phrase[: rng.randint(0, len(phrase))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 8)
        k = rng.randint(1, 8)
        want = _brute(tokens, lo, hi, k)
        assert ngram_lookup(tokens, lo, hi, k) == want, (tokens, lo, hi, k)
        found += bool(want)
    assert 30 < found < 150  # both outcomes exercised
