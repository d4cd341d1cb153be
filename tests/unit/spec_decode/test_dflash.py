"""DFlash drafter: paged forward vs a dense reference, cached context, checkpoints, FP8, proposing,
training, and the drafter shipped for the default model."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from libkk.errors import ConfigError, CorruptCheckpointError
from libkk.models.arch_config import parse_arch_config
from libkk.models.llama import LlamaForCausalLM
from libkk.quant.formats import dequantize_fp8_block, quantize_fp8_block
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import SamplingRow
from libkk.spec_decode.base import ProposeRequest
from libkk.spec_decode.dflash import DFlashProposer
from libkk.spec_decode.dflash_model import (
    SHIPPED_DRAFTER,
    DFlashConfig,
    default_target_layer_ids,
    load_drafter,
    read_drafter_config,
    save_drafter,
)
from libkk.spec_decode.training import target as target_side
from libkk.spec_decode.training.distill import (
    DrafterTrainer,
    Sample,
    TrainOptions,
    held_out_prompt_ids,
    init_drafter,
    train_drafter,
    train_loop,
    training_prompt_ids,
)
from libkk.spec_decode.training.target import (
    TargetRunner,
    builtin_plain_prompts,
    builtin_prompts,
    generate,
    measure_acceptance,
    target_hidden_states,
)

VOCAB, HIDDEN = 96, 64
IDS = (0, 2)
MASK = 1


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    cfg = parse_arch_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_theta": 10000.0,
        }
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=gen) * 0.3
            )
    return model.eval()


def tiny_config(block_size: int = 4, num_layers: int = 2) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        target_layer_ids=IDS,
        mask_token_id=MASK,
        block_size=block_size,
        rope_theta=10000.0,
        max_position_embeddings=256,
        num_target_layers=4,
    )


def random_drafter(seed: int = 1, block_size: int = 4):
    drafter = init_drafter(tiny_config(block_size), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # wider than the training init, so drafts are well separated
        for p in drafter.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    return drafter.eval()


def row(tokens: list[int], temperature: float = 0.0, seed: int = 7) -> SamplingRow:
    params = SamplingParams(temperature=temperature, max_tokens=64)
    return SamplingRow(params, seed, len(tokens), tokens[:3], tokens[3:])


def request(rid: str, tokens: list[int], k: int = 3, temperature: float = 0.0, seed: int = 7):
    return ProposeRequest(rid, tokens, row(tokens, temperature, seed), k)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def context(n: int, seed: int = 3) -> torch.Tensor:  # [n, len(IDS) * HIDDEN]
    return torch.randn(n, len(IDS) * HIDDEN, generator=torch.Generator().manual_seed(seed))


# -- a dense reference written from the formulas, not from the module's methods -----------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # [N, h, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]  # [N, D/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_logits(drafter, target, ctx_hidden, anchor_token, anchor_pos, ctx_start=0):
    """[K, vocab]: the DFlash math, dense: block rows see every context and block key."""
    cfg = drafter.config
    sd = {k: v.float() for k, v in drafter.checkpoint_tensors().items()}
    eps, h, kv, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    feats = _rms(ctx_hidden @ sd["fc.weight"].t(), sd["hidden_norm.weight"], eps)
    n_ctx, rows = ctx_hidden.shape[0], cfg.block_size
    ctx_pos = ctx_start + torch.arange(n_ctx)
    blk_pos = anchor_pos + torch.arange(rows)
    emb = target.model.embed_tokens.weight
    x = F.embedding(torch.tensor([anchor_token] + [cfg.mask_token_id] * (rows - 1)), emb)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."

        def proj(inp, name, p=p):
            return inp @ sd[p + name].t()

        k_ctx = _rope(
            _rms(proj(feats, "self_attn.k_proj.weight").view(n_ctx, kv, d),
                 sd[p + "self_attn.k_norm.weight"], eps), ctx_pos, cfg.rope_theta)  # fmt: skip
        v_ctx = proj(feats, "self_attn.v_proj.weight").view(n_ctx, kv, d)
        y = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = _rope(_rms(proj(y, "self_attn.q_proj.weight").view(rows, h, d),
                       sd[p + "self_attn.q_norm.weight"], eps), blk_pos, cfg.rope_theta)  # fmt: skip
        k_blk = _rope(_rms(proj(y, "self_attn.k_proj.weight").view(rows, kv, d),
                           sd[p + "self_attn.k_norm.weight"], eps), blk_pos, cfg.rope_theta)  # fmt: skip
        v_blk = proj(y, "self_attn.v_proj.weight").view(rows, kv, d)
        keys = torch.cat([k_ctx, k_blk]).repeat_interleave(h // kv, dim=1)  # [S, h, d]
        vals = torch.cat([v_ctx, v_blk]).repeat_interleave(h // kv, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, keys) / math.sqrt(d)  # no mask at all
        att = torch.einsum("hqs,shd->qhd", scores.softmax(-1), vals).reshape(rows, h * d)
        x = x + proj(att, "self_attn.o_proj.weight")
        y = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = proj(y, "mlp.gate_proj.weight"), proj(y, "mlp.up_proj.weight")
        x = x + proj(F.silu(gate) * up, "mlp.down_proj.weight")
    x = _rms(x, sd["norm.weight"], eps)
    return target.compute_logits(x[1:])


def test_paged_block_forward_matches_dense_non_causal_reference(target) -> None:
    drafter = random_drafter()
    # KV blocks of 4 positions: the context spans several blocks, the block straddles two.
    prop = DFlashProposer.from_drafter(drafter, target, block_size=4, probabilistic=True)
    ctx = context(10)
    prop.add_context("a", 0, ctx)
    tokens = list(range(20, 31))  # anchor 30 at position 10
    out = prop.propose([request("a", tokens, k=3, temperature=1.0)])
    assert len(out.token_ids[0]) == 3
    logits = out.draft_logits[0]
    assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32
    ref = reference_logits(drafter, target, ctx, tokens[-1], 10)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    # The same math with a causal mask inside the block gives other logits: the block is
    # really attended both ways.
    assert (logits - ref).abs().max() < 1e-3
    causal = _causal_logits(drafter, target, ctx, tokens[-1], 10)
    assert (causal - ref).abs().max() > 1e-2


def _causal_logits(drafter, target, ctx_hidden, anchor_token, anchor_pos):
    from libkk.spec_decode.dflash_model import dense_block_attention

    cfg = drafter.config
    n_ctx, rows = ctx_hidden.shape[0], cfg.block_size
    ctx = drafter.context_kv(drafter.features(ctx_hidden), torch.arange(n_ctx))
    visible = torch.ones(rows, n_ctx + rows, dtype=torch.bool)
    visible[:, n_ctx:] = torch.ones(rows, rows, dtype=torch.bool).tril()

    def attend(i, q, k, v):
        keys, vals = torch.cat([ctx[i][0], k]), torch.cat([ctx[i][1], v])
        return dense_block_attention(q, keys, vals, visible, cfg.num_heads, cfg.num_kv_heads, 16)

    emb = F.embedding(
        torch.tensor([anchor_token] + [MASK] * (rows - 1)), target.model.embed_tokens.weight
    )
    hidden = drafter.forward_block(emb, anchor_pos + torch.arange(rows), attend)
    return target.compute_logits(hidden[1:])


def test_context_written_once_incremental_equals_recomputed(target) -> None:
    drafter = random_drafter()
    prop = DFlashProposer.from_drafter(drafter, target, block_size=4, probabilistic=True)
    ctx = context(14)
    tokens = list(range(40, 55))
    # "inc" gets its context in chunks, with proposals in between; "full" all at once at the end.
    prop.add_context("inc", 0, ctx[:5])
    prop.propose([request("inc", tokens[:6], temperature=1.0)])
    prop.add_context("inc", 5, ctx[5:6])
    prop.propose([request("inc", tokens[:7], temperature=1.0)])
    prop.add_context("inc", 6, ctx[6:14])
    # Proposing must not touch the context rows: snapshot the cached keys/values.
    state = prop._requests["inc"]
    slots = prop._slots(state, 0, 14)
    before = [c.flatten(1, 2)[:, slots].clone() for c in prop._caches]
    inc = prop.propose([request("inc", tokens, temperature=1.0)])
    after = [c.flatten(1, 2)[:, slots] for c in prop._caches]
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b, a)
    prop.add_context("full", 0, ctx)
    full = prop.propose([request("full", tokens, temperature=1.0)])
    torch.testing.assert_close(inc.draft_logits[0], full.draft_logits[0], rtol=1e-5, atol=1e-5)
    assert inc.token_ids == full.token_ids
    # A rollback (context resent from an earlier position) replaces the stale rows.
    prop.add_context("inc", 10, ctx[10:14] * 0 + ctx[10:14])
    again = prop.propose([request("inc", tokens, temperature=1.0)])
    torch.testing.assert_close(again.draft_logits[0], full.draft_logits[0])
    # A gap (a prefix-cache hit: the target computed positions 5.. only) starts the context
    # over at the first position it gets.
    prop.add_context("gap", 5, ctx[5:11])
    gap = prop.propose([request("gap", tokens[:12], temperature=1.0)])
    ref = reference_logits(prop.drafter, target, ctx[5:11], tokens[11], 11, ctx_start=5)
    torch.testing.assert_close(gap.draft_logits[0], ref, rtol=1e-4, atol=1e-4)
    free = prop.num_free_blocks()
    prop.remove("inc")
    assert prop.num_free_blocks() > free


def test_pool_grows_and_requests_stay_apart(target) -> None:
    prop = DFlashProposer.from_drafter(random_drafter(), target, block_size=4)
    lone = DFlashProposer.from_drafter(random_drafter(), target, block_size=4)
    ctx = context(100, seed=5)
    for i in range(4):  # 4 x 26 blocks > the initial 64
        prop.add_context(f"r{i}", 0, ctx)
    lone.add_context("r0", 0, ctx)
    tokens = [t % VOCAB for t in range(101)]
    a = prop.propose([request("r3", tokens)]).token_ids
    b = lone.propose([request("r0", tokens)]).token_ids
    assert a == b and len(a[0]) == 3


def test_checkpoint_round_trip(tmp_path, target) -> None:
    drafter = random_drafter()
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"]["target_layer_ids"] == list(IDS)
    assert raw["dflash_config"]["mask_token_id"] == MASK
    assert raw["dflash_config"]["block_size"] == 4
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert "layers.1.self_attn.k_proj.weight" in names and "layers.0.mlp.up_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    loaded = load_drafter(tmp_path / "d")
    assert read_drafter_config(tmp_path / "d") == drafter.config
    for (n1, p1), (n2, p2) in zip(
        drafter.named_parameters(), loaded.named_parameters(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)
    # Keys at the top level (no dflash_config) mean the same.
    flat = {k: v for k, v in raw.items() if k != "dflash_config"}
    flat.update(target_layer_ids=list(IDS), mask_token_id=MASK)
    assert DFlashConfig.from_json(flat) == drafter.config
    bad = dict(raw, dflash_config={**raw["dflash_config"], "mask_token_id": VOCAB})
    with pytest.raises(Exception, match="mask_token_id"):
        DFlashConfig.from_json(bad)


def test_fp8_quantize_on_load_is_close_and_per_part(tmp_path, target) -> None:
    drafter = random_drafter()
    with torch.no_grad():  # q rows 100x larger: one shared scale would flatten k and v
        drafter.layers[0].self_attn.qkv_proj.weight[: 4 * 16] *= 100
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    fp8 = load_drafter(tmp_path / "d", quantization="fp8_per_block")
    tensors = drafter.checkpoint_tensors()
    k_ref = dequantize_fp8_block(*quantize_fp8_block(tensors["layers.0.self_attn.k_proj.weight"]))
    qkv = fp8.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[64:96], k_ref.to(qkv.dtype))
    assert not torch.equal(qkv, drafter.layers[0].self_attn.qkv_proj.weight)
    assert not torch.equal(fp8.fc.weight, drafter.fc.weight)  # fc is quantized too
    # Logits of the FP8 drafter stay close to those of the bf16 one (unscaled weights here).
    plain = random_drafter()
    save_drafter(plain, tmp_path / "p", dtype=torch.bfloat16)
    ctx, tokens = context(9), list(range(10))
    outs = []
    for quant in (None, "fp8_per_block"):
        d = load_drafter(tmp_path / "p", quantization=quant)
        p = DFlashProposer.from_drafter(d, target, block_size=4, probabilistic=True)
        p.add_context("a", 0, ctx)
        outs.append(p.propose([request("a", tokens, temperature=1.0)]).draft_logits[0])
    other = DFlashProposer.from_drafter(
        random_drafter(seed=2), target, block_size=4, probabilistic=True
    )
    other.add_context("a", 0, ctx)
    outs.append(other.propose([request("a", tokens, temperature=1.0)]).draft_logits[0])
    rel = (outs[0] - outs[1]).norm() / outs[0].norm()
    unrelated = (outs[0] - outs[2]).norm() / outs[0].norm()
    # e4m3 keeps 3 mantissa bits (~3% per weight); measured 0.09 here vs ~1 for another drafter.
    assert 0 < rel < 0.15 and rel < unrelated / 5, (rel, unrelated)


def test_propose_alone_equals_batched_and_noise_is_keyed(target) -> None:
    prop = DFlashProposer.from_drafter(random_drafter(), target, block_size=4, probabilistic=True)
    tokens = {f"r{i}": [(7 * i + j) % VOCAB for j in range(8 + 3 * i)] for i in range(3)}
    for i, (rid, toks) in enumerate(tokens.items()):
        prop.add_context(rid, 0, context(len(toks) - 1, seed=i))

    def reqs(temperature, seed=7):
        return [request(rid, t, 3, temperature, seed) for rid, t in tokens.items()]

    for temperature in (0.0, 1.0):
        batched = prop.propose(reqs(temperature))
        alone = [prop.propose([r]) for r in reqs(temperature)]
        assert batched.token_ids == [a.token_ids[0] for a in alone]
        if temperature == 0.0:
            assert batched.draft_logits == [None, None, None]  # greedy drafts are one-hot
        else:
            for b, a in zip(batched.draft_logits, alone, strict=True):
                torch.testing.assert_close(b, a.draft_logits[0])
    greedy = prop.propose(reqs(0.0)).token_ids
    # Sampled drafts depend on the seed only through the keyed noise: the same seed repeats,
    # other seeds give other drafts somewhere.
    assert prop.propose(reqs(5.0, seed=3)).token_ids == prop.propose(reqs(5.0, seed=3)).token_ids
    seen = {str(prop.propose(reqs(5.0, seed=s)).token_ids) for s in range(6)}
    assert len(seen) > 1 and str(greedy) in seen | {str(greedy)}
    # max_drafts caps the drafts; 0 drafts nothing.
    capped = prop.propose([request("r0", tokens["r0"], 1), request("r1", tokens["r1"], 0)])
    assert len(capped.token_ids[0]) == 1 and capped.token_ids[1] == []


def test_bad_inputs_fail_clearly(target) -> None:
    prop = DFlashProposer.from_drafter(random_drafter(), target, block_size=4)
    with pytest.raises(ValueError, match=r"must be \[N, 128\]"):
        prop.add_context("a", 0, torch.zeros(3, 64))
    from libkk.errors import ConfigError

    with pytest.raises(ConfigError, match="exceeds"):
        DFlashProposer.from_drafter(random_drafter(), target, num_speculative_tokens=9)


# -- training -----------------------------------------------------------------------------------


class _Tokenizer:
    """Bytes mod the tiny vocabulary; no chat template."""

    has_chat_template = False
    eos_token_ids = frozenset({0})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [2 + b % (VOCAB - 2) for b in text.encode()][:12]


def test_train_drafter_loss_goes_down_and_writes_a_checkpoint(tmp_path, target) -> None:
    opts = TrainOptions(
        num_layers=1,
        block_size=4,
        target_layer_ids=IDS,
        mask_token_id=MASK,
        num_prompts=6,
        max_new_tokens=24,
        steps=40,
        seqs_per_step=3,
        blocks_per_seq=6,
        lr=3e-3,
        warmup_steps=5,
        eval_prompts=2,
        eval_max_new_tokens=12,
    )
    prompts = [f"prompt number {i}" for i in range(6)]
    report = train_drafter(
        target, _Tokenizer(), tmp_path / "d", opts, "tiny", prompts, prompts[:2], progress=False
    )
    assert report.steps == 40 and report.num_sequences == 6
    assert sorted(report.acceptance) == ["chat", "plain"]
    assert all(a.mean_acceptance_length >= 1.0 for a in report.acceptance.values())
    drafter = load_drafter(tmp_path / "d")
    assert drafter.config.target_layer_ids == IDS and drafter.config.target_model == "tiny"

    # The loss on a fixed batch falls as training goes on.
    with TargetRunner(target, IDS, num_blocks=64, block_size=4) as runner:
        prompts_ids = [_Tokenizer().encode(p) for p in prompts[:3]]
        cont = generate(runner, prompts_ids, 24, progress=False)
        seqs = [p + c for p, c in zip(prompts_ids, cont, strict=True)]
        hidden = target_hidden_states(runner, seqs)
    samples = [Sample(s, len(p), h) for s, p, h in zip(seqs, prompts_ids, hidden, strict=True)]
    trainer = DrafterTrainer(
        init_drafter(tiny_config(4, 1), target), target.model.embed_tokens.weight,
        target.lm_head.weight, opts,
    )  # fmt: skip
    anchors = [
        list(range(len(p) - 1, len(s) - 1, 2)) for s, p in zip(seqs, prompts_ids, strict=True)
    ]
    first = float(trainer.batch_loss(samples, anchors)[0])
    history = train_loop(trainer, samples, progress=False)
    last = float(trainer.batch_loss(samples, anchors)[0])
    assert last < 0.7 * first, (first, last, [h.loss for h in history[::10]])

    # The sampled softmax (corpus tokens + a few random ones) trains the same drafter.
    sampled = DrafterTrainer(
        init_drafter(tiny_config(4, 1), target), target.model.embed_tokens.weight,
        target.lm_head.weight, msgspec.structs.replace(opts, sampled_softmax=8),
    )  # fmt: skip
    sampled.set_corpus(samples)
    assert sampled.vocab_subset.numel() < VOCAB
    train_loop(sampled, samples, progress=False)
    trainer.options = msgspec.structs.replace(opts, sampled_softmax=0)
    sampled.options = trainer.options  # evaluate both on the whole vocabulary
    assert float(sampled.batch_loss(samples, anchors)[0]) < 0.7 * first


class _ChatTokenizer(_Tokenizer):
    has_chat_template = True

    def apply_chat_template(self, messages, add_generation_prompt: bool) -> str:
        return f"<user>{messages[0]['content']}<assistant>"


def test_training_prompts_mix_chat_and_plain_text() -> None:
    """plain_fraction of the prompts skip the chat template; the built-in plain openings include
    code, and the held-out sets share no prompt with the training sets."""
    tok = _ChatTokenizer()
    opts = TrainOptions(num_prompts=10, plain_fraction=0.3, mask_token_id=MASK)
    ids = training_prompt_ids(tok, opts, ["alpha", "beta"])
    assert ids[:7] == [tok.encode(f"<user>{t}<assistant>") for t in ["alpha", "beta"] * 4][:7]
    assert ids[7:] == [tok.encode(t) for t in ["alpha", "beta", "alpha"]]
    train, held = builtin_plain_prompts(), builtin_plain_prompts(held_out=True)
    assert not set(train) & set(held) and not set(builtin_prompts()) & set(builtin_prompts(True))
    assert "def fib(n):" in held and sum(t.startswith("def ") for t in held[:16]) >= 3
    evaluation = held_out_prompt_ids(tok, 3)
    assert evaluation["plain"] == [tok.encode(t) for t in held[:3]]
    assert all(tok.encode("<user>")[0] == p[0] for p in evaluation["chat"])
    with pytest.raises(ConfigError, match="plain_fraction"):
        TrainOptions(plain_fraction=1.5)


def test_listed_topics_are_parsed_from_the_targets_lists_without_held_out_ones(monkeypatch):
    """The names in the target's lists become topics: list items only, the name before any
    description, once each, none sharing a word with a held-out topic or already built in."""
    lists = [
        "Here are some boats:\n1. **Kayak** - a small boat\n2. Penguins\n3. Mount Everest (Nepal)",
        "- The Emperor Penguin\n* jazz music\n4. kayak\n5. Catamaran: two hulls\n*Yak*\n6. 42",
        "1. Tea ceremonies\n2. Bicycle\n3. Octopus\n4. a very long name that goes on and on here",
        "1. Volcanoes\n2. Sourdough bread\n3. volcanoes",
    ]

    class Listing(_ChatTokenizer):
        def decode(self, ids: list[int]) -> str:
            return lists[ids[0] % len(lists)]

    asked = []

    def fake_generate(runner, prompts, max_new_tokens, stop_ids, progress):
        asked.extend(prompts)
        return [[i] for i in range(len(prompts))]

    monkeypatch.setattr(target_side, "generate", fake_generate)
    topics = target_side.listed_topics(None, Listing(), progress=False)
    assert len(asked) == len(target_side._TOPIC_CATEGORIES) * len(target_side._LIST_REQUESTS)
    assert topics == ["Kayak", "Mount Everest", "Catamaran", "Yak", "Volcanoes", "Sourdough bread"]
    # Those topics and library function heads widen the training prompts, never the held-out.
    signatures = target_side.library_signatures()
    names = {s.split("(")[0] for s in signatures}
    assert len(signatures) > 200 and "dedent(text)" in signatures and "fib" not in names
    widened = builtin_plain_prompts(False, topics, signatures)
    assert "Notes on Kayak:\n-" in widened and "def dedent(text):" in widened
    assert not set(widened) & set(builtin_plain_prompts(True))
    assert "Explain Yak to a ten-year-old." in builtin_prompts(False, topics)
    # Nouns of the vocabulary: whole words with a noun's ending, no held-out one.
    words = ["Ġventilation", "▁renaissance", "Ġquickly", "ĠOcean", "ship", "▁relaxation", "Ġtea"]

    class Vocabulary(_ChatTokenizer):
        vocab_size = len(words) + 1

        def id_to_token(self, token_id: int) -> str | None:
            return words[token_id] if token_id < len(words) else None

    assert target_side.vocabulary_topics(Vocabulary()) == ["relaxation", "ventilation"]
    monkeypatch.setattr(target_side, "listed_topics", lambda *args: ["Volcanoes", "Relaxation"])
    assert target_side.wide_topics(None, Vocabulary()) == ["Relaxation", "ventilation"]
    opts = TrainOptions(num_prompts=10_000, plain_fraction=0.5, mask_token_id=MASK)
    assert len({tuple(p) for p in training_prompt_ids(Listing(), opts, None, topics)}) > len(
        {tuple(p) for p in training_prompt_ids(Listing(), opts)}
    )


def test_speculative_greedy_equals_plain_greedy_on_tiny_model(target) -> None:
    prop = DFlashProposer.from_drafter(random_drafter(), target, block_size=4)
    prompts = [[5, 9, 17, 33], [60, 2, 8]]
    with TargetRunner(target, IDS, num_blocks=64, block_size=4) as runner:
        plain = generate(runner, prompts, 20, progress=False)
    report = measure_acceptance(target, prop, prompts, 20)
    assert report.outputs == plain
    assert report.verification_steps <= 2 * 19


# -- the shipped drafter ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_target(default_model_dir):
    from libkk.models.loader import load_model
    from libkk.models.tokenizer import Tokenizer

    model, _ = load_model(default_model_dir, torch.float32, torch.device("cpu"), progress=False)
    return model, Tokenizer.from_folder(default_model_dir)


shipped = pytest.mark.skipif(
    not (SHIPPED_DRAFTER / "model.safetensors").is_file(), reason="no shipped drafter"
)


@shipped
def test_shipped_drafter_proposes_for_the_default_model(default_target) -> None:
    from libkk.config import EngineConfig

    model, tokenizer = default_target
    config = EngineConfig.from_settings(device="cpu")
    prop = DFlashProposer(config, model, torch.device("cpu"), torch.float32)
    cfg = read_drafter_config(SHIPPED_DRAFTER)
    assert prop.target_layer_ids == cfg.target_layer_ids
    assert cfg.hidden_size == 576 and cfg.vocab_size == 49152
    size = sum(p.stat().st_size for p in SHIPPED_DRAFTER.iterdir())
    assert size < 16 * 2**20

    # Deterministic (greedy, fp32): measured 1.300 on the 4 chat prompts and 1.529 on the 4 plain
    # ones (1.611 and 1.597 over 16 of each, 64 tokens: benchmarks/RESULTS.md 2026-12-07); a
    # uniformly random draft would give 1 + 1/49152. The shipped CPU-trained drafter is still
    # weak: `libkk train-drafter --device cuda --wide-prompts ...` trains a better one.
    stops = sorted(tokenizer.eos_token_ids)
    for kind, prompts in held_out_prompt_ids(tokenizer, 4).items():
        report = measure_acceptance(model, prop, prompts, 40, stops)
        assert all(report.outputs) and report.mean_acceptance_length >= 1.15, (kind, report)


# -- through the engine -------------------------------------------------------------------------

E2E_PROMPTS = ["Once upon a time", "1, 2, 3, 4, 5,", "Paris is the capital of", "Hello"]


@pytest.fixture(scope="module")
def tiny_drafter_dir(tmp_path_factory, tiny_llama_dir):
    """A random drafter for the 2-layer tiny Llama (hidden 64, vocab 49152)."""
    config = DFlashConfig(
        hidden_size=64,
        intermediate_size=96,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=49152,
        target_layer_ids=(0, 1),
        mask_token_id=16,
        block_size=5,
        max_position_embeddings=512,
    )
    drafter = init_drafter(config, seed=3)
    return save_drafter(drafter, tmp_path_factory.mktemp("drafter"), dtype=torch.float32)


def test_engine_greedy_with_dflash_equals_plain(tiny_llama_dir, tiny_drafter_dir) -> None:
    from libkk import SamplingParams as Params
    from libkk import Session

    greedy = Params(max_tokens=20, temperature=0.0, ignore_eos=True)
    with Session(str(tiny_llama_dir), device="cpu") as s:
        plain = [o.token_ids for o in s.generate(E2E_PROMPTS, greedy)]
    spec = {"method": "dflash", "draft_model": str(tiny_drafter_dir), "num_speculative_tokens": 4}
    with Session(str(tiny_llama_dir), device="cpu", speculative=spec) as s:
        assert [o.token_ids for o in s.generate(E2E_PROMPTS, greedy)] == plain
        alone = [s.generate(p, greedy).token_ids for p in E2E_PROMPTS[:2]]
    assert alone == plain[:2]


@shipped
def test_engine_default_model_uses_the_shipped_drafter(default_model_dir) -> None:
    from libkk import SamplingParams as Params
    from libkk import Session

    greedy = Params(max_tokens=24, temperature=0.0)
    prompt = [{"role": "user", "content": "Write a short paragraph about lighthouses."}]
    with Session(device="cpu") as s:
        plain = s.chat(prompt, greedy).token_ids
    # Drafting every step: on the CPU this drafter rarely pays, and the backoff would pause it.
    with Session(device="cpu", speculative={"method": "dflash", "draft_backoff": False}) as s:
        assert isinstance(s.engine.speculation.proposer, DFlashProposer)
        out = s.chat(prompt, greedy)
        stats = s.stats()
    assert out.token_ids == plain
    assert stats["spec_num_accepted_tokens"] > 0, stats


def test_target_layers_are_distinct() -> None:
    assert default_target_layer_ids(36, 3) == (1, 17, 33)
    assert default_target_layer_ids(2, 3) == (1,)  # too shallow for three distinct layers
    with pytest.raises(CorruptCheckpointError, match="distinct"):
        DFlashConfig(
            hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=4, vocab_size=10, target_layer_ids=(1, 1), mask_token_id=2, block_size=3,
        ).check()  # fmt: skip
