"""Per-layer FP8 KV-cache scales: the torch reference store/read, calibration from the first
batch, and the config switch."""

from __future__ import annotations

import pytest
import torch

from libkk.config import EngineConfig
from libkk.errors import ConfigError
from libkk.layers.attention import (
    FP8_MAX,
    Attention,
    calibrate_kv_scales_on_first_prefill,
    dequantize,
    gather_blocks,
    kv_scale_calibration_pending,
    store_kv,
)
from libkk.layers.forward_context import AttentionMetadata, set_forward_context

FP8 = torch.float8_e4m3fn
HEADS, KV_HEADS, DIM, PAGE = 4, 2, 16, 4


def _cache(num_blocks: int = 8, dtype: torch.dtype = FP8) -> torch.Tensor:
    return torch.zeros(2, num_blocks, PAGE, KV_HEADS, DIM).to(dtype)


def _read(cache: torch.Tensor, slots: torch.Tensor, k_scale, v_scale) -> tuple:
    """The rows at `slots`, dequantized as the backend reads them."""
    flat = [gather_blocks(cache[i], torch.arange(cache.shape[1])).flatten(0, 1) for i in (0, 1)]
    return dequantize(flat[0][slots], k_scale, torch.float32), dequantize(
        flat[1][slots], v_scale, torch.float32
    )


def test_fp8_store_and_read_round_trip_with_scales():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(6, KV_HEADS, DIM, generator=gen) * 2000.0  # far beyond e4m3's 448
    v = torch.randn(6, KV_HEADS, DIM, generator=gen) * 1e-4  # below e4m3's smallest subnormal
    k_scale, v_scale = torch.tensor([k.abs().max() / FP8_MAX]), torch.tensor([1e-6])
    slots = torch.tensor([4, 5, 9, 13, 22, 31])
    cache = _cache()
    store_kv(k, v, cache, slots, k_scale, v_scale)
    # The cache holds x / scale rounded to e4m3 (3 mantissa bits: relative error <= 2^-4).
    assert torch.equal(cache[0].flatten(0, 1)[slots].float(), (k / k_scale).to(FP8).float())
    # e4m3: relative error <= 2^-4, absolute <= scale * 2^-10 among subnormals.
    k_back, v_back = _read(cache, slots, k_scale, v_scale)
    torch.testing.assert_close(k_back, k, rtol=2**-4, atol=k_scale.item() * 2**-10)
    torch.testing.assert_close(v_back, v, rtol=2**-4, atol=v_scale.item() * 2**-10)
    # The same rows at scale 1.0 lose both: keys saturate at 448, values flush to zero.
    plain = _cache()
    store_kv(k, v, plain, slots)
    k_plain, v_plain = _read(plain, slots, None, None)
    assert k_plain.abs().max() == FP8_MAX and (v_plain == 0).all()


def test_fp8_store_saturates_beyond_the_scaled_range():
    k = torch.full((1, KV_HEADS, DIM), 1000.0)
    cache = _cache()
    store_kv(k, -k, cache, torch.tensor([7]), torch.tensor([2.0]), torch.tensor([0.5]))
    k_back, v_back = _read(cache, torch.tensor([7]), torch.tensor([2.0]), torch.tensor([0.5]))
    assert (k_back == 896.0).all() and (v_back == -224.0).all()  # 448 * scale


def _metadata(slots: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        block_size=PAGE,
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )


def _layer(cache_dtype: torch.dtype = FP8) -> Attention:
    layer = Attention(HEADS, DIM, KV_HEADS, DIM**-0.5)
    layer.kv_cache = _cache(dtype=cache_dtype)
    return layer


def _attend(layer, metadata, k_gain: float, v_gain: float, seed: int = 0, q_gain: float = 1.0):
    n = metadata.slot_mapping.shape[0]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS * DIM, generator=gen) * q_gain
    k = torch.randn(n, KV_HEADS * DIM, generator=gen) * k_gain
    v = torch.randn(n, KV_HEADS * DIM, generator=gen) * v_gain
    with set_forward_context(metadata, layer):
        out = layer.attend(q, k, v)
    return k, v, out


