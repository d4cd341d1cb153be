"""DFlash on CUDA (bf16, Triton paged attention): the paged block forward against the dense
reference, keyed drafts alone vs batched, and a few training steps. Run: pytest -m gpu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from libkk.models.arch_config import parse_arch_config
from libkk.models.llama import LlamaForCausalLM
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import SamplingRow
from libkk.spec_decode.base import ProposeRequest
from libkk.spec_decode.dflash import DFlashProposer
from libkk.spec_decode.dflash_model import DFlashConfig, dense_draft_hidden
from libkk.spec_decode.training.distill import (
    DrafterTrainer,
    Sample,
    TrainOptions,
    init_drafter,
    train_loop,
)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
IDS, MASK = (0, 2), 1


def tiny_config(block_size: int = 4, num_layers: int = 2) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=64, intermediate_size=96, num_layers=num_layers, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=96, target_layer_ids=IDS, mask_token_id=MASK,
        block_size=block_size, max_position_embeddings=256,
    )  # fmt: skip


def _models():
    cfg = parse_arch_config(
        {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 256, "tie_word_embeddings": True,
        }
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    target = LlamaForCausalLM(cfg)
    drafter = init_drafter(tiny_config())
    with torch.no_grad():
        for p in [*target.parameters(), *drafter.parameters()]:
            p.copy_(
                torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=gen) * 0.2
            )
    return target.to(CUDA, torch.bfloat16).eval(), drafter.to(CUDA, torch.bfloat16).eval()


def _request(rid, tokens, temperature=0.0, seed=7):
    params = SamplingParams(temperature=temperature, max_tokens=64)
    return ProposeRequest(rid, tokens, SamplingRow(params, seed, len(tokens), tokens, []), 3)


def test_paged_block_forward_matches_dense_on_cuda() -> None:
    target, drafter = _models()
    prop = DFlashProposer.from_drafter(drafter, target, block_size=16, probabilistic=True)
    ctx = torch.randn(40, drafter.fc.in_features, device=CUDA, dtype=torch.bfloat16)
    prop.add_context("a", 0, ctx)
    tokens = [(3 * i) % 96 for i in range(41)]
    out = prop.propose([_request("a", tokens, temperature=1.0)])
    emb = F.embedding(
        torch.tensor([tokens[-1]] + [drafter.config.mask_token_id] * 3, device=CUDA),
        target.model.embed_tokens.weight,
    )
    with torch.no_grad():
        ref = target.compute_logits(dense_draft_hidden(drafter, ctx, emb, 40)[1:])
    torch.testing.assert_close(out.draft_logits[0], ref.float(), rtol=0.05, atol=0.05)


def test_drafts_alone_equal_batched_on_cuda() -> None:
    target, drafter = _models()
    prop = DFlashProposer.from_drafter(drafter, target, block_size=16, probabilistic=True)
    toks = {f"r{i}": [(5 * i + j) % 96 for j in range(20 + 7 * i)] for i in range(4)}
    for i, (rid, t) in enumerate(toks.items()):
        gen = torch.Generator(device=CUDA).manual_seed(i)
        ctx = torch.randn(len(t) - 1, drafter.fc.in_features, device=CUDA, generator=gen)
        prop.add_context(rid, 0, ctx.to(torch.bfloat16))
    for temperature in (0.0, 1.0):
        reqs = [_request(rid, t, temperature) for rid, t in toks.items()]
        batched = prop.propose(reqs).token_ids
        assert batched == [prop.propose([r]).token_ids[0] for r in reqs]


def test_training_steps_on_cuda() -> None:
    target, _ = _models()
    opts = TrainOptions(
        num_layers=1, block_size=4, target_layer_ids=IDS, mask_token_id=MASK, steps=30,
        seqs_per_step=2, blocks_per_seq=8, lr=3e-3, warmup_steps=3,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            torch.randint(2, 96, (40,), generator=gen).tolist(),
            8,
            torch.randn(40, 2 * 64, generator=gen).to(torch.bfloat16),
        )
        for _ in range(3)
    ]
    drafter = init_drafter(tiny_config(4, 1), target, device=CUDA)
    trainer = DrafterTrainer(drafter, target.model.embed_tokens.weight, target.lm_head.weight, opts)
    anchors = [list(range(8, 38, 3)) for _ in samples]
    first = float(trainer.batch_loss(samples, anchors)[0])
    train_loop(trainer, samples, progress=False)
    assert float(trainer.batch_loss(samples, anchors)[0]) < 0.8 * first
