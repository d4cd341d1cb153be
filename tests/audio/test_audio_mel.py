"""Properties of libkk.audio mel spectrograms that hold without torchaudio."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from libkk.audio import MelSpectrogram, melscale_fbanks, spectrogram
from libkk.audio.mel import hz_to_mel, mel_to_hz
from libkk.errors import InvalidRequestError


def _noise(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tone(freq: float, rate: int, seconds: float = 1.0) -> torch.Tensor:
    t = torch.arange(int(rate * seconds), dtype=torch.float64) / rate
    return torch.sin(2 * math.pi * freq * t).float()


def _speech() -> MelSpectrogram:
    return MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)


def test_defaults_follow_torchaudio() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 128 mels over 201 bins leaves some filters empty
        mel = MelSpectrogram(16000)
    assert (mel.n_fft, mel.win_length, mel.hop_length, mel.n_mels) == (400, 400, 200, 128)
    assert mel.fb.shape == (201, 128) and mel.fb.dtype == torch.float32
    assert torch.equal(mel.spectrogram.window, torch.hann_window(400))
    assert set(mel.state_dict()) == {"spectrogram.window", "mel_scale.fb"}
    out = mel(_noise(2, 16000))
    assert out.shape == (2, 128, mel.num_frames(16000)) == (2, 128, 81)


def test_empty_filter_warns_like_torchaudio() -> None:
    with pytest.warns(UserWarning, match="all zeros"):
        MelSpectrogram(16000)


@pytest.mark.parametrize(
    ("kwargs", "length"),
    [
        ({"center": False}, 1000),
        ({"pad": 50}, 999),
        ({"n_fft": 401, "hop_length": 100}, 1234),
        ({}, 201),
    ],
)
def test_num_frames(kwargs: dict[str, object], length: int) -> None:
    mel = MelSpectrogram(16000, n_mels=40, **kwargs)  # type: ignore[arg-type]
    assert mel(_noise(length)).shape == (40, mel.num_frames(length))


def test_leading_dims_are_a_batch() -> None:
    mel = _speech()
    x = _noise(2, 3, 4000)
    out = mel(x)
    assert out.shape == (2, 3, 80, 26)
    assert torch.equal(out, mel(x.reshape(6, 4000)).reshape(2, 3, 80, 26))


def test_spectrogram_power_and_normalization_relations() -> None:
    x = _noise(2, 3000)
    window = torch.hann_window(400)
    args = (x, 0, window, 400, 160, 400)
    complex_spec = spectrogram(*args, None, False)
    assert complex_spec.is_complex() and complex_spec.shape == (2, 201, 19)
    assert torch.equal(spectrogram(*args, 1.0, False), complex_spec.abs())
    assert torch.equal(spectrogram(*args, 2.0, False), complex_spec.abs().pow(2.0))
    by_window = spectrogram(*args, 1.0, True)
    torch.testing.assert_close(by_window, complex_spec.abs() / window.square().sum().sqrt())
    by_frame = spectrogram(*args, 1.0, "frame_length")
    torch.testing.assert_close(by_frame, complex_spec.abs() / math.sqrt(400))


def test_filterbank_shape_and_partition_of_unity() -> None:
    fb = melscale_fbanks(513, 0.0, 8000.0, 80, 22050)  # [n_freqs, n_mels]
    assert fb.shape == (513, 80) and fb.dtype == torch.float32
    assert (fb >= 0).all() and fb.max() <= 1.0
    assert (fb.max(dim=0).values > 0).all()  # no empty filter at these settings
    # Between the first and the last filter centre the overlapping triangles sum to one.
    freqs = torch.linspace(0, 22050 // 2, 513)
    f_pts = mel_to_hz(torch.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), 82))
    inside = (freqs >= f_pts[1]) & (freqs <= f_pts[80])
    torch.testing.assert_close(fb[inside].sum(dim=1), torch.ones(int(inside.sum())))
    assert (fb[freqs > 8000.0] == 0).all()


def test_slaney_norm_gives_unit_area_triangles() -> None:
    fb = melscale_fbanks(2049, 0.0, 8000.0, 40, 16000, norm="slaney", mel_scale="slaney")
    bin_hz = 8000.0 / 2048
    area = fb.sum(dim=0) * bin_hz  # rectangle rule over each triangle
    torch.testing.assert_close(area, torch.ones(40), rtol=0.02, atol=0)


def test_htk_and_slaney_mel_scales_known_values() -> None:
    assert hz_to_mel(0.0) == 0.0
    assert hz_to_mel(700.0) == pytest.approx(2595.0 * math.log10(2.0))
    assert hz_to_mel(1000.0) == pytest.approx(999.9855, abs=1e-4)
    assert hz_to_mel(500.0, "slaney") == pytest.approx(7.5)
    assert hz_to_mel(1000.0, "slaney") == pytest.approx(15.0)
    assert hz_to_mel(6400.0, "slaney") == pytest.approx(42.0)  # 27 log steps of 6.4**(1/27)
    mels = torch.tensor([0.0, 7.5, 15.0, 42.0], dtype=torch.float64)
    torch.testing.assert_close(
        mel_to_hz(mels, "slaney"), torch.tensor([0.0, 500.0, 1000.0, 6400.0], dtype=torch.float64)
    )
    htk = torch.tensor([hz_to_mel(f) for f in (100.0, 440.0, 4000.0)], dtype=torch.float64)
    torch.testing.assert_close(
        mel_to_hz(htk), torch.tensor([100.0, 440.0, 4000.0], dtype=torch.float64)
    )


def test_pure_tone_peaks_in_the_filter_around_its_frequency() -> None:
    mel = _speech()
    energy = mel(_tone(1000.0, 16000)).mean(dim=-1)  # [n_mels]
    centres = mel_to_hz(torch.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), 82))[1:-1]
    assert int(energy.argmax()) == int((centres - 1000.0).abs().argmin())


def test_float64_input_and_module_moves() -> None:
    mel = _speech()
    x = _noise(3200)
    out64 = mel(x.double())
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64.float(), mel(x), rtol=1e-4, atol=1e-4)
    mel64 = _speech().to(torch.float64)
    assert mel64.fb.dtype == torch.float64 and mel64.spectrogram.window.dtype == torch.float64
    torch.testing.assert_close(mel64(x.double()), out64, rtol=1e-6, atol=1e-6)


def test_window_fn_and_wkwargs() -> None:
    mel = MelSpectrogram(
        16000, n_fft=512, win_length=400, n_mels=40, window_fn=torch.hamming_window
    )
    assert torch.equal(mel.spectrogram.window, torch.hamming_window(400))
    sym = MelSpectrogram(16000, n_mels=40, wkwargs={"periodic": False})
    assert torch.equal(sym.spectrogram.window, torch.hann_window(400, periodic=False))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"sample_rate": 0}, "sample_rate=0"),
        ({"sample_rate": 16000.5}, "sample_rate=16000.5"),
        ({"n_fft": 0}, "n_fft=0"),
        ({"win_length": 500}, "win_length=500"),
        ({"hop_length": 0}, "hop_length=0"),
        ({"f_min": 9000.0}, "f_min=9000.0"),
        ({"f_min": -1.0}, "f_min=-1.0"),
        ({"f_max": 100.0, "f_min": 200.0}, "f_min=200.0"),
        ({"n_mels": 0}, "n_mels=0"),
        ({"pad": -1}, "pad=-1"),
        ({"power": None}, "power=None"),
        ({"power": 0.0}, "power=0.0"),
        ({"normalized": "l2"}, "normalized='l2'"),
        ({"pad_mode": "mirror"}, "pad_mode='mirror'"),
        ({"norm": "area"}, "norm='area'"),
        ({"mel_scale": "bark"}, "mel_scale='bark'"),
    ],
)
def test_bad_settings_raise_clear_errors(kwargs: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = {"sample_rate": 16000, "n_mels": 40, **kwargs}
    with pytest.raises(InvalidRequestError, match=fragment.replace(".", r"\.")):
        MelSpectrogram(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mel_kwargs", "waveform", "fragment"),
    [
        ({}, torch.zeros(1000, dtype=torch.int32), "dtype=torch.int32"),
        ({}, torch.zeros(2, 0), r"shape=\(2, 0\)"),
        ({}, torch.zeros(200), r"shape\[-1\]=200 .*reflect"),
        ({"center": False}, torch.zeros(399), r"shape\[-1\]=399 .*without centering"),
    ],
)
def test_bad_waveforms_raise_clear_errors(
    mel_kwargs: dict[str, object], waveform: torch.Tensor, fragment: str
) -> None:
    mel = MelSpectrogram(16000, n_mels=40, **mel_kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=fragment):
        mel(waveform)


def test_short_input_allowed_by_padding() -> None:
    mel = MelSpectrogram(16000, n_mels=40, center=False, pad=100)
    assert mel(_noise(200)).shape == (40, 1)
    assert MelSpectrogram(16000, n_mels=40)(_noise(201)).shape == (40, 2)


def test_functional_argument_errors() -> None:
    x = _noise(1000)
    with pytest.raises(InvalidRequestError, match="window"):
        spectrogram(x, 0, torch.hann_window(300), 400, 100, 400, 2.0, False)
    with pytest.raises(InvalidRequestError, match="f_max=100.0"):
        melscale_fbanks(201, 200.0, 100.0, 40, 16000)
    with pytest.raises(InvalidRequestError, match="n_freqs=0"):
        melscale_fbanks(0, 0.0, 8000.0, 40, 16000)
