"""The grammar mask: bit unpacking against a plain loop, the sampler's use of it (constrained rows
only, logprobs of the raw logits), and a matcher and a request following their tokens."""

from __future__ import annotations

import math

import pytest
import torch
from libkk.kernels.bitmask import apply_token_bitmask_ref

from libkk.engine.request import Request, RequestStatus
from libkk.errors import StructuredOutputError
from libkk.sample.grammar import GrammarCompiler, bitmask_words, compute_next_masks
from libkk.sample.params import SamplingParams, StructuredOutput
from libkk.sample.sampler import Sampler, SamplingRow


def _mask_of(allowed: list[int], vocab_size: int) -> torch.Tensor:
    words = [0] * bitmask_words(vocab_size)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    # int32 words (bit 31 set -> negative)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _apply_ref(logits: torch.Tensor, allowed: list[list[int]]) -> torch.Tensor:
    out = torch.full_like(logits, -math.inf)
    for r, ids in enumerate(allowed):
        ids = [t for t in ids if t < logits.shape[1]]
        out[r, ids] = logits[r, ids]
    return out


@pytest.mark.parametrize("mask_vocab, logits_vocab", [(100, 100), (70, 96), (96, 64), (33, 33)])
def test_bitmask_matches_a_loop(mask_vocab, logits_vocab):
    g = torch.Generator().manual_seed(mask_vocab)
    allowed = [
        torch.randperm(mask_vocab, generator=g)[: int(n)].tolist() for n in (0, 1, 5, mask_vocab)
    ]
    allowed[2] += [31, 0, mask_vocab - 1]  # word edges, bit 31 (the sign bit)
    logits = torch.randn(len(allowed), logits_vocab, generator=g)
    bitmask = torch.stack([_mask_of(a, mask_vocab) for a in allowed])  # [R, W]
    got = apply_token_bitmask_ref(logits.clone(), bitmask, torch.arange(len(allowed)))
    torch.testing.assert_close(got, _apply_ref(logits, allowed), rtol=0, atol=0)


def _row(
    params: SamplingParams, allowed: list[int] | None, vocab: int, seed: int = 1
) -> SamplingRow:
    mask = None if allowed is None else _mask_of(allowed, vocab)
    return SamplingRow(params, seed, 5, [1, 2], [], grammar_mask=mask)


def test_sampler_masks_constrained_rows_only():
    vocab = 80
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    hot = SamplingParams(temperature=1.0, logprobs=2)
    allowed = [7, 40, 63]
    rows = [
        _row(greedy, None, vocab),
        _row(greedy, allowed, vocab),
        _row(hot, allowed, vocab),
        _row(hot, None, vocab),
    ]
    assert not rows[1].keeps_raw_argmax() and rows[0].keeps_raw_argmax()
    out = Sampler()(logits, rows)
    free = Sampler()(logits[[0, 3]], [rows[0], rows[3]])
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] == max(allowed, key=lambda t: float(logits[1, t]))
    assert out.token_ids[2] in allowed
    assert out.token_ids[3] == free.token_ids[1]  # the unconstrained random row is untouched
    raw = logits.log_softmax(dim=-1)
    for i in range(4):  # logprobs of the raw logits, constrained or not
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.logprob == pytest.approx(float(raw[i, out.token_ids[i]]), abs=1e-5)
        assert [t for t, _ in lp.top] == raw[i].topk(2).indices.tolist()
    # Many keyed draws (one seed each): all allowed.
    draws = Sampler()(
        logits[2:3].repeat(40, 1), [_row(hot, allowed, vocab, seed) for seed in range(40)]
    )
    assert set(draws.token_ids) <= set(allowed) and len(set(draws.token_ids)) > 1


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    from libkk.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(default_model_dir)
    return GrammarCompiler(
        default_model_dir / "tokenizer.json", tok.vocab_size, tok.eos_token_ids
    ), tok


