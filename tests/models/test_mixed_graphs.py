"""MixedGraphs' padded layout (cudagraph_mode "FULL"): a batch staged into a graph's static
inputs gives its real rows the values of the unpadded forward and writes the same KV cache.

Run on the CPU with the reference attention, outside any graph: what a replay computes is this
forward over the staged buffers (graph replay against eager: tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch
from libkk.graphs.capture import MixedGraphs
from torch import nn

from libkk.layers.forward_context import grouped_metadata, set_forward_context
from libkk.models.loader import load_model
from tests.models.paged_helpers import PagedKV, build_attn_metadata

BLOCK = 4


def _prefilled(model_dir):
    """The model, its caches, and request 0's first four tokens already in block 3."""
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), progress=False)
    kv = PagedKV(model, num_blocks=16, block_size=BLOCK)
    ids, pos, metadata = build_attn_metadata([([5, 6, 7, 8], 0)], [[3]], BLOCK)
    with torch.inference_mode(), set_forward_context(metadata, model):
        model.forward(ids, pos)
    return model, kv


# (token ids, cached) per request: a decode row after a cached context, prompts from scratch, a
# chunk after that context; and the block tables covering them.
BATCHES = {
    "decode beside a prompt": ([([5, 6, 7, 8, 9], 4), ([11, 12, 13], 0)], [[3, 7], [5]]),
    "three requests": (
        [([5, 6, 7, 8, 9, 10, 11], 4), ([20, 21, 22, 23, 24], 0), ([30], 0)],
        [[3, 7], [5, 6], [8]],
    ),
    "fills its size": ([([5, 6, 7, 8, 9, 10, 11, 12], 4), ([40, 41, 42, 43], 0)], [[3, 7], [9]]),
}


