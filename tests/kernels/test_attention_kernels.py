"""store_kv and paged_attention against their torch references.

Fresh random inputs, NaN-poisoned outputs and unused cache slots, scrambled block tables, several
head layouts / block sizes / tile sizes, prefix hits, decode, spec-verify and mixed batches. On CPU
the ops run in Triton's interpreter (fp32/fp16: its bf16 dot is wrong); on CUDA bf16 and FP8 join.
"""

from __future__ import annotations

import libkk.kernels.attention as pa
import pytest
import torch
from kernel_env import DEVICE, ON_CUDA, RUNS_KERNELS
from libkk.kernels import (
    FP8_DTYPE,
    paged_attention,
    paged_attention_ref,
    store_kv,
    store_kv_ref,
)
from paged_batch import PagedBatch, make_batch

from libkk.layers.attention import TorchAttentionBackend
from libkk.layers.triton_attention import TritonAttentionBackend

pytestmark = RUNS_KERNELS

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# (num_heads, num_kv_heads, head_dim, block_size)
LAYOUTS = {
    "mha": (2, 2, 16, 4),
    "gqa2": (4, 2, 32, 8),
    "gqa4": (8, 2, 64, 16),
    "gqa3-d24": (6, 2, 24, 4),
}
# Requests as (query_len, seq_len); seq_len - query_len positions come from the cache.
BATCHES = {
    "prefill": [(5, 5), (17, 17), (1, 1)],
    "prefix-hit": [(3, 20), (9, 22), (1, 40)],
    "decode": [(1, 1), (1, 17), (1, 40), (1, 70)],
    "verify": [(3, 3), (3, 20), (3, 70)],
    "mixed": [(1, 33), (12, 12), (1, 70), (4, 25)],
}


def _batch(batch: str, layout: str, dtype: torch.dtype, seed: int = 0, **kw) -> PagedBatch:
    return make_batch(BATCHES[batch], *LAYOUTS[layout], dtype=dtype, device=DEVICE, seed=seed, **kw)


def _check_attention(b: PagedBatch, tol: float, **kw) -> torch.Tensor:
    # New rows go in first, as the backends do; the reference store keeps both paths' caches equal.
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    out = torch.full_like(b.q, float("nan"))
    got = paged_attention(*b.attention_args(), out=out, **kw)
    assert got is out
    want = paged_attention_ref(*b.attention_args())
    n = b.num_real_tokens
    torch.testing.assert_close(out[:n].float(), want[:n].float(), atol=tol, rtol=tol)
    return out


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """16-wide tiles: several q blocks per request and several KV tiles per sequence."""
    monkeypatch.setattr(pa, "VARLEN_BLOCK_M", 16)
    monkeypatch.setattr(pa, "VARLEN_BLOCK_N", 16)
    monkeypatch.setattr(pa, "DECODE_BLOCK_N", 16)


