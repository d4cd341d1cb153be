"""Distilling a DFlash drafter from the target's own text (`libkk train-drafter`).

1. Prompts (chat-templated) -> the target's continuations (greedy, or keyed sampling).
2. One prefill over each whole sequence records the target's hidden states after the drafter's
   `target_layer_ids` (the residual stream after each layer: HF's `hidden_states[i + 1]`).
3. Training samples random anchor positions p in the generated text: the block
   [token_p, MASK x K] at positions p..p+K sees the context features of positions < p and the
   whole block (no causal mask), and its MASK rows learn the target's tokens p+1..p+K
   (cross-entropy through the target's frozen LM head, weighted exp(-k / decay) by depth k).
   Many blocks of several sequences run as one dense masked-attention batch.
4. AdamW; the drafter is written in the DFlash checkpoint layout (`save_drafter`).

The target's side (running it, its continuations and hidden states, the built-in prompts,
`measure_acceptance`) is libkk/spec_decode/training/target.py; it runs the target on a private paged KV
cache, so distillation needs only the target model. The CLI loads it and its tokenizer.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from libkk.errors import ConfigError
from libkk.spec_decode.dflash import DFlashProposer
from libkk.spec_decode.dflash_model import (
    DFlashConfig,
    DFlashDraftModel,
    default_target_layer_ids,
    dense_block_attention,
    find_embedding,
    load_drafter,
    save_drafter,
)
from libkk.spec_decode.training.target import (
    AcceptanceReport,
    TargetRunner,
    builtin_plain_prompts,
    builtin_prompts,
    chat_prompt_ids,
    decoder_layers,
    generate,
    library_signatures,
    measure_acceptance,
    target_hidden_states,
    wide_topics,
)


class TrainOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    num_layers: int = 1
    block_size: int = 8  # anchor + K masks
    target_layer_ids: tuple[int, ...] | None = None  # None: 3 layers spread over the target
    mask_token_id: int | None = None  # None: the caller must choose (an unused special token)
    intermediate_size: int | None = None  # None: the target's
    init_from_target: bool = True  # copy the shapes that match from the target's last layers
    num_prompts: int = 256
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: the target's greedy continuations
    # Share of the prompts given as plain text (no chat template): built-in plain openings, or
    # the caller's prompts as they are. The rest are chat prompts.
    plain_fraction: float = 0.5
    # Widen the built-in training prompts (not the caller's) with topics the target lists
    # itself, nouns of its vocabulary (`wide_topics`) and function heads of the standard library
    # (`library_signatures`): far more varied prompts.
    wide_prompts: bool = False
    steps: int = 1000
    seqs_per_step: int = 4
    blocks_per_seq: int = 8
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_steps: int = 50
    loss_decay: float = 4.0  # weight of depth k: exp(-k / loss_decay)
    max_minutes: float | None = None  # stop training early at this wall time
    # 0: the loss is a softmax over the whole vocabulary. N > 0: over the tokens of the corpus
    # plus N random others per step (the LM head dominates a CPU step; this is ~5x cheaper).
    sampled_softmax: int = 0
    init_from: str | None = None  # a drafter checkpoint to continue from (same shape)
    gen_batch_size: int = 32
    seed: int = 0
    eval_prompts: int = 16
    eval_max_new_tokens: int = 96

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_prompts", "max_new_tokens", "steps", "seqs_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train-drafter: {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ConfigError(f"train-drafter: block_size must be >= 2, got {self.block_size}")
        if self.temperature < 0:
            raise ConfigError(f"train-drafter: temperature must be >= 0, got {self.temperature}")
        if not 0.0 <= self.plain_fraction <= 1.0:
            raise ConfigError(
                f"train-drafter: plain_fraction must be in [0, 1], got {self.plain_fraction}"
            )


# -- the drafter ------------------------------------------------------------------------------


def drafter_config_for(target: nn.Module, options: TrainOptions, name: str | None) -> DFlashConfig:
    embedding = find_embedding(target)
    attn = target.attention_layers()[0]
    num_target_layers = len(decoder_layers(target))
    ids = options.target_layer_ids or default_target_layer_ids(num_target_layers, 3)
    if max(ids) >= num_target_layers or min(ids) < 0:
        raise ConfigError(
            f"train-drafter: target_layer_ids {list(ids)} must lie in [0, {num_target_layers})"
        )
    if options.mask_token_id is None:
        raise ConfigError("train-drafter: mask_token_id is required (an unused special token)")
    mlp = decoder_layers(target)[0].mlp
    intermediate = options.intermediate_size or mlp.down_proj.in_features
    rotary = getattr(target, "rotary_emb", None)
    theta = rotary.rope.theta if rotary is not None else 10000.0
    max_pos = rotary.max_position if rotary is not None else 8192
    return DFlashConfig(
        hidden_size=embedding.shape[1],
        intermediate_size=intermediate,
        num_layers=options.num_layers,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        vocab_size=embedding.shape[0],
        target_layer_ids=tuple(ids),
        mask_token_id=options.mask_token_id,
        block_size=options.block_size,
        rms_norm_eps=getattr(getattr(target, "config", None), "rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=max_pos,
        num_target_layers=num_target_layers,
        target_model=name,
    )


@torch.no_grad()
def init_drafter(
    config: DFlashConfig,
    target: nn.Module | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> DFlashDraftModel:
    """A drafter in fp32: linears ~ N(0, 0.02), norms 1; with `target`, every parameter whose
    name and shape match is copied from the target's last layers (a warm start)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device(device):
        model = DFlashDraftModel(config)
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if target is not None:
        layers = decoder_layers(target)
        for i, layer in enumerate(model.layers):
            source = dict(layers[len(layers) - len(model.layers) + i].named_parameters())
            for name, p in layer.named_parameters():
                if name in source and source[name].shape == p.shape:
                    p.copy_(source[name].float())
        final_norm = getattr(getattr(target, "model", None), "norm", None)
        if final_norm is not None and final_norm.weight.shape == model.norm.weight.shape:
            model.norm.weight.copy_(final_norm.weight.float())  # the LM head's input scale
    return model


