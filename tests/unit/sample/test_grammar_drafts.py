"""Drafts under a grammar: the cut at the first token it forbids, the masks of the verification
rows along the kept drafts, the matcher left at the output tokens, and a request's grammar
following only the tokens verification accepted."""

from __future__ import annotations

import pytest
import torch

from libkk.engine.request import Request, RequestStatus
from libkk.sample.grammar import GrammarCompiler, allows
from libkk.sample.params import SamplingParams, StructuredOutput

DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    from libkk.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(default_model_dir)
    grammars = GrammarCompiler(
        default_model_dir / "tokenizer.json", tok.vocab_size, tok.eos_token_ids
    )
    return grammars, tok


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _request(grammars, tok, structured: dict, max_tokens: int = 40) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, structured=structured)
    return Request(
        "r",
        [1, 2],
        params,
        seed=0,
        eos_token_ids=tok.eos_token_ids,
        max_tokens=max_tokens,
        arrival_time=0.0,
        grammar=grammars.matcher(params.structured),
    )


def test_draft_masks_cut_at_the_first_forbidden_token_and_roll_back(compiler):
    grammars, tok = compiler
    m = grammars.matcher(StructuredOutput(regex=DATE))
    head = _ids(tok, "2024-")
    for t in head:
        assert m.consume(t)
    before = m.next_mask().clone()
    drafts = _ids(tok, "05-17") + _ids(tok, "x") + _ids(tok, "1")
    masks = m.draft_masks(drafts)
    n = len(_ids(tok, "05-17"))
    assert masks.shape == (n + 1, before.shape[0]) and masks.dtype == torch.int32
    # The matcher is where it was: same count, same mask, and it goes on from there.
    assert m.num_consumed == len(head) and m.error() is None and not m.is_finished()
    assert torch.equal(m.next_mask(), before)
    assert m.consume(drafts[0])
    m.rollback(1)
    assert torch.equal(m.next_mask(), before)  # recomputed from the matcher's state
    # Row k is the mask of a fresh matcher after the output and drafts[:k].
    fresh = grammars.matcher(StructuredOutput(regex=DATE))
    for t in head:
        fresh.consume(t)
    for k in range(n + 1):
        assert torch.equal(masks[k], fresh.next_mask()), k
        if k < n:
            assert allows(masks[k], drafts[k])
            assert fresh.consume(drafts[k])
    assert fresh.is_finished()  # the date is complete: only EOS may follow
    assert not allows(masks[n], drafts[n])  # "x" is cut
    for t in _ids(tok, "05-17"):
        assert m.consume(t)
    assert m.is_finished() and m.error() is None


def test_a_forbidden_first_draft_and_out_of_range_ids_keep_no_draft(compiler):
    grammars, tok = compiler
    m = grammars.matcher(StructuredOutput(regex=DATE))
    for drafts in (_ids(tok, "x2024"), [-1, 34], [10**6]):
        masks = m.draft_masks(drafts)
        assert masks.shape[0] == 1 and torch.equal(masks[0], m.next_mask())
    assert m.num_consumed == 0 and m.error() is None


def test_request_cuts_drafts_and_follows_only_accepted_tokens(compiler):
    grammars, tok = compiler
    r = _request(grammars, tok, {"regex": DATE})
    r.append_tokens(_ids(tok, "2024-"), [None] * len(_ids(tok, "2024-")))
    good = _ids(tok, "05-1")
    r.spec_token_ids = [*good, *_ids(tok, "x"), *_ids(tok, "7")]
    r.draft_logits = torch.randn(len(r.spec_token_ids), 64)
    r.constrain_drafts()
    assert r.spec_token_ids == good and r.draft_logits.shape[0] == len(good)
    assert r.draft_grammar_masks.shape[0] == len(good)
    # A trim (budget, adaptive verification) keeps a prefix: the masks follow it.
    r.spec_token_ids = good[:2]
    assert r.verified_grammar_masks().shape[0] == 2
    # Verification accepts the first draft and rejects the second: the target's own token
    # follows. The grammar takes the accepted tokens only (the rejected draft never entered it).
    accepted = [good[0], _ids(tok, "9")[0]]
    r.clear_drafts()
    assert r.draft_grammar_masks is None and r.verified_grammar_masks() is None
    r.append_tokens(accepted, [None, None])
    assert r.status == RequestStatus.WAITING and r.grammar.error() is None
    fresh = grammars.matcher(StructuredOutput(regex=DATE))
    for t in r.output_token_ids:
        assert fresh.consume(t)
    assert torch.equal(r.grammar.next_mask(), fresh.next_mask())
    assert r.grammar.num_consumed == len(r.output_token_ids)


def test_drafts_past_a_complete_grammar_are_cut_and_its_last_row_allows_eos(compiler):
    grammars, tok = compiler
    r = _request(grammars, tok, {"choice": ["yes", "no"]})
    yes, no = _ids(tok, "yes"), _ids(tok, "no")
    eos = min(tok.eos_token_ids)
    r.spec_token_ids = [*yes, *no]
    r.constrain_drafts()
    assert r.spec_token_ids == yes
    last = r.draft_grammar_masks[-1]
    assert allows(last, eos) and int(last.count_nonzero()) == 1  # only EOS after "yes"
    # Nothing follows a complete grammar, EOS included (the request stops on "yes" itself).
    r.spec_token_ids = [*yes, eos]
    r.constrain_drafts()
    assert r.spec_token_ids == yes and r.grammar.error() is None
    r.clear_drafts()
    r.append_tokens([*yes, eos], [None] * (len(yes) + 1))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == yes
    assert r.grammar.num_consumed == len(yes)


def test_an_eos_draft_where_the_grammar_may_end_is_kept_and_rolled_back(compiler):
    grammars, tok = compiler
    m = grammars.matcher(StructuredOutput(regex=r"\d+"))
    first = m.next_mask().clone()
    digits, eos = _ids(tok, "12"), min(tok.eos_token_ids)
    masks = m.draft_masks([*digits, eos, *_ids(tok, "3")])
    assert masks.shape[0] == len(digits) + 2  # the digits and EOS; nothing after EOS
    assert allows(masks[len(digits)], eos)
    assert m.error() is None and not m.is_finished() and torch.equal(m.next_mask(), first)
    assert m.consume(digits[0])
    m.rollback(1)
    assert torch.equal(m.next_mask(), first)  # recomputed from the matcher's state
    for t in [*digits, eos]:
        assert m.consume(t)
    assert m.is_finished() and m.error() is None


def test_unconstrained_requests_keep_their_drafts(compiler):
    _, tok = compiler
    r = Request(
        "u",
        [1, 2],
        SamplingParams(max_tokens=10),
        seed=0,
        eos_token_ids=tok.eos_token_ids,
        max_tokens=10,
        arrival_time=0.0,
    )
    r.spec_token_ids = [5, 6, 7]
    r.constrain_drafts()
    assert r.spec_token_ids == [5, 6, 7] and r.verified_grammar_masks() is None