def test_matcher_follows_tokens(compiler):
    grammars, tok = compiler
    m = grammars.matcher(StructuredOutput(regex=r"\d{4}-\d{2}"))
    ids = tok.encode("2024-05", add_special_tokens=False)
    first = m.next_mask()
    assert first.dtype == torch.int32 and first.shape == (bitmask_words(tok.vocab_size),)
    assert (int(first[ids[0] // 32]) >> (ids[0] % 32)) & 1
    for t in ids:
        assert not m.is_finished()
        assert m.consume(t)
    assert m.is_finished() and m.error() is None
    m.rollback(1)
    assert not m.is_finished() and m.num_consumed == len(ids) - 1
    assert not m.consume(tok.encode("x", add_special_tokens=False)[0])
    assert m.error() is not None


def test_masks_computed_on_threads_equal_masks_computed_one_by_one(compiler):
    """compute_next_masks (the rows split over threads) gives each matcher the mask next_mask
    computes alone; a mask known already and a matcher in error are left as they are; too few
    rows for two threads are left to next_mask."""
    grammars, tok = compiler
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "k": {"enum": ["a"]}}}
    text = '{"n": 12, "k": "a"}'
    ids = tok.encode(text, add_special_tokens=False)
    specs = [StructuredOutput(json_schema=schema)] * 8 + [StructuredOutput(regex=r"\d{4}-\d{2}")]

    def advanced() -> list:
        out = []
        for i, spec in enumerate(specs):
            m = grammars.matcher(spec)
            for t in (ids if i < 8 else tok.encode("20", add_special_tokens=False))[: i % 6 + 1]:
                assert m.consume(t)
            out.append(m)
        return out

    alone, together = advanced(), advanced()
    want = [m.next_mask().clone() for m in alone]
    known = together[2].next_mask()
    assert not together[5].consume(tok.encode("[", add_special_tokens=False)[0])  # in error
    compute_next_masks(together, threads=2)
    assert all(m._mask is not None for m in together)  # every row computed by the call
    assert together[2].next_mask() is known
    assert not bool(together[5].next_mask().any())
    for i, (m, mask) in enumerate(zip(together, want, strict=True)):
        if i != 5:
            assert torch.equal(m.next_mask(), mask), i
    assert len({tuple(mask.tolist()) for mask in want}) > 3  # the states differ

    few = advanced()[:7]  # 7 rows: one thread's share, computed when asked
    compute_next_masks(few, threads=2)
    assert all(m._mask is None for m in few[1:])


def test_request_with_grammar_finishes_with_stop(compiler):
    grammars, tok = compiler
    params = SamplingParams(max_tokens=20, structured={"choice": ["yes", "no"]})
    r = Request(
        "r",
        [1, 2],
        params,
        seed=0,
        eos_token_ids=tok.eos_token_ids,
        max_tokens=20,
        arrival_time=0.0,
        grammar=grammars.matcher(params.structured),
    )
    # The mask waits for an in-flight token at sampling, not at scheduling (grammar_pending).
    assert not r.reads_token_values()
    r.num_pending_tokens = 1
    pending = r.sampling_row()
    assert pending.grammar_pending and pending.grammar_mask is None
    assert not pending.keeps_raw_argmax()
    r.num_pending_tokens = 0
    row = r.sampling_row()
    assert row.grammar_mask is not None and not row.grammar_pending and not row.keeps_raw_argmax()
    for t in tok.encode("yes", add_special_tokens=False):
        r.append_tokens([t], [None])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.finished


def test_request_with_disallowed_token_errors(compiler):
    grammars, tok = compiler
    params = SamplingParams(max_tokens=20, structured={"choice": ["yes", "no"]})
    r = Request(
        "r",
        [1, 2],
        params,
        seed=0,
        eos_token_ids=tok.eos_token_ids,
        max_tokens=20,
        arrival_time=0.0,
        grammar=grammars.matcher(params.structured),
    )
    r.append_tokens(tok.encode(" maybe", add_special_tokens=False)[:1], [None])
    assert r.status == RequestStatus.FINISHED_ERROR and "structured output" in (r.error or "")


def test_compiler_refuses_bad_constraints(compiler):
    grammars, _ = compiler
    with pytest.raises(StructuredOutputError, match="json_schema is invalid"):
        grammars.matcher(StructuredOutput(json_schema={"type": 3}))
    with pytest.raises(StructuredOutputError, match="regex is invalid"):
        grammars.matcher(StructuredOutput(regex="a("))
    with pytest.raises(StructuredOutputError, match="admits no output"):
        grammars.matcher(StructuredOutput(regex=r"[^\s\S]"))
