"""The DFlash drafter under tensor parallelism, one rank at a time (loading runs no collective):
each rank holds its rows of `fc` and its heads / intermediate slice, and `fc`'s per-rank outputs
put side by side are bit-identical to the replicated projection."""

from __future__ import annotations

import pytest
import torch

from libkk.distributed import as_rank
from libkk.errors import ConfigError
from libkk.layers.linear import linear
from libkk.spec_decode.dflash_model import DFlashConfig, load_drafter, save_drafter
from libkk.spec_decode.training.distill import init_drafter

CONFIG = DFlashConfig(
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    vocab_size=250,
    target_layer_ids=(0, 1, 2),
    mask_token_id=3,
    block_size=5,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return save_drafter(init_drafter(CONFIG, seed=5), tmp_path_factory.mktemp("d"), torch.float32)


@pytest.mark.parametrize("quantization", [None, "fp8_per_block"])
@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_its_part_and_fc_matches_the_replicated_projection(
    drafter_dir, size, quantization
):
    full = load_drafter(drafter_dir, quantization=quantization)
    x = torch.randn(7, len(CONFIG.target_layer_ids) * CONFIG.hidden_size)
    outputs = []
    for rank in range(size):
        with as_rank(rank, size):
            part = load_drafter(drafter_dir, quantization=quantization)
        rows = CONFIG.hidden_size // size
        mine = slice(rank * rows, (rank + 1) * rows)
        assert torch.equal(part.fc.weight, full.fc.weight[mine])
        outputs.append(linear(x, part.fc.weight))  # this rank's outputs, before the gather
        attn, mlp = part.layers[0].self_attn, part.layers[0].mlp
        heads, kv_heads = CONFIG.num_heads // size, max(1, CONFIG.num_kv_heads // size)
        assert (attn.num_heads, attn.num_kv_heads) == (heads, kv_heads)
        assert attn.o_proj.weight.shape == (CONFIG.hidden_size, heads * CONFIG.head_dim)
        inter = CONFIG.intermediate_size // size
        assert mlp.down_proj.weight.shape == (CONFIG.hidden_size, inter)
        q_rows = slice(rank * heads * CONFIG.head_dim, (rank + 1) * heads * CONFIG.head_dim)
        assert torch.equal(attn.qkv_proj.weight[: attn.qkv_proj.q_size],
                           full.layers[0].self_attn.qkv_proj.weight[q_rows])  # fmt: skip
        assert torch.equal(part.norm.weight, full.norm.weight)  # replicated
    assert torch.equal(torch.cat(outputs, dim=-1), linear(x, full.fc.weight))


def test_a_split_that_does_not_divide_the_drafter_is_refused(drafter_dir):
    with as_rank(0, 3), pytest.raises(ConfigError, match="does not divide"):
        load_drafter(drafter_dir)
