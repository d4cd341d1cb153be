"""Properties of libkk.audio resampling that hold without torchaudio."""

from __future__ import annotations

import math

import pytest
import torch

from libkk.audio import Resample, resample
from libkk.audio.resampling import clear_kernel_cache, kernel_cache_info
from libkk.errors import InvalidRequestError, LibkkError


def _noise(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tone(freq: float, rate: int, seconds: float = 1.0) -> torch.Tensor:
    t = torch.arange(int(rate * seconds), dtype=torch.float64) / rate
    return torch.sin(2 * math.pi * freq * t).float()


def test_equal_rates_return_the_input_itself() -> None:
    x = _noise(2, 100)
    assert resample(x, 16000, 16000) is x
    assert resample(x, 16000, 16000.0) is x
    module = Resample(22050, 22050)
    assert module(x) is x
    assert "kernel" not in module.state_dict()


@pytest.mark.parametrize(
    ("orig", "new", "length"),
    [
        (44100, 16000, 44100),
        (16000, 44100, 1),
        (8000, 11025, 997),
        (48000, 24000, 3),
        (22050, 48000, 12345),
        (24000, 16000, 2),
    ],
)
def test_output_length_is_ceil_of_scaled_length(orig: int, new: int, length: int) -> None:
    expected = math.ceil(new * length / orig)
    x = _noise(length)
    assert resample(x, orig, new).shape == (expected,)
    module = Resample(orig, new)
    assert module(x).shape == (expected,)
    assert module.output_length(length) == expected


def test_rates_are_reduced_by_their_gcd() -> None:
    x = _noise(2, 5000)
    full, reduced = Resample(44100, 16000), Resample(441, 160)
    assert full.kernel.shape == (160, 1, reduced.kernel.shape[-1])
    assert torch.equal(full.kernel, reduced.kernel)
    assert torch.equal(full(x), reduced(x))
    assert torch.equal(resample(x, 48000, 32000), resample(x, 3, 2))


def test_integral_float_rates_are_accepted() -> None:
    x = _noise(300)
    assert torch.equal(Resample(44100.0, 16000.0)(x), Resample(44100, 16000)(x))


def test_leading_dims_and_channels_match_per_channel_calls() -> None:
    x = _noise(2, 3, 1500, seed=1)
    module = Resample(48000, 44100)
    batched = module(x)
    assert batched.shape == (2, 3, module.output_length(1500))
    # Leading dims are only a batch: exactly the [6, time] result, reshaped.
    assert torch.equal(batched, module(x.reshape(6, 1500)).reshape(2, 3, -1))
    functional = resample(x, 48000, 44100)
    assert torch.equal(functional, resample(x.reshape(6, 1500), 48000, 44100).reshape(2, 3, -1))
    # NOTE: one channel at a time runs conv1d at batch 1, whose CPU kernels may sum in another
    # order (torchaudio has the same property), so this one is close rather than equal.
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(module(x[i, j]), batched[i, j], atol=1e-6, rtol=0)


def test_non_contiguous_input() -> None:
    x = _noise(1000, 2).t()  # [2, 1000], not contiguous
    assert torch.equal(Resample(16000, 8000)(x), Resample(16000, 8000)(x.contiguous()))


def test_kernel_cache_reuses_built_kernels() -> None:
    clear_kernel_cache()
    x = _noise(2, 800)
    resample(x, 44100, 16000)
    before = kernel_cache_info()
    resample(x, 44100, 16000)
    resample(x, 88200, 32000)  # same reduced pair
    after = kernel_cache_info()
    assert after.hits == before.hits + 2 and after.misses == before.misses
    resample(x.double(), 44100, 16000)  # another dtype: another kernel
    assert kernel_cache_info().misses == after.misses + 1
    a, b = Resample(44100, 16000), Resample(44100, 16000)
    assert kernel_cache_info().hits >= after.hits + 1
    # Each transform owns a copy, so writing into one cannot reach the cache or the other.
    a.kernel.zero_()
    assert b.kernel.abs().sum() > 0 and Resample(44100, 16000).kernel.abs().sum() > 0


def test_kernel_first_built_under_inference_mode_supports_autograd() -> None:
    clear_kernel_cache()
    x = _noise(1, 400)
    with torch.inference_mode():
        resample(x, 24000, 16000)
    leaf = x.clone().requires_grad_(True)
    resample(leaf, 24000, 16000).square().sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0


def test_float64_input() -> None:
    x = _noise(2, 3000, seed=2)
    y64 = resample(x.double(), 44100, 22050)
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64.float(), resample(x, 44100, 22050), atol=1e-5, rtol=0)
    module = Resample(44100, 22050)
    z64 = module(x.double())
    assert z64.dtype == torch.float64
    torch.testing.assert_close(z64.float(), module(x), atol=1e-5, rtol=0)
    precise = Resample(44100, 22050, dtype=torch.float64)
    assert precise.kernel.dtype == torch.float64
    torch.testing.assert_close(precise(x.double()), y64, atol=1e-12, rtol=0)