def test_calibration_takes_the_first_real_batch_then_stays():
    layers = [_layer(), _layer()]
    assert calibrate_kv_scales_on_first_prefill(torch.nn.ModuleList(layers)) == 2
    k_ptr = layers[0].k_scale.data_ptr()
    # A padding-only step (warm-up, graph capture: every slot in the null block) calibrates nothing.
    pad = _metadata([0, 1, 2], [3], [[0]])
    _attend(layers[0], pad, 5000.0, 3.0)
    assert layers[0].calibration_pending and layers[0].kv_scales == (1.0, 1.0)
    assert kv_scale_calibration_pending(layers)
    # Two prefills; the padded row (slot 0) carries a huge key that must not count.
    first = _metadata([4, 5, 6, 8, 9, 0], [3, 2, 1], [[1], [2], [0]])
    for i, layer in enumerate(layers):
        k, v, _ = _attend(layer, first, 1000.0 * (i + 1), 0.01, seed=i)
        real = torch.arange(6) < 5
        k_want = k[real].abs().max().item() / FP8_MAX
        v_want = v[real].abs().max().item() / FP8_MAX
        assert k[~real].abs().max() > 0  # the padded row is not zero: excluding it matters
        assert layer.kv_scales == pytest.approx((k_want, v_want), rel=1e-6)
        assert not layer.calibration_pending
    assert layers[0].kv_scales != pytest.approx(layers[1].kv_scales)  # per layer
    assert not kv_scale_calibration_pending(layers)
    # The next steps (larger values) leave the scales, and their storage, as they are.
    before = [layer.kv_scales for layer in layers]
    decode = _metadata([7, 10], [1, 1], [[1], [2]])
    for layer in layers:
        _attend(layer, decode, 1e5, 1e5, seed=3)
    assert [layer.kv_scales for layer in layers] == before
    assert layers[0].k_scale.data_ptr() == k_ptr


def test_calibrated_layer_stores_and_attends_with_its_scales():
    """After calibration, the first batch's K/V (|x| >> 448) survive the FP8 cache; q is small
    so the scores stay ordinary (keys' rounding errors must not decide a one-hot softmax)."""
    layer, plain, ref = _layer(), _layer(), _layer(torch.float32)
    layer.calibrate_kv_scales_on_first_prefill()
    meta = _metadata([4, 5, 6, 7, 8], [5], [[1, 2]])
    k, v, out = _attend(layer, meta, 3000.0, 3000.0, q_gain=1 / 3000)
    _, _, out_plain = _attend(plain, meta, 3000.0, 3000.0, q_gain=1 / 3000)
    _, _, out_ref = _attend(ref, meta, 3000.0, 3000.0, q_gain=1 / 3000)
    slots = meta.slot_mapping
    k_back, _ = _read(layer.kv_cache, slots, layer.k_scale, layer.v_scale)
    k_want = k.view(-1, KV_HEADS, DIM)
    torch.testing.assert_close(k_back, k_want, rtol=2**-4, atol=layer.kv_scales[0] * 2**-10)
    err, err_plain = (out - out_ref).abs().max(), (out_plain - out_ref).abs().max()
    assert err < 0.1 * err_plain


def test_calibration_is_skipped_for_caches_without_scales():
    layer = _layer(torch.float32)
    layer.calibrate_kv_scales_on_first_prefill()
    _attend(layer, _metadata([4, 5], [2], [[1]]), 1000.0, 1000.0)
    assert not layer.calibration_pending and layer.kv_scales == (1.0, 1.0)


def test_set_kv_scales_fills_in_place_and_validates():
    layer = _layer()
    k_scale = layer.k_scale
    layer.set_kv_scales(0.5, 2.0)
    assert layer.k_scale is k_scale and layer.kv_scales == (0.5, 2.0)
    assert "k_scale" not in layer.state_dict()  # not a weight
    with pytest.raises(ValueError, match="k_scale"):
        layer.set_kv_scales(0.0, 1.0)
    with pytest.raises(ValueError, match="v_scale"):
        layer.set_kv_scales(1.0, float("nan"))


def test_calculate_kv_scales_needs_an_fp8_cache():
    config = EngineConfig.from_settings(kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert config.cache.calculate_kv_scales
    with pytest.raises(ConfigError, match="calculate_kv_scales needs kv_cache_dtype='fp8'"):
        EngineConfig.from_settings(calculate_kv_scales=True)