@pytest.mark.parametrize("full", [False, True], ids=["free slots", "every slot taken"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_staged_batch_equals_the_unpadded_forward(request, model_fixture, batch, full):
    """With max_num_seqs requests in the batch no slot is left empty: the padding request
    takes the last one."""
    requests, tables = BATCHES[batch]
    max_num_seqs = len(requests) if full else 4
    model, kv = _prefilled(request.getfixturevalue(model_fixture))
    before = [c.clone() for c in kv.caches]
    ids, pos, metadata = build_attn_metadata(requests, tables, BLOCK)
    t = ids.shape[0]
    with torch.inference_mode():
        with set_forward_context(metadata, model):
            want = model.forward(ids, pos)
        want_caches = [c.clone() for c in kv.caches]
        for cache, old in zip(kv.caches, before, strict=True):
            cache.copy_(old)
        graphs = MixedGraphs(
            model.forward, model=model, capture_sizes=[1, 2, 8, 16], max_num_seqs=max_num_seqs, max_blocks_per_seq=4,
            block_size=BLOCK, device=torch.device("cpu"),
        )  # fmt: skip
        graphs.block_table.fill_(15)  # stale tables from earlier steps must not be read
        size, staged = graphs.stage(ids, pos, metadata)
        with set_forward_context(staged, model):
            got = model.forward(graphs.input_ids[:size], graphs.positions[:size])
    assert size == graphs.pad_to[t] and size >= t and staged.num_reqs == min(size, max_num_seqs) + 1
    # The kernels read the device copies, the reference path the host lists: the same layout.
    assert staged.query_start_loc.tolist() == staged.query_start_loc_cpu
    assert staged.seq_lens.tolist() == staged.seq_lens_cpu
    torch.testing.assert_close(got[:t], want, rtol=1e-5, atol=1e-5)
    for cache, expected in zip(kv.caches, want_caches, strict=True):
        # Padding wrote no real block (the CPU store writes padding into the null block 0;
        # the kernels skip it). Unwritten slots hold NaN, so a stray write is a mismatch; the
        # written ones may differ in rounding (a GEMM over more rows may block K differently).
        torch.testing.assert_close(
            cache[:, 1:], expected[:, 1:], rtol=1e-4, atol=1e-4, equal_nan=True
        )


def test_mixed_graphs_take_two_tokens_and_more():
    graphs = MixedGraphs(
        lambda ids, pos: ids, model=nn.Module(), capture_sizes=[1, 2, 4], max_num_seqs=8, max_blocks_per_seq=2,
        block_size=BLOCK, device=torch.device("cpu"),
    )  # fmt: skip
    assert graphs.sizes == [2, 4] and graphs.pad_to[1] == 2 and graphs.pad_to[3] == 4
    with pytest.raises(ValueError, match="2 tokens or more"):
        MixedGraphs(
            lambda ids, pos: ids, model=nn.Module(), capture_sizes=[1], max_num_seqs=8, max_blocks_per_seq=2,
            block_size=BLOCK, device=torch.device("cpu"),
        )  # fmt: skip


def test_sizes_a_step_can_pad_to():
    from libkk.graphs.capture import DEFAULT_CAPTURE_SIZES, sizes_up_to

    assert sizes_up_to(DEFAULT_CAPTURE_SIZES, 48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert sizes_up_to(DEFAULT_CAPTURE_SIZES, 50) == [1, 2, 4, *range(8, 57, 8)]
    assert sizes_up_to([8, 4], 2048) == [4, 8]


def test_capture_layout_keeps_each_request_within_a_block_table_row(tiny_qwen3_dir):
    """A capture lays its tokens out as padding requests of at most a row's capacity (here one
    block of 4); a size the slots cannot hold is not captured, and a batch whose padding
    would overflow its one padding request runs without the graphs."""
    model, kv = _prefilled(tiny_qwen3_dir)
    before = [c.clone() for c in kv.caches]
    graphs = MixedGraphs(
        model.forward, model=model, capture_sizes=[2, 8, 16], max_num_seqs=2, max_blocks_per_seq=1,
        block_size=BLOCK, device=torch.device("cpu"),
    )  # fmt: skip
    assert graphs.sizes == [2, 8]  # 16 tokens need more than 3 slots of 4
    with torch.inference_mode():
        metadata = graphs._padding_only(8)
        assert metadata.query_start_loc_cpu == [0, 4, 8, 8] and metadata.seq_lens_cpu == [4, 4, 0]
        assert graphs.positions[:8].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
        with set_forward_context(metadata, model):
            model.forward(graphs.input_ids[:8], graphs.positions[:8])
    for cache, old in zip(kv.caches, before, strict=True):
        torch.testing.assert_close(cache[:, 1:], old[:, 1:], rtol=0, atol=0, equal_nan=True)
    graphs.pool = object()  # as if captured
    _, _, three = build_attn_metadata([([5, 6, 7], 0)], [[3]], BLOCK)
    assert not graphs.can_run(three, 3)  # padded to 8: 5 padding tokens, more than a row
    _, _, five = build_attn_metadata([([5, 6, 7], 0), ([8, 9], 0)], [[3], [5]], BLOCK)
    assert graphs.can_run(five, 5)  # 3 padding tokens


def test_staged_batch_keeps_each_kv_groups_tables(tiny_qwen3_dir):
    """Two KV groups (layer 1 in group 1, reading other blocks): the staged batch gives the
    unpadded forward's rows, and each layer writes only its own group's blocks."""
    model, kv = _prefilled(tiny_qwen3_dir)
    layers = model.attention_layers()
    layers[1].kv_group = 1
    requests, tables = BATCHES["three requests"]
    moved = [[b + 7 for b in table] for table in tables]  # group 1: blocks 10, 14, 12, 13, 15
    ids, pos, first = build_attn_metadata(requests, tables, BLOCK)
    _, _, second = build_attn_metadata(requests, moved, BLOCK)
    # Request 0's cached context sits in block 3 of group 0: move layer 1's to block 10.
    kv.caches[1][:, 10] = kv.caches[1][:, 3]
    kv.caches[1][:, 3] = float("nan")
    metadata = grouped_metadata(
        torch.stack([first.slot_mapping, second.slot_mapping]),
        torch.stack([first.block_table, second.block_table]),
        query_start_loc=first.query_start_loc,
        seq_lens=first.seq_lens,
        block_size=BLOCK,
        max_query_len=first.max_query_len,
        max_seq_len=first.max_seq_len,
        query_start_loc_cpu=first.query_start_loc_cpu,
        seq_lens_cpu=first.seq_lens_cpu,
    )
    before = [c.clone() for c in kv.caches]
    t = ids.shape[0]
    with torch.inference_mode():
        with set_forward_context(metadata, model):
            want = model.forward(ids, pos)
        written = [
            {i for i in range(1, 16) if not c[:, i].nan_to_num(7).equal(b[:, i].nan_to_num(7))}
            for c, b in zip(kv.caches, before, strict=True)
        ]
        for cache, old in zip(kv.caches, before, strict=True):
            cache.copy_(old)
        graphs = MixedGraphs(
            model.forward, model=model, capture_sizes=[16], max_num_seqs=4, max_blocks_per_seq=4,
            block_size=BLOCK, device=torch.device("cpu"), num_kv_groups=2,
        )  # fmt: skip
        graphs.block_table.fill_(15)  # stale tables from earlier steps must not be read
        size, staged = graphs.stage(ids, pos, metadata)
        with set_forward_context(staged, model):
            got = model.forward(graphs.input_ids[:size], graphs.positions[:size])
    assert written[0] == {7, 5, 6, 8} and written[1] == {14, 12, 13, 15}
    torch.testing.assert_close(got[:t], want, rtol=1e-5, atol=1e-5)