# --- store_kv ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["mha", "gqa4", "gqa3-d24"])
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(d, d) for d in DTYPES] + ([(torch.bfloat16, FP8_DTYPE)] if ON_CUDA else []),
)
def test_store_kv_matches_reference(layout, dtype, cache_dtype):
    b = _batch("mixed", layout, dtype, cache_dtype=cache_dtype, num_pad_rows=4, k_scale=0.02,
               v_scale=3.0)  # fmt: skip
    # Large keys saturate in FP8 (|x / 0.02| > 448), small values underflow: both clamp paths.
    k = b.k * 20
    want = b.kv_cache.clone()
    store_kv_ref(k, b.v, want, b.slot_mapping, b.k_scale, b.v_scale)
    store_kv(k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    assert torch.equal(b.kv_cache.view(torch.uint8), want.view(torch.uint8))
    # Padded rows (null block, -1) wrote nothing: the null block is still all NaN.
    assert b.kv_cache[:, 0].float().isnan().all()
    assert (
        not b.kv_cache.view(2, -1, *b.kv_cache.shape[3:])[:, b.slot_mapping[:-4]]
        .float()
        .isnan()
        .any()
    )


def test_store_kv_empty_and_bad_shapes():
    b = _batch("decode", "gqa2", torch.float32)
    before = b.kv_cache.clone()
    store_kv(b.k[:0], b.v[:0], b.kv_cache, b.slot_mapping[:0], b.k_scale, b.v_scale)
    assert torch.equal(b.kv_cache.view(torch.uint8), before.view(torch.uint8))
    with pytest.raises(ValueError, match="num_tokens, num_kv_heads, head_dim"):
        store_kv(b.k[:, :1], b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)


# --- paged_attention ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_matches_reference(batch, layout, dtype):
    _check_attention(_batch(batch, layout, dtype, seed=1), TOLERANCE[dtype])


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("layout", ["mha", "gqa4", "gqa3-d24"])
def test_paged_attention_small_tiles(small_tiles, batch, layout):
    _check_attention(_batch(batch, layout, torch.float32, seed=2), TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
@pytest.mark.parametrize("batch", ["decode", "verify"])
def test_decode_splits(small_tiles, batch, num_splits):
    # 64 splits of 16-key tiles leave most splits empty for every sequence here.
    _check_attention(_batch(batch, "gqa4", torch.float32, seed=3), 2e-5, num_splits=num_splits)


@pytest.mark.parametrize("batch", ["decode", "verify"])
def test_uniform_batch_through_varlen_path(monkeypatch, batch):
    monkeypatch.setattr(pa, "DECODE_MAX_ROWS", 0)
    _check_attention(_batch(batch, "gqa2", torch.float32, seed=4), 2e-5)


@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_fp8_cache(batch):
    """FP8 caches dequantize on load: scores take k_scale, outputs v_scale."""
    b = _batch(batch, "gqa4", torch.float32, seed=5, cache_dtype=FP8_DTYPE, k_scale=0.05,
               v_scale=0.2)  # fmt: skip
    _check_attention(b, 2e-5, num_splits=3)


def test_padding_rows_and_empty_requests():
    """Rows past the last request stay as they were; query_len 0 requests own no rows."""
    requests = [(2, 9), (0, 5), (3, 3), (0, 0)]
    b = make_batch(requests, *LAYOUTS["gqa2"], device=DEVICE, seed=6, num_pad_rows=3)
    out = _check_attention(b, 2e-5)
    assert out[b.num_real_tokens :].isnan().all()


@pytest.mark.parametrize("requests", [[(1, 9), (4, 4), (0, 0), (0, 0)], [(1, 5), (1, 7), (0, 0)]])
def test_any_split_under_the_largest_query_len(requests):
    """A mixed-batch graph (graphs/capture.MixedGraphs) fixes max_query_len at its token count
    whatever the split of its tokens into requests, some of them empty: the varlen kernel's
    choice for that length serves every split exactly."""
    b = make_batch(requests, *LAYOUTS["gqa2"], device=DEVICE, seed=7)
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    args = list(b.attention_args())
    want = paged_attention_ref(*args)
    args[8] = b.q.shape[0]  # every token in one request at most
    got = paged_attention(*args)
    n = b.num_real_tokens
    torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)


def test_paged_attention_rejects_bad_shapes():
    b = _batch("decode", "gqa2", torch.float32)
    with pytest.raises(ValueError, match="multiple of"):
        paged_attention(b.q[:, :3], *b.attention_args()[1:])
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(b.q, b.kv_cache[:, :, :2], *b.attention_args()[2:])


# --- custom ops and the backend ---------------------------------------------------------------


def test_ops_pass_opcheck():
    b = _batch("mixed", "gqa2", torch.float32, num_pad_rows=2)
    torch.library.opcheck(
        torch.ops.libkk.store_kv.default,
        (b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale),
    )
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    args = b.attention_args()
    out = torch.zeros_like(b.q)
    torch.library.opcheck(torch.ops.libkk.paged_attention.default, (*args[:5], out, *args[5:], 0))


def test_ops_trace_under_torch_compile():
    b = _batch("mixed", "gqa2", torch.float32)

    def step(q, k, v, kv_cache):
        store_kv(k, v, kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
        return paged_attention(q, kv_cache, *b.attention_args()[2:]) * 2

    cache = b.kv_cache.clone()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(b.q, b.k, b.v, b.kv_cache)
    want = step(b.q, b.k, b.v, cache)
    n = b.num_real_tokens
    torch.testing.assert_close(got[:n], want[:n], atol=0, rtol=0)


def test_triton_backend_matches_torch_backend_over_steps():
    """Prefill, then a mixed step, then decode: same outputs as the torch reference backend."""
    triton_be, torch_be = TritonAttentionBackend(), TorchAttentionBackend()
    layout = LAYOUTS["gqa2"]
    # One cache and one block table for the whole run, sized for the final lengths.
    final = make_batch([(9, 9), (15, 15)], *layout, device=DEVICE, seed=7)
    page = final.kv_cache.shape[2]
    table = final.block_table.tolist()
    cache_triton, cache_torch = final.kv_cache, final.kv_cache.clone()
    steps = [[(6, 6), (9, 9)], [(1, 7), (5, 14)], [(2, 9), (1, 15)]]
    for i, requests in enumerate(steps):
        step = make_batch(requests, *layout, device=DEVICE, seed=10 + i)
        step.block_table = final.block_table
        step.slot_mapping = torch.tensor(
            [table[r][p // page] * page + p % page for r, (q, s) in enumerate(requests)
             for p in range(s - q, s)],
            dtype=torch.int64, device=DEVICE,
        )  # fmt: skip
        meta = step.metadata()
        got = triton_be.forward(step.q, step.k, step.v, cache_triton, meta, step.scale)
        want = torch_be.forward(step.q, step.k, step.v, cache_torch, meta, step.scale)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("batch", ["prefill", "decode", "mixed"])
def test_triton_backend_fuses_qk_norm_rope_like_the_torch_backend(batch):
    """Qwen3's prologue: the Triton backend's fused norm/rope/store gives the torch backend's
    outputs and cache; its padded rows write nothing."""
    from libkk.layers.attention import QKNormRope
    from libkk.layers.norm import RMSNorm
    from libkk.layers.rotary import RopeConfig, RotaryEmbedding

    # (The torch backend's batched decode takes no padded rows.)
    b = _batch(batch, "gqa2", torch.float32, seed=11, num_pad_rows=0 if batch == "decode" else 2)
    b.slot_mapping[b.num_real_tokens :] = 1  # the null block (the torch backend may write there)
    n, head_dim = b.q.shape[0], b.q.shape[2]
    g = torch.Generator().manual_seed(12)
    with torch.device(DEVICE):
        q_norm, k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        rope = RotaryEmbedding(head_dim, 128, RopeConfig(theta=10000.0))
    with torch.no_grad():
        q_norm.weight.copy_(1 + torch.randn(head_dim, generator=g) / 4)
        k_norm.weight.copy_(1 + torch.randn(head_dim, generator=g) / 4)
    prologue = QKNormRope(q_norm, k_norm, rope)
    positions = torch.randint(0, 128, (n,), generator=g).to(DEVICE)
    q, k, v = (x.reshape(n, -1) for x in (b.q, b.k, b.v))
    meta = b.metadata()
    cache_torch = b.kv_cache.clone()
    want = TorchAttentionBackend().forward_qk_norm_rope(
        q, k, v, prologue, positions, cache_torch, meta, b.scale
    )
    got = TritonAttentionBackend().forward_qk_norm_rope(
        q, k, v, prologue, positions, b.kv_cache, meta, b.scale
    )
    real = b.num_real_tokens
    torch.testing.assert_close(got[:real], want[:real], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(
        b.kv_cache[:, 1:], cache_torch[:, 1:], atol=2e-5, rtol=2e-5, equal_nan=True
    )
    assert b.kv_cache[:, 0].isnan().all()  # the kernel skipped the padded rows


def test_triton_backend_reads_the_scales_it_is_given():
    """Per-layer scale tensors reach the ops; without them the backend uses 1.0."""
    b = _batch("mixed", "gqa2", torch.float32, seed=8, cache_dtype=FP8_DTYPE, k_scale=0.05,
               v_scale=0.2)  # fmt: skip
    # The reference store writes both caches: the interpreter's FP8 store rounds differently.
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    want = paged_attention_ref(*b.attention_args())
    n = b.num_real_tokens
    got = paged_attention(*b.attention_args())
    torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    backend = TritonAttentionBackend()
    one_k, one_v = backend.unit_scales(torch.device(DEVICE))
    assert backend.unit_scales(torch.device(DEVICE)) == (one_k, one_v)
    assert (one_k.item(), one_v.item()) == (1.0, 1.0) and one_k is not one_v
    unscaled = paged_attention(*b.attention_args()[:6], one_k, one_v, b.max_query_len)
    assert not torch.allclose(unscaled[:n], want[:n], atol=1e-2)


@pytest.mark.parametrize("batch", ["prefill", "prefix-hit", "decode", "mixed"])
def test_fp8_torch_backend_means_what_the_kernels_mean(batch):
    """The torch backend stores k / k_scale and v / v_scale in e4m3 and multiplies back on read:
    the Triton kernels reading the cache it wrote give its outputs (scales != 1, some keys
    saturate)."""
    b = _batch(batch, "gqa4", torch.float32, seed=9, cache_dtype=FP8_DTYPE, k_scale=0.05,
               v_scale=0.2)  # fmt: skip
    k = b.k * 20  # |k / 0.05| > 448 for some keys: both stores saturate
    want = b.kv_cache.clone()
    store_kv_ref(k, b.v, want, b.slot_mapping, b.k_scale, b.v_scale)
    got = TorchAttentionBackend().forward(
        b.q, k, b.v, b.kv_cache, b.metadata(), b.scale, b.k_scale, b.v_scale
    )
    assert torch.equal(b.kv_cache.view(torch.uint8), want.view(torch.uint8))
    n = b.num_real_tokens
    kernel = paged_attention(*b.attention_args())
    torch.testing.assert_close(got[:n], kernel[:n], atol=2e-5, rtol=2e-5)


# --- sliding windows ----------------------------------------------------------------------------


def _windowed_reference_by_hand(b: PagedBatch, window: int) -> torch.Tensor:
    """Full attention over only the keys in (p - window, p], one query row at a time: the
    window's meaning restated without the reference's mask."""
    page, num_kv_heads = b.kv_cache.shape[2], b.kv_cache.shape[3]
    group = b.q.shape[1] // num_kv_heads
    out = torch.zeros(b.num_real_tokens, *b.q.shape[1:], dtype=torch.float32, device=b.q.device)
    starts = b.query_start_loc.tolist()
    for i, (query_len, seq_len) in enumerate(zip(b.query_lens, b.seq_lens_list, strict=True)):
        blocks = b.block_table[i, : -(-seq_len // page)].long()
        keys = b.kv_cache[0, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        values = b.kv_cache[1, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        for r in range(query_len):
            pos = seq_len - query_len + r
            lo = max(0, pos - window + 1)
            qr = b.q[starts[i] + r].float()  # [heads, dim]
            scores = torch.einsum("hd,nhd->hn", qr, keys[lo : pos + 1]) * b.scale
            out[starts[i] + r] = torch.einsum(
                "hn,nhd->hd", scores.softmax(-1), values[lo : pos + 1]
            )
    return out


@pytest.mark.parametrize("window", [1, 5, 16, 1000])
@pytest.mark.parametrize("batch", ["prefix-hit", "decode", "verify", "mixed"])
def test_sliding_window_matches_reference(small_tiles, batch, window):
    """Each query sees its last `window` positions, itself included; the kernels skip the tiles
    before the window (16-key tiles: several of them are skipped in 70-token contexts)."""
    b = _batch(batch, "gqa2", torch.float32, seed=13)
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    want = paged_attention_ref(*b.attention_args(), window=window)
    n = b.num_real_tokens
    torch.testing.assert_close(want[:n].float(), _windowed_reference_by_hand(b, window))
    got = paged_attention(*b.attention_args(), out=torch.full_like(b.q, float("nan")),
                          window=window)  # fmt: skip
    torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    if window == 1000:  # wider than every context: full attention
        torch.testing.assert_close(want, paged_attention_ref(*b.attention_args()))


@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("batch", ["decode", "verify"])
def test_sliding_window_decode_splits(small_tiles, batch, num_splits):
    b = _batch(batch, "gqa4", torch.float32, seed=14)
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    want = paged_attention_ref(*b.attention_args(), window=7)
    got = paged_attention(*b.attention_args(), num_splits=num_splits, window=7)
    n = b.num_real_tokens
    torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)


def test_windowed_decode_splits_keep_whole_tile_runs():
    """A windowed layer's decode splits get MIN_WINDOW_SPLIT_TILES key tiles each or more (a
    128-key window: one split, so no merge kernel); full attention keeps the SM-based count."""
    device, tile = torch.device("cuda" if ON_CUDA else "cpu"), pa.DECODE_BLOCK_N
    full = pa.default_num_splits(1, 8, device)
    assert full > 1
    assert pa.default_num_splits(1, 8, device, max_keys=128) == 1
    run = pa.MIN_WINDOW_SPLIT_TILES * tile
    assert pa.default_num_splits(1, 8, device, max_keys=2 * run + 1) == min(3, full)
    assert pa.default_num_splits(1, 8, device, max_keys=1 << 20) == full


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
def test_sliding_window_fp16_varlen(dtype):
    b = _batch("mixed", "gqa3-d24", dtype, seed=15)
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    want = paged_attention_ref(*b.attention_args(), window=9)
    got = paged_attention(*b.attention_args(), window=9)
    n = b.num_real_tokens
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("batch", ["prefill", "prefix-hit", "decode", "mixed"])
def test_sliding_window_backends_match_reference(batch):
    """The torch backend (the CPU path) and the Triton backend honour the window as the
    reference op does."""
    b = _batch(batch, "gqa2", torch.float32, seed=16)
    cache_torch = b.kv_cache.clone()
    meta = b.metadata()
    got_triton = TritonAttentionBackend().forward(
        b.q, b.k, b.v, b.kv_cache, meta, b.scale, window=6
    )
    got_torch = TorchAttentionBackend().forward(b.q, b.k, b.v, cache_torch, meta, b.scale, window=6)
    want = paged_attention_ref(*b.attention_args(), window=6)
    n = b.num_real_tokens
    torch.testing.assert_close(got_torch[:n], want[:n], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_triton[:n], want[:n], atol=2e-5, rtol=2e-5)


# --- attention sinks ------------------------------------------------------------------------------


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    # Around the scores' size, so the sink takes a real share of each row (some rows most of it).
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=g) * 2.0).to(DEVICE)


def _sink_reference_by_hand(b: PagedBatch, sinks: torch.Tensor, window: int) -> torch.Tensor:
    """Each row: exp(scores) / (sum exp(scores) + exp(sink)) over its visible keys, the sink's
    definition written out, one query row at a time."""
    page, num_kv_heads = b.kv_cache.shape[2], b.kv_cache.shape[3]
    group = b.q.shape[1] // num_kv_heads
    out = torch.zeros(b.num_real_tokens, *b.q.shape[1:], dtype=torch.float64, device=b.q.device)
    starts = b.query_start_loc.tolist()
    for i, (query_len, seq_len) in enumerate(zip(b.query_lens, b.seq_lens_list, strict=True)):
        blocks = b.block_table[i, : -(-seq_len // page)].long()
        keys = b.kv_cache[0, blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        values = b.kv_cache[1, blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        for r in range(query_len):
            pos = seq_len - query_len + r
            lo = max(0, pos - window + 1) if window else 0
            qr = b.q[starts[i] + r].double()
            scores = torch.einsum("hd,nhd->hn", qr, keys[lo : pos + 1]) * b.scale
            e = scores.exp()
            weights = e / (e.sum(-1, keepdim=True) + sinks.double().exp()[:, None])
            out[starts[i] + r] = torch.einsum("hn,nhd->hd", weights, values[lo : pos + 1])
    return out


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("batch", ["prefill", "prefix-hit", "decode", "verify", "mixed"])
def test_sinks_match_reference(small_tiles, batch, window):
    b = _batch(batch, "gqa2", torch.float32, seed=21)
    sinks = _sinks(b.q.shape[1], 3)
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    want = paged_attention_ref(*b.attention_args(), window=window, sinks=sinks)
    n = b.num_real_tokens
    torch.testing.assert_close(
        want[:n].double(), _sink_reference_by_hand(b, sinks, window), atol=1e-5, rtol=1e-5
    )
    got = paged_attention(*b.attention_args(), out=torch.full_like(b.q, float("nan")),
                          window=window, sinks=sinks)  # fmt: skip
    torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    # The sinks change the output: they are not ignored.
    assert not torch.allclose(want[:n], paged_attention_ref(*b.attention_args(), window=window)[:n])


@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("batch", ["decode", "verify"])
def test_sinks_decode_splits(small_tiles, batch, num_splits):
    """The merge of split partial softmaxes adds each head's sink once."""
    b = _batch(batch, "gqa4", torch.float32, seed=22)
    sinks = _sinks(b.q.shape[1], 4)
    store_kv_ref(b.k, b.v, b.kv_cache, b.slot_mapping, b.k_scale, b.v_scale)
    want = paged_attention_ref(*b.attention_args(), sinks=sinks)
    got = paged_attention(*b.attention_args(), num_splits=num_splits, sinks=sinks)
    n = b.num_real_tokens
    torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("batch", ["prefill", "prefix-hit", "decode", "mixed"])
def test_sinks_backends_match_reference(batch):
    """The torch backend (the CPU path) and the Triton backend take the sinks as the reference
    op does, with a window too."""
    b = _batch(batch, "gqa2", torch.float32, seed=23)
    sinks = _sinks(b.q.shape[1], 5)
    cache_torch = b.kv_cache.clone()
    meta = b.metadata()
    got_triton = TritonAttentionBackend().forward(
        b.q, b.k, b.v, b.kv_cache, meta, b.scale, window=6, sinks=sinks
    )
    got_torch = TorchAttentionBackend().forward(
        b.q, b.k, b.v, cache_torch, meta, b.scale, window=6, sinks=sinks
    )
    want = paged_attention_ref(*b.attention_args(), window=6, sinks=sinks)
    n = b.num_real_tokens
    torch.testing.assert_close(got_torch[:n], want[:n], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_triton[:n], want[:n], atol=2e-5, rtol=2e-5)


def test_sinks_rejects_bad_shapes():
    b = _batch("decode", "gqa2", torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(*b.attention_args(), sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(*b.attention_args(), sinks=torch.zeros(b.q.shape[1], device=DEVICE).half())
