"""Speculative decoding never changes what the target produces: greedy output with any proposer
equals greedy output without, token for token, however requests are batched, chunked, preempted or
stopped; so does seeded sampling with one-hot drafts; seeded sampling with drawn drafts is
batch-invariant; bad settings fail clearly."""

from __future__ import annotations

import pytest
import torch
from e2e_prompts import PROMPTS

from libkk import SamplingParams, Session
from libkk.engine.speculation import DraftBackoff
from libkk.errors import ConfigError
from tests.checkpoints import save_with_tokenizer_of, tiny_llama_config

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
# How each mix runs: one request at a time, all at once, chunked prefill, preemption in a small
# pool. (Plain decoding is batch-invariant: tests/e2e/test_equivalence.py.)
MIXES = {
    "alone": dict(max_num_seqs=1),
    "batch8": dict(),
    "chunked": dict(max_num_batched_tokens=7),
    "preempt": dict(block_size=4, num_gpu_blocks=33, max_model_len=128),
}


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory, default_model_dir):
    """A smaller random Llama (1 layer, hidden 32) with the target's vocabulary."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(
        tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    )
    return save_with_tokenizer_of(model, tmp_path_factory.mktemp("draft-small"), default_model_dir)


@pytest.fixture(scope="module")
def near_draft_dir(tmp_path_factory, tiny_llama_dir, default_model_dir):
    """The target with noise added to every weight: drafts it proposes are often, not always,
    what the target would say (both acceptance and rejection paths run)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.15 * p.std())
    return save_with_tokenizer_of(model, tmp_path_factory.mktemp("draft-near"), default_model_dir)