@dataclass
class Sample:
    token_ids: list[int]
    prompt_len: int
    hidden: torch.Tensor  # [len(token_ids), len(ids) * H] bf16


@dataclass
class StepStats:
    loss: float
    accuracy: list[float]  # per depth k, top-1 agreement with the target's token
    acceptance: float  # mean over blocks of (correct prefix length + 1)


class DrafterTrainer:
    """Dense masked-attention training of a drafter over random anchor blocks."""

    def __init__(
        self,
        drafter: DFlashDraftModel,
        embedding: torch.Tensor,  # [vocab, H] the target's (frozen)
        lm_head: torch.Tensor,  # [vocab, H] the target's (frozen)
        options: TrainOptions,
    ) -> None:
        self.drafter = drafter
        self.embedding = embedding.detach()
        self.lm_head = lm_head.detach()
        self.options = options
        self.params = [p for p in drafter.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(
            self.params, lr=options.lr, weight_decay=options.weight_decay, betas=(0.9, 0.95)
        )
        k = drafter.config.block_size - 1
        self.depth_weight = torch.exp(-torch.arange(k, dtype=torch.float32) / options.loss_decay)
        self.step_count = 0
        self.vocab_subset: torch.Tensor | None = None  # [V'] token ids, with sampled_softmax
        self._rng = torch.Generator().manual_seed(options.seed)

    def set_corpus(self, samples: list[Sample]) -> None:
        """The tokens every sampled softmax includes: all that occur in the corpus."""
        tokens = torch.tensor(sorted({t for s in samples for t in s.token_ids}))
        self.vocab_subset = tokens.to(self.lm_head.device)

    def _logits(self, hidden: torch.Tensor, target: torch.Tensor):
        """(logits [N, V or V'], labels [N] indexing them) over the whole or a sampled vocab."""
        n = self.options.sampled_softmax
        if n <= 0 or self.vocab_subset is None:
            return hidden @ self.lm_head.float().t(), target
        vocab = self.lm_head.shape[0]
        extra = torch.randint(vocab, (n,), generator=self._rng).to(self.lm_head.device)
        cand = torch.unique(torch.cat([self.vocab_subset, extra, target[target >= 0]]))
        index = torch.full((vocab,), -100, dtype=torch.int64, device=cand.device)
        index[cand] = torch.arange(cand.numel(), device=cand.device)
        labels = torch.where(target >= 0, index[target.clamp_min(0)], -100)
        return hidden @ self.lm_head[cand].float().t(), labels

    def lr_at(self, step: int, progress: float | None = None) -> float:
        """Linear warmup, then cosine to 10% over `progress` (default: step / steps)."""
        o = self.options
        if step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        frac = progress if progress is not None else step / max(1, o.steps)
        return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def batch_loss(
        self, samples: list[Sample], anchors: list[list[int]]
    ) -> tuple[torch.Tensor, StepStats]:
        """Loss of the blocks anchored at anchors[i] in samples[i]."""
        d = self.drafter
        cfg = d.config
        rows = cfg.block_size
        k = rows - 1
        dev = self.embedding.device
        ctx_hidden = torch.cat([s.hidden for s in samples]).to(dev, torch.float32)
        ctx_pos = torch.cat([torch.arange(len(s.token_ids)) for s in samples]).to(dev)
        ctx_seq = torch.cat([torch.full((len(s.token_ids),), i) for i, s in enumerate(samples)]).to(
            dev
        )
        ids, pos, labels, blk_seq, blk_anchor = [], [], [], [], []
        for i, (s, ps) in enumerate(zip(samples, anchors, strict=True)):
            for p in ps:
                ids += [s.token_ids[p]] + [cfg.mask_token_id] * k
                pos += range(p, p + rows)
                labels.append(
                    [
                        s.token_ids[t] if t < len(s.token_ids) else -100
                        for t in range(p + 1, p + rows)
                    ]
                )
                blk_seq.append(i)
                blk_anchor.append(p)
        n_blocks = len(labels)
        q_block = torch.arange(n_blocks, device=dev).repeat_interleave(rows)  # [Q]
        q_seq = torch.tensor(blk_seq, device=dev)[q_block]
        q_anchor = torch.tensor(blk_anchor, device=dev)[q_block]
        # Context rows of the same sequence before the anchor; every row of the same block.
        see_ctx = (ctx_seq[None, :] == q_seq[:, None]) & (ctx_pos[None, :] < q_anchor[:, None])
        see_blk = q_block[:, None] == q_block[None, :]
        visible = torch.cat([see_ctx, see_blk], dim=1)  # [Q, C + Q]

        ctx = d.context_kv(d.features(ctx_hidden), ctx_pos)

        def attend(i: int, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return dense_block_attention(
                q,
                torch.cat([ctx[i][0], kk]),
                torch.cat([ctx[i][1], v]),
                visible,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
            )

        embeds = F.embedding(torch.tensor(ids, device=dev), self.embedding).float()
        hidden = d.forward_block(embeds, torch.tensor(pos, device=dev), attend)  # [Q, H]
        hidden = hidden.view(n_blocks, rows, -1)[:, 1:].reshape(n_blocks * k, -1)
        target = torch.tensor(labels, device=dev)  # [B, K]
        logits, sub = self._logits(hidden, target.view(-1))  # [B * K, vocab or V']
        ce = F.cross_entropy(logits, sub, ignore_index=-100, reduction="none")
        valid = (target != -100).float()  # [B, K]
        w = self.depth_weight.to(dev)[None, :] * valid
        loss = (ce.view(n_blocks, k) * w).sum() / w.sum().clamp_min(1.0)
        with torch.no_grad():
            correct = (logits.argmax(-1).view(n_blocks, k) == sub.view(n_blocks, k)) & (
                target != -100
            )
            acc = (correct.float().sum(0) / valid.sum(0).clamp_min(1.0)).tolist()
            acceptance = float(correct.long().cumprod(-1).sum(-1).float().mean()) + 1.0
        return loss, StepStats(loss=float(loss.detach()), accuracy=acc, acceptance=acceptance)

    def step(
        self, samples: list[Sample], anchors: list[list[int]], progress: float | None = None
    ) -> StepStats:
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step_count, progress)
        loss, stats = self.batch_loss(samples, anchors)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.step_count += 1
        return stats


def random_anchors(sample: Sample, count: int, rng: random.Random) -> list[int]:
    """Anchor positions in the generated part, each with at least one target token after it."""
    lo, hi = max(sample.prompt_len - 1, 0), len(sample.token_ids) - 2
    if hi < lo:
        return []
    return [rng.randint(lo, hi) for _ in range(count)]


def train_loop(
    trainer: DrafterTrainer,
    samples: list[Sample],
    progress: bool = True,
    log: Callable[[int, StepStats], None] | None = None,
) -> list[StepStats]:
    o = trainer.options
    rng = random.Random(o.seed)
    usable = [s for s in samples if len(s.token_ids) - s.prompt_len >= 2]
    if not usable:
        raise ConfigError("train-drafter: no generated sequence is long enough to train on")
    history: list[StepStats] = []
    start = time.monotonic()
    bar = tqdm(range(o.steps), desc="Training", file=sys.stderr, disable=not progress)
    for step in bar:
        batch = rng.sample(usable, min(o.seqs_per_step, len(usable)))
        anchors = [random_anchors(s, o.blocks_per_seq, rng) for s in batch]
        # Progress through the schedule: by steps, or by wall time when that ends training first.
        frac = step / o.steps
        if o.max_minutes is not None:
            frac = max(frac, (time.monotonic() - start) / (60 * o.max_minutes))
        stats = trainer.step(batch, anchors, frac)
        history.append(stats)
        recent = history[-20:]
        bar.set_postfix(
            loss=f"{sum(h.loss for h in recent) / len(recent):.3f}",
            accept=f"{sum(h.acceptance for h in recent) / len(recent):.2f}",
        )
        if log is not None:
            log(step, stats)
        if o.max_minutes is not None and time.monotonic() - start > 60 * o.max_minutes:
            break
    bar.close()
    return history


# -- the whole recipe ---------------------------------------------------------------------------


@dataclass
class TrainReport:
    output_dir: Path
    num_sequences: int
    num_generated_tokens: int
    steps: int
    final_loss: float
    train_acceptance: float  # estimated from the last training batches
    acceptance: dict[str, AcceptanceReport]  # held-out "chat" and "plain" prompts; {}: not measured
    seconds: float


def train_drafter(
    target: nn.Module,
    tokenizer: Any,
    output_dir: str | Path,
    options: TrainOptions,
    target_name: str | None = None,
    prompts: Sequence[str] | None = None,
    eval_prompts: Sequence[str] | None = None,
    progress: bool = True,
    corpus_path: str | Path | None = None,
) -> TrainReport:
    """Self-distills a DFlash drafter for `target` and writes it to `output_dir`.

    corpus_path: a JSON file of the generated sequences: read if it exists (no generation),
    else written after generating.
    """
    begin = time.monotonic()
    torch.manual_seed(options.seed)
    stop_ids = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    config = drafter_config_for(target, options, target_name)
    device = next(target.parameters()).device
    drafter = _initial_drafter(config, target, options, device)  # a bad --init-from fails first

    prompt_ids, continuations, hidden = _distillation_corpus(
        target, config, tokenizer, prompts, options, stop_ids, corpus_path, progress
    )
    samples = [
        Sample(p + c, len(p), h) for p, c, h in zip(prompt_ids, continuations, hidden, strict=True)
    ]
    lm_head = target.lm_head.weight if hasattr(target, "lm_head") else find_embedding(target)
    trainer = DrafterTrainer(drafter, find_embedding(target), lm_head, options)
    trainer.set_corpus(samples)
    history = train_loop(trainer, samples, progress)
    for p in drafter.parameters():
        p.requires_grad_(False)
    drafter.eval()
    out = save_drafter(drafter, output_dir)

    acceptance = {}
    if options.eval_prompts > 0:
        proposer = DFlashProposer.from_drafter(drafter, target)
        for kind, ids in held_out_prompt_ids(tokenizer, options.eval_prompts, eval_prompts).items():
            acceptance[kind] = measure_acceptance(
                target, proposer, ids, options.eval_max_new_tokens, stop_ids
            )
    recent = history[-50:]
    return TrainReport(
        output_dir=out,
        num_sequences=len(samples),
        num_generated_tokens=sum(len(c) for c in continuations),
        steps=len(history),
        final_loss=sum(h.loss for h in recent) / len(recent),
        train_acceptance=sum(h.acceptance for h in recent) / len(recent),
        acceptance=acceptance,
        seconds=time.monotonic() - begin,
    )


def training_prompt_ids(
    tokenizer: Any,
    options: TrainOptions,
    prompts: Sequence[str] | None = None,
    topics: Sequence[str] = (),
    signatures: Sequence[str] = (),
) -> list[list[int]]:
    """`options.num_prompts` prompts: the chat ones first, then `plain_fraction` of them as plain
    text (from `prompts`, else the built-in sets widened by `topics` and `signatures`), each set
    repeated as needed."""
    num_plain = round(options.num_prompts * options.plain_fraction)
    if prompts is not None:
        chat, plain = list(prompts), list(prompts)
    else:
        chat = builtin_prompts(False, topics)
        plain = builtin_plain_prompts(False, topics, signatures)
    return [
        chat_prompt_ids(tokenizer, t) for t in _cycled(chat, options.num_prompts - num_plain)
    ] + [tokenizer.encode(t) for t in _cycled(plain, num_plain)]


def held_out_prompt_ids(
    tokenizer: Any, count: int, prompts: Sequence[str] | None = None
) -> dict[str, list[list[int]]]:
    """Evaluation prompts by kind: "chat" (chat-templated) and "plain" (no template), `count` of
    each: the first of `prompts`, else of the built-in held-out sets."""
    chat, plain = (
        (list(prompts), list(prompts))
        if prompts is not None
        else (builtin_prompts(True), builtin_plain_prompts(True))
    )
    return {
        "chat": [chat_prompt_ids(tokenizer, t) for t in chat[:count]],
        "plain": [tokenizer.encode(t) for t in plain[:count]],
    }


def _cycled(texts: list[str], count: int) -> list[str]:
    return (texts * (1 + count // max(1, len(texts))))[:count]


def _distillation_corpus(
    target: nn.Module,
    config: DFlashConfig,
    tokenizer: Any,
    prompts: Sequence[str] | None,
    options: TrainOptions,
    stop_ids: list[int],
    corpus_path: str | Path | None,
    progress: bool,
) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """(prompts, the target's continuations, the hidden states of each whole sequence): read
    from `corpus_path` if it exists, else generated (and written there)."""
    corpus = Path(corpus_path) if corpus_path is not None else None
    continuations = None
    if corpus is not None and corpus.is_file():  # generated earlier: reuse it
        saved = json.loads(corpus.read_text(encoding="utf-8"))
        pairs = list(zip(saved["sequences"], saved["prompt_lens"], strict=True))
        prompt_ids = [s[:n] for s, n in pairs]
        continuations = [s[n:] for s, n in pairs]
    else:
        if corpus is not None:  # its folder made now, not after the generation
            corpus.parent.mkdir(parents=True, exist_ok=True)
        topics, signatures = [], []
        if options.wide_prompts and prompts is None:
            with TargetRunner(target, config.target_layer_ids) as runner:
                topics = wide_topics(runner, tokenizer, stop_ids, progress)
            signatures = library_signatures()
        prompt_ids = training_prompt_ids(tokenizer, options, prompts, topics, signatures)
    # KV blocks for a whole generation batch (and for the 4096-token hidden-state steps).
    longest = max(len(p) for p in prompt_ids) + options.max_new_tokens + 1
    num_blocks = max(512, options.gen_batch_size * -(-longest // 16) + 2, 4096 // 16 + 64)
    with TargetRunner(target, config.target_layer_ids, num_blocks=num_blocks) as runner:
        if continuations is None:
            continuations = generate(
                runner,
                prompt_ids,
                options.max_new_tokens,
                stop_ids,
                options.temperature,
                options.seed,
                options.gen_batch_size,
                progress,
            )
        sequences = [p + c for p, c in zip(prompt_ids, continuations, strict=True)]
        if corpus is not None and not corpus.is_file():
            corpus.write_text(
                json.dumps({"sequences": sequences, "prompt_lens": [len(p) for p in prompt_ids]}),
                encoding="utf-8",
            )
        hidden = target_hidden_states(runner, sequences)
    return prompt_ids, continuations, hidden


def _initial_drafter(
    config: DFlashConfig, target: nn.Module, options: TrainOptions, device: torch.device
) -> DFlashDraftModel:
    """A fresh drafter (from the target's layers with `init_from_target`), or continued from
    `options.init_from`, an earlier drafter of the same shape."""
    drafter = init_drafter(
        config, target if options.init_from_target else None, options.seed, device
    )
    if options.init_from is not None:
        with torch.no_grad():
            earlier = load_drafter(options.init_from, device, torch.float32)
            # the target's name is a label: a drafter continues on the same model by any path
            if msgspec.structs.replace(earlier.config, target_model=config.target_model) != config:
                raise ConfigError(
                    f"train-drafter: {options.init_from} has another shape or settings: "
                    f"{earlier.config} vs {config}"
                )
            for p, q in zip(drafter.parameters(), earlier.parameters(), strict=True):
                p.copy_(q)
    return drafter
