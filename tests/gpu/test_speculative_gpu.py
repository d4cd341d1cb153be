"""Speculative decoding on CUDA: greedy output with n-gram and draft-model proposers equals plain
greedy output, with FULL graphs for decode and for uniform verification batches (1 + K tokens per
request), eager and compiled; seeded sampling with speculation is batch-invariant."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 2048


def _write(path, layers, hidden, seed, cyclic=False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.checkpoints import save_with_word_tokenizer

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8 if hidden >= 256 else 32,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    if cyclic:  # greedy output cycles through groups of 8 ids: n-gram drafts get accepted
        ids = torch.arange(VOCAB)
        prev = (ids // 8) * 8 + (ids - 1) % 8
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight[prev])
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.01)
                layer.mlp.down_proj.weight.mul_(0.002)
    return save_with_word_tokenizer(model, path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    mk = tmp_path_factory.mktemp
    return {
        "target": _write(mk("target"), 3, 256, 0),
        "draft": _write(mk("draft"), 1, 128, 1),
        "cyclic": _write(mk("cyclic"), 2, 256, 0, cyclic=True),
    }


def _prompts(n=12):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, VOCAB, (int(5 + 7 * i),), generator=g).tolist() for i in range(n)]


def _generate(path, params, compile_=False, **spec):
    from libkk import Session

    with Session(
        str(path),
        device="cuda",
        dtype="float32",
        max_num_seqs=16,
        max_model_len=512,
        torch_compile=compile_,
        progress=False,
        **spec,
    ) as s:
        outs = s.generate(_prompts(), params)
        return [o.token_ids for o in outs], s.stats()


@pytest.mark.parametrize("compile_", [False, True])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "self"])
def test_greedy_with_speculation_equals_plain(dirs, method, compile_):
    from libkk import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    target = dirs["cyclic"] if method == "ngram" else dirs["target"]
    # The default backoff, so with asynchronous scheduling: paused requests' steps run ahead.
    spec = dict(method="draft_model", num_speculative_tokens=4)
    if method == "ngram":
        spec = dict(method="ngram", num_speculative_tokens=4)
    else:
        spec["draft_model"] = str(dirs["draft"] if method == "draft_model" else dirs["target"])
    if method == "self":  # drafting for itself never pays: without the backoff every step drafts
        spec["draft_backoff"] = False
    plain, _ = _generate(target, params, compile_)
    fast, stats = _generate(target, params, compile_, **spec)
    assert fast == plain
    assert stats["spec_num_draft_tokens"] > 0
    if method in ("ngram", "self"):
        assert stats["spec_mean_acceptance_length"] > 2.5


def test_seeded_speculation_batch_invariant_on_cuda(dirs):
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=32, temperature=0.8, top_k=40, seed=9, ignore_eos=True)
    # Two sessions compared: without the backoff, whose break-even each session times itself.
    spec = dict(
        method="draft_model",
        draft_model=str(dirs["target"]),
        draft_sampling="probabilistic",
        num_speculative_tokens=3,
        draft_backoff=False,
    )
    together, stats = _generate(dirs["target"], params, **spec)
    assert stats["spec_num_accepted_tokens"] > 0
    with Session(
        str(dirs["target"]), device="cuda", dtype="float32", max_num_seqs=1, max_model_len=512,
        torch_compile=False, progress=False, **spec,
    ) as s:  # fmt: skip
        alone = [s.generate(p, params).token_ids for p in _prompts()[:4]]
    assert alone == together[:4]


def test_backoff_times_its_break_evens_at_batch_sizes_and_graphs_cover_looks(dirs):
    """The draft backoff (adaptive verification off): graphs for 1, 2 (a look) and 1 + K tokens a
    request; their replays timed at the powers of two up to max_num_seqs; a break-even per batch
    size, never below 1, read from the largest timed size beyond it. Greedy output is plain."""
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _generate(dirs["cyclic"], params)
    with Session(
        str(dirs["cyclic"]), device="cuda", dtype="float32", max_num_seqs=16, max_model_len=512,
        torch_compile=False, progress=False, method="ngram", num_speculative_tokens=4,
    ) as s:  # fmt: skip
        backoff = s.engine.speculation.backoff
        assert backoff is not None and s.engine.speculation.adaptive is None
        assert sorted({q for _, q in s.engine.runner.graph_shapes()}) == [1, 2, 5]
        for n in (1, 2, 3, 16, 40):
            assert backoff.break_even(n, 4) >= 1.0 and backoff.break_even(n, 1) >= 1.0
        assert backoff.break_even(40, 4) == backoff.break_even(16, 4)
        outs = [o.token_ids for o in s.generate(_prompts(), params)]
    assert outs == plain


def test_adaptive_verification_graphs_and_their_costs(dirs):
    """With adaptive verification every verification length 1 .. 1 + K has graphs, each graph's
    cost is profiled at start-up, and replaying a graph on padding rows (the profile) between
    steps leaves the requests in flight alone: the output equals plain greedy."""
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _generate(dirs["cyclic"], params)
    with Session(
        str(dirs["cyclic"]), device="cuda", dtype="float32", max_num_seqs=16, max_model_len=512,
        torch_compile=False, progress=False, method="ngram", num_speculative_tokens=4,
        adaptive_verification=True,
    ) as s:  # fmt: skip
        runner, adaptive = s.engine.runner, s.engine.speculation.adaptive
        assert adaptive is not None
        shapes = runner.graph_shapes()
        assert sorted({q for _, q in shapes}) == [1, 2, 3, 4, 5]
        cost = adaptive.verifier.cost
        assert cost.graph_query_lens == [1, 2, 3, 4, 5]
        assert cost.graph_sizes == sorted({n for n, _ in shapes})
        assert cost.graph(16, 5) > 0
        rids = [s.submit(p, params) for p in _prompts()]
        done = {}
        for step in range(400):
            if step == 3:
                for n, q in shapes:
                    runner.verify_on_graph(n, q)
            for out in s.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            if len(done) == len(rids):
                break
        stats = s.stats()
    assert [done[r] for r in rids] == plain
    assert stats["spec_num_draft_tokens"] > 0