@pytest.fixture(scope="module")
def cyclic_llama_dir(tmp_path_factory, default_model_dir):
    """A target whose greedy output cycles through groups of six ids (the LM head maps each
    token's embedding to the next id of its group; attention and MLP outputs are scaled down so
    they only nudge it): n-gram lookup drafts long accepted runs on it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False))
    ids = torch.arange(49152)
    prev = (ids // 6) * 6 + (ids - 1) % 6
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight[prev])
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.002)
    return save_with_tokenizer_of(model, tmp_path_factory.mktemp("cyclic"), default_model_dir)


def _run(path, prompts, params, steady_backoff=False, **settings):
    """steady_backoff: the draft backoff's break-evens fixed (2 for K drafts, 1.5 for a look),
    not timed on this machine, whose load moves them."""
    if settings.get("max_num_seqs") == 1:
        prompts = prompts[:3]  # one at a time is slow on the CPU: three suffice
    with Session(str(path), enable_prefix_caching=False, progress=False, **settings) as s:
        timed = s.engine.speculation.backoff
        if steady_backoff and timed is not None:
            s.engine.speculation.backoff = DraftBackoff(
                lambda n, d: 1.5 if d == DraftBackoff.LOOK_DRAFTS else 2.0, timed.num_drafts
            )
        outs = s.generate(prompts, params)
        stats = s.stats()
        assert not s.has_unfinished_requests()
    return outs, stats


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, cyclic_llama_dir):
    """Greedy tokens without speculation."""
    ref = {}
    for name, path in (("tiny", tiny_llama_dir), ("cyclic", cyclic_llama_dir)):
        outs, _ = _run(path, PROMPTS, GREEDY)
        ref[name, "greedy"] = [o.token_ids for o in outs]
    return ref


def _expected(reference, target, mix):
    ref = reference[target, "greedy"]
    return ref[:3] if MIXES[mix].get("max_num_seqs") == 1 else ref


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("target", ["tiny", "cyclic"])
def test_ngram_greedy_equals_plain(request, reference, target, mix):
    if target == "tiny" and mix == "alone":
        pytest.skip("the random target rarely drafts: batch mixes suffice")
    path = request.getfixturevalue(f"{target}_llama_dir")
    outs, stats = _run(
        path,
        PROMPTS,
        GREEDY,
        steady_backoff=True,
        method="ngram",
        num_speculative_tokens=5,
        **MIXES[mix],
    )
    assert [o.token_ids for o in outs] == _expected(reference, target, mix)
    if target == "cyclic":
        # The cycle is found and drafted: most steps accept several tokens.
        assert stats["spec_num_accepted_tokens"] > 0.5 * stats["spec_num_draft_tokens"] > 0
        assert stats["spec_mean_acceptance_length"] > 2.5
    if mix == "preempt":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("drafter", ["small", "near", "self"])
def test_draft_model_greedy_equals_plain(
    request, tiny_llama_dir, reference, small_draft_dir, near_draft_dir, drafter, mix
):
    # Each drafter on two mixes keeps the CPU suite short; together they cover all four.
    if mix not in {"small": ("batch8", "chunked"), "near": ("preempt", "alone"),
                   "self": ("batch8", "preempt")}[drafter]:  # fmt: skip
        pytest.skip("this mix runs with another drafter")
    draft = {"small": small_draft_dir, "near": near_draft_dir, "self": tiny_llama_dir}[drafter]
    outs, stats = _run(
        tiny_llama_dir,
        PROMPTS,
        GREEDY,
        method="draft_model",
        draft_model=str(draft),
        num_speculative_tokens=4,
        draft_backoff=False,  # every step drafts K: verification in each mix, whatever pays
        **MIXES[mix],
    )
    assert [o.token_ids for o in outs] == _expected(reference, "tiny", mix)
    assert stats["spec_num_draft_tokens"] > 0
    if drafter == "self":
        # The target drafting for itself: every greedy draft is the target's own argmax.
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
        assert stats["spec_mean_acceptance_length"] > 4.0
    if mix == "preempt":
        assert stats["num_preemptions"] > 0


def test_penalties_min_tokens_and_logprobs_with_drafts(tiny_llama_dir):
    """Per-position processing: repetition/frequency/presence penalties see accepted drafts as
    output, min_tokens bans lift mid-run, logprobs of accepted tokens are the plain ones."""
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=9, stop_token_ids=[0, 1, 2, 3]),
        SamplingParams(max_tokens=20, temperature=0.7, top_k=20, min_p=0.05, seed=5, logprobs=1),
    ]
    prompts = PROMPTS[:4]
    plain, _ = _run(tiny_llama_dir, prompts, params)
    spec, stats = _run(
        tiny_llama_dir, prompts, params, method="draft_model", draft_model=str(tiny_llama_dir)
    )
    for a, b in zip(spec[:3], plain[:3], strict=True):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
    assert stats["spec_num_accepted_tokens"] > 0
    lp_a, lp_b = spec[0].logprobs, plain[0].logprobs
    assert lp_a is not None and lp_b is not None and len(lp_a) == len(lp_b) == 20
    for x, y in zip(lp_a, lp_b, strict=True):
        assert x.token_id == y.token_id and x.rank == y.rank
        assert abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
    # The seeded row: a logprob per emitted token, each that token's.
    lps = spec[3].logprobs
    assert lps is not None and [lp.token_id for lp in lps] == spec[3].token_ids


def test_stops_inside_accepted_runs(tiny_llama_dir, reference):
    """Stop strings, stop tokens and max_tokens landing inside a run of accepted drafts cut the
    output exactly where plain decoding stops."""
    from libkk.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tiny_llama_dir)
    params = []
    for i, ids in enumerate(reference["tiny", "greedy"]):
        cut = 3 + i % 7
        if i % 3 == 0:
            # The output's own prefix: plain decoding stops right after token `cut`.
            stop = [tok.decode(ids[: cut + 1])]
            params.append(
                SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20, stop=stop)
            )
        elif i % 3 == 1:
            params.append(
                SamplingParams(temperature=0.0, ignore_eos=True, stop_token_ids=[ids[cut]])
            )
        else:
            params.append(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=cut))
    plain, _ = _run(tiny_llama_dir, PROMPTS, params)
    spec, stats = _run(
        tiny_llama_dir,
        PROMPTS,
        params,
        method="draft_model",
        draft_model=str(tiny_llama_dir),
        num_speculative_tokens=8,
    )
    assert stats["spec_num_accepted_tokens"] > 0
    for a, b in zip(spec, plain, strict=True):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
    assert {o.finish_reason for o in plain} == {"stop", "length"}


def test_ngram_stop_strings_on_cyclic_target(cyclic_llama_dir, reference):
    from libkk.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(cyclic_llama_dir)
    params = []
    for i, ids in enumerate(reference["cyclic", "greedy"]):
        # A prefix longer than one cycle: it ends inside a run of accepted drafts.
        text = tok.decode(ids[: 9 + i % 6])
        params.append(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20, stop=[text]))
    plain, _ = _run(cyclic_llama_dir, PROMPTS, params)
    spec, stats = _run(cyclic_llama_dir, PROMPTS, params, method="ngram", num_speculative_tokens=6)
    assert stats["spec_num_accepted_tokens"] > 0
    assert [(o.token_ids, o.text, o.finish_reason) for o in spec] == [
        (o.token_ids, o.text, o.finish_reason) for o in plain
    ]
    assert sum(o.finish_reason == "stop" for o in plain) >= 4


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_with_speculation_is_batch_invariant(
    tiny_llama_dir, near_draft_dir, cyclic_llama_dir, method
):
    """A seeded request samples the same tokens alone, in a batch, in another order, or beside
    other requests. (Preemption and a binding token budget change how many drafts a step
    verifies, and so which exact sample is drawn, though not its distribution.)"""
    path = cyclic_llama_dir if method == "ngram" else tiny_llama_dir
    # The sessions compared here must verify the same drafts: without the backoff, whose
    # break-even each session times for itself.
    spec = dict(method=method, num_speculative_tokens=4, draft_backoff=False)
    if method == "draft_model":
        spec |= dict(draft_model=str(near_draft_dir), draft_sampling="probabilistic")
    params = SamplingParams(max_tokens=14, temperature=0.8, top_k=50, seed=77, ignore_eos=True)
    others = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=5, ignore_eos=True)
    prompts = PROMPTS[:6]
    batch, stats = _run(path, prompts, params, **spec)
    alone, _ = _run(path, prompts, params, max_num_seqs=1, **spec)
    reverse, _ = _run(path, prompts[::-1], params, **spec)
    mixed, _ = _run(
        path, [p for pair in zip(prompts, prompts[::-1], strict=True) for p in pair],
        [q for _ in prompts for q in (params, others)], **spec,
    )  # fmt: skip
    tokens = [o.token_ids for o in batch]
    assert [o.token_ids for o in alone] == tokens[:3]
    assert [o.token_ids for o in reverse] == tokens[::-1]
    assert [o.token_ids for o in mixed[::2]] == tokens
    assert stats["spec_num_accepted_tokens"] > 0
    if method == "draft_model":
        # Some drafts are accepted, some rejected: both paths of the rejection sampler ran.
        assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


@pytest.mark.parametrize(
    "method,mix", [("ngram", "batch8"), ("ngram", "preempt"), ("draft_model", "chunked")]
)
def test_seeded_sampling_with_one_hot_drafts_gives_the_plain_tokens(
    tiny_llama_dir, cyclic_llama_dir, method, mix
):
    """One-hot drafts (n-gram, a greedy draft model) are accepted exactly when they are the
    plain sampler's draw: a seeded request gives the tokens it gives without speculation,
    however many drafts each step verifies (the backoff on, preemption, chunked prefill)."""
    path = cyclic_llama_dir if method == "ngram" else tiny_llama_dir
    spec = dict(method=method, num_speculative_tokens=4)
    if method == "draft_model":
        # The target drafting for itself, greedily (one-hot q), every step.
        spec |= dict(draft_model=str(tiny_llama_dir), draft_backoff=False)
    # Temperatures at which both outcomes of the draw happen on these targets.
    temperature = 2.0 if method == "ngram" else 0.5
    params = SamplingParams(
        max_tokens=14, temperature=temperature, top_k=50, seed=77, ignore_eos=True
    )
    prompts = PROMPTS[:6]
    plain, _ = _run(path, prompts, params)
    speculative, stats = _run(path, prompts, params, **spec, **MIXES[mix])
    assert [o.token_ids for o in speculative] == [o.token_ids for o in plain]
    # Drafts were verified, and both outcomes of the draw happened.
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_synthetic_rejection_accepts_at_configured_rates(cyclic_llama_dir, reference):
    # On the cyclic target n-gram drafts are always right, so every rejection is synthetic.
    outs, stats = _run(
        cyclic_llama_dir,
        PROMPTS * 2,
        # Seeded: the synthetic acceptance is keyed by the request's seed, so the counts are fixed.
        [
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, seed=100 + i)
            for i in range(len(PROMPTS) * 2)
        ],
        method="ngram",
        num_speculative_tokens=4,
        rejection_sample_method="synthetic",
        synthetic_acceptance_rates=[0.5],
        draft_backoff=False,  # every step verifies: the rate is what is measured
    )
    # Expected accepted drafts per verification with 4 drafts at rate 0.5: .5+.25+.125+.0625.
    per_step = stats["spec_num_accepted_tokens"] / stats["spec_num_verify_steps"]
    assert stats["spec_num_verify_steps"] > 150
    print(f"accepted per verification {per_step:.3f}")
    assert 0.75 < per_step < 1.1
    assert stats["spec_num_accepted_tokens"] < 0.6 * stats["spec_num_draft_tokens"]
    assert all(len(o.token_ids) == 40 for o in outs)


def test_bad_speculative_settings_raise_config_error(tiny_llama_dir, tmp_path, default_model_dir):
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    other_vocab = save_with_tokenizer_of(
        LlamaForCausalLM(tiny_llama_config(vocab_size=1000, hidden_size=32, num_hidden_layers=1)),
        tmp_path / "other-vocab",
        default_model_dir,
    )
    with pytest.raises(ConfigError, match="vocab_size 1000"):
        Session(
            str(tiny_llama_dir),
            method="draft_model",
            draft_model=str(other_vocab),
            progress=False,
        )
    with pytest.raises(ConfigError, match="needs draft_model"):
        Session(str(tiny_llama_dir), method="draft_model", progress=False)


class _RecordingProposer:
    """Reads layers 0 and 1; proposes the n-gram drafts; records every add_context call."""

    target_layer_ids = (0, 1)

    def __init__(self):
        from libkk.spec_decode.ngram import NgramProposer

        self.ngram = NgramProposer(1, 3)
        self.context: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def add_context(self, request_id, start_position, hidden):
        self.context.setdefault(request_id, []).append((start_position, hidden.clone()))

    def propose(self, requests):
        return self.ngram.propose(requests)

    def remove(self, request_id):
        pass


def test_model_proposers_get_hidden_states_of_final_tokens(cyclic_llama_dir, monkeypatch):
    """add_context receives, in position order and without gaps, the chosen layers' hidden
    states of exactly the tokens whose KV became final (prefill chunks, anchor + accepted
    drafts), equal to a plain forward's."""
    import libkk.spec_decode as registry
    from libkk.layers.forward_context import set_forward_context
    from libkk.runtime.input_batch import build_input_batch
    from libkk.runtime.io import ScheduledRequest, SchedulerOutput

    recorder = _RecordingProposer()
    monkeypatch.setattr(registry, "_make_ngram", lambda *a, **k: recorder)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with Session(
        str(cyclic_llama_dir),
        method="ngram",
        num_speculative_tokens=4,
        max_num_batched_tokens=6,  # chunked prefill
        enable_prefix_caching=False,
        progress=False,
    ) as s:
        outs = s.generate(PROMPTS[:3], params)
        stats = s.stats()
        engine = s.engine
        assert stats["spec_num_accepted_tokens"] > 0
        for out in outs:
            calls = recorder.context[out.request_id]
            # Contiguous from position 0.
            pos = 0
            for start, hidden in calls:
                assert start == pos
                pos += hidden.shape[0]
            tokens = out.prompt_token_ids + out.token_ids
            # Every token through the target, but the last step's (the request had finished).
            assert len(tokens) - 1 - 5 <= pos < len(tokens) - 1
            got = torch.cat([h for _, h in calls])  # [pos, 2 * hidden]
            # A plain forward over the same tokens in a fresh block range.
            n = len(tokens) - 1
            req = ScheduledRequest(
                out.request_id, tokens[:n], 0, [list(range(1, 2 + n // 16))], None
            )
            batch = build_input_batch(SchedulerOutput(requests=[req]), 16, torch.device("cpu"))
            with torch.inference_mode(), set_forward_context(batch.attn_metadata, engine.model):
                engine.model(batch.input_ids, batch.positions)
            want = engine.model.aux_hidden_states[:pos]
            assert want.shape == got.shape == (pos, 2 * 64)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_adaptive_verification_keeps_greedy_output(reference, cyclic_llama_dir):
    """Trimming drafts by the estimate and the start-up costs never changes greedy tokens; good
    n-gram drafts keep being verified and accepted."""
    outs, stats = _run(
        cyclic_llama_dir, PROMPTS, GREEDY, method="ngram", num_speculative_tokens=4,
        adaptive_verification=True,
    )  # fmt: skip
    assert [o.token_ids for o in outs] == reference["cyclic", "greedy"]
    assert stats["spec_num_accepted_tokens"] > 0


def test_adaptive_verification_trims_poor_drafts_and_learns(tiny_llama_dir, small_draft_dir):
    """With verification that costs in proportion to its tokens, a random drafter's drafts (cold
    estimate: each accepted with p ~ 0.45) are not worth checking: adaptive verification checks
    far fewer than plain speculation, still checks some (exploration), feeds every outcome to
    the estimator, and leaves the greedy output unchanged. (On a tiny CPU model the profiled
    verify cost hardly grows with tokens, so verifying everything would be the right choice:
    the test sets the cost tables after checking that start-up profiled them.)"""
    from libkk.spec_decode.adaptive import CostModel

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    settings = dict(
        method="draft_model", draft_model=str(small_draft_dir), num_speculative_tokens=4
    )
    # Plain speculation: every step drafts (the backoff off).
    plain_outs, plain = _run(tiny_llama_dir, PROMPTS, params, draft_backoff=False, **settings)
    with Session(str(tiny_llama_dir), enable_prefix_caching=False, progress=False,
                 adaptive_verification=True, **settings) as s:  # fmt: skip
        adaptive = s.engine.speculation.adaptive
        assert adaptive is not None
        cost = adaptive.verifier.cost
        assert len(cost.verify_points) > 1 and len(cost.draft_points) > 1  # profiled at start-up
        # 100 ms a token: more than any step here takes, so no overhead is learned on top.
        adaptive.verifier.cost = CostModel(
            draft_ms=[(1, 0.0)], verify_ms=[(1, 100.0), (512, 51200.0)]
        )
        outs = s.generate(PROMPTS, params)
        stats = s.stats()
        estimator = adaptive.verifier.estimator
        overhead = adaptive.verifier.cost.overhead_ms
        # Each step's outcome is learned while the next step runs: only the last one waits.
        assert len(adaptive._observed) <= 1
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outs]
    assert overhead == 0.0
    assert 0 < stats["spec_num_draft_tokens"] < plain["spec_num_draft_tokens"] / 4
    assert estimator.observed_steps > 0 and int(estimator.total_observations.sum()) > 0
    assert not adaptive._features  # every request's entry was observed or forgotten


def test_async_scheduling_runs_ahead_of_paused_requests(tiny_llama_dir, small_draft_dir):
    """A random drafter's drafts fail: the backoff pauses its requests, and with asynchronous
    scheduling their steps launch before the previous step's tokens are in, while drafting and
    verifying steps wait for them. Greedy tokens are the plain ones in both modes."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spec = dict(method="draft_model", draft_model=str(small_draft_dir), num_speculative_tokens=3)
    plain_outs, _ = _run(tiny_llama_dir, PROMPTS, params)
    for async_scheduling in (False, True):
        with Session(str(tiny_llama_dir), enable_prefix_caching=False, progress=False,
                     async_scheduling=async_scheduling, **spec) as s:  # fmt: skip
            s.engine.speculation.backoff = DraftBackoff(  # steady, whatever the timing
                lambda n, d: 1.5 if d == DraftBackoff.LOOK_DRAFTS else 2.0, 3
            )
            scheduled = []
            schedule = s.engine.scheduler.schedule

            def record(schedule=schedule, scheduled=scheduled):
                out = schedule()
                scheduled.extend(out.requests)
                return out

            s.engine.scheduler.schedule = record
            outs = s.generate(PROMPTS, params)
            stats = s.stats()
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outs]
        assert stats["spec_num_verify_steps"] > 0  # it drafted
        ahead = [r for r in scheduled if r.last_token_in_flight]
        assert bool(ahead) == async_scheduling  # only the async session runs ahead
        assert not any(r.last_token_in_flight and r.num_spec_tokens for r in scheduled)


def test_adaptive_verification_with_the_shipped_dflash_drafter(default_model_dir):
    """Start-up profiling hands a block drafter stand-in context, then removes it; greedy output
    with DFlash drafts trimmed adaptively equals plain greedy on the default model."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with Session(method="dflash", adaptive_verification=True, progress=False) as s:
        got = s.generate("The capital of France is", params).token_ids
    with Session(progress=False) as s:
        want = s.generate("The capital of France is", params).token_ids
    assert got == want