def test_module_follows_to_dtype_and_state_dict() -> None:
    module = Resample(16000, 24000).to(torch.float64)
    assert module.kernel.dtype == torch.float64
    assert set(module.state_dict()) == {"kernel"}


@pytest.mark.parametrize(("orig", "new"), [(44100, 16000), (16000, 48000), (22050, 24000)])
def test_pure_tone_keeps_its_frequency_and_energy(orig: int, new: int) -> None:
    y = resample(_tone(1000.0, orig), orig, new)
    spectrum = torch.fft.rfft(y.double()).abs()
    assert int(spectrum.argmax()) == 1000  # 1 s of signal: bin k is k Hz
    edge = new // 50  # skip the zero-padded ends
    power = y[edge:-edge].double().square().mean().item()
    assert power == pytest.approx(0.5, rel=2e-3)


def test_tone_above_new_nyquist_is_removed() -> None:
    y = resample(_tone(10000.0, 44100), 44100, 16000)
    assert y[200:-200].double().square().mean().item() < 1e-4  # -37 dB below the input's 0.5


def test_kaiser_and_custom_filter_run() -> None:
    x = _tone(440.0, 16000, 0.25)
    for kw in (
        {"resampling_method": "sinc_interp_kaiser"},
        {"resampling_method": "sinc_interp_kaiser", "beta": 8.0},
        {"lowpass_filter_width": 16, "rolloff": 0.9},
    ):
        y = resample(x, 16000, 22050, **kw)
        assert y.shape == (math.ceil(22050 * 4000 / 16000),) and torch.isfinite(y).all()
        assert torch.equal(Resample(16000, 22050, **kw)(x), Resample(16000, 22050, **kw)(x))


def test_autograd_flows_through_resample() -> None:
    x = _noise(2, 500).requires_grad_(True)
    Resample(8000, 16000)(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"orig_freq": 22050.5}, "orig_freq=22050.5"),
        ({"new_freq": 0}, "new_freq=0"),
        ({"new_freq": -16000}, "new_freq=-16000"),
        ({"orig_freq": True}, "orig_freq=True"),
        ({"orig_freq": "44100"}, "orig_freq='44100'"),
        ({"orig_freq": float("nan")}, "orig_freq=nan"),
        ({"lowpass_filter_width": 0}, "lowpass_filter_width=0"),
        ({"rolloff": 0.0}, "rolloff=0.0"),
        ({"rolloff": 1.5}, "rolloff=1.5"),
        ({"resampling_method": "linear"}, "resampling_method='linear'"),
        ({"resampling_method": "sinc_interp_kaiser", "beta": -1.0}, "beta=-1.0"),
    ],
)
def test_bad_settings_raise_clear_errors(kwargs: dict[str, object], fragment: str) -> None:
    args = {"orig_freq": 44100, "new_freq": 16000, **kwargs}
    x = _noise(100)
    with pytest.raises(InvalidRequestError, match=fragment.replace(".", r"\.")):
        Resample(**args)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=fragment.replace(".", r"\.")):
        resample(x, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("waveform", "fragment"),
    [
        (torch.zeros(2, 100, dtype=torch.int16), "dtype=torch.int16"),
        (torch.zeros(100, dtype=torch.complex64), "dtype=torch.complex64"),
        (torch.zeros(0), r"shape=\(0,\)"),
        (torch.zeros(2, 0), r"shape=\(2, 0\)"),
        (torch.tensor(1.0), r"shape=\(\)"),
        ([0.0, 1.0], "expected a torch.Tensor"),
    ],
)
def test_bad_waveforms_raise_clear_errors(waveform: object, fragment: str) -> None:
    for call in (
        lambda: resample(waveform, 44100, 16000),  # type: ignore[arg-type]
        lambda: Resample(44100, 16000)(waveform),
        lambda: resample(waveform, 16000, 16000),
    ):  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=fragment) as info:
            call()
        assert isinstance(info.value, LibkkError) and isinstance(info.value, ValueError)
