"""libkk.audio against torchaudio itself, bit for bit, where torchaudio is importable."""

from __future__ import annotations

import math
import types
import warnings
from typing import Any

import pytest
import torch
from audio_cases import CASES, RATE_PAIRS, Case, mel_kwargs, noise, run_case

import libkk.audio

torchaudio = pytest.importorskip("torchaudio")

TA = types.SimpleNamespace(
    Resample=torchaudio.transforms.Resample,
    resample=torchaudio.functional.resample,
    MelSpectrogram=torchaudio.transforms.MelSpectrogram,
)
FULL_CASES = [c for c in CASES if c.full]


def _assert_equal(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (
        f"{name}: {ours.dtype}{tuple(ours.shape)} vs torchaudio {ref.dtype}{tuple(ref.shape)}"
    )
    if not torch.equal(ours, ref):
        diff = (ours.double() - ref.double()).abs().max().item()
        raise AssertionError(f"{name}: differs from torchaudio, max |diff| {diff:.3e}")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_recorded_cases_equal_torchaudio(case: Case) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, ref = run_case(case, libkk.audio), run_case(case, TA)
    assert ours.keys() == ref.keys()
    for key in ref:
        _assert_equal(f"{case.id}/{key}", ours[key], ref[key])


@pytest.mark.parametrize(("orig", "new"), RATE_PAIRS, ids=[f"{a}-{b}" for a, b in RATE_PAIRS])
def test_resample_all_pairs_lengths_channels(orig: int, new: int) -> None:
    ours_t, ref_t = libkk.audio.Resample(orig, new), TA.Resample(orig, new)
    _assert_equal("kernel", ours_t.kernel, ref_t.kernel)
    for channels in (1, 2):
        for length in (1, 37, 1000, orig + 13):
            x = noise(orig + new + length, (channels, length))
            tag = f"{channels}x{length}"
            _assert_equal(f"transform {tag}", ours_t(x), ref_t(x))
            _assert_equal(
                f"functional {tag}", libkk.audio.resample(x, orig, new), TA.resample(x, orig, new)
            )
    x64 = noise(7, (2, 999)).double()
    _assert_equal(
        "functional float64", libkk.audio.resample(x64, orig, new), TA.resample(x64, orig, new)
    )


@pytest.mark.parametrize("beta", [None, 6.0])
@pytest.mark.parametrize(("orig", "new"), [(44100, 16000), (16000, 44100), (48000, 22050)])
def test_kaiser_kernels_equal(orig: int, new: int, beta: float | None) -> None:
    kw: dict[str, Any] = {"resampling_method": "sinc_interp_kaiser", "beta": beta}
    _assert_equal(
        "kernel", libkk.audio.Resample(orig, new, **kw).kernel, TA.Resample(orig, new, **kw).kernel
    )
    _assert_equal(
        "kernel float64",
        libkk.audio.Resample(orig, new, dtype=torch.float64, **kw).kernel,
        TA.Resample(orig, new, dtype=torch.float64, **kw).kernel,
    )


def test_melscale_fbanks_equal() -> None:
    for n_freqs, f_min, f_max, n_mels, sr in [
        (201, 0.0, 8000.0, 80, 16000),
        (513, 30.0, 11025.0, 100, 22050),
    ]:
        for norm in (None, "slaney"):
            for scale in ("htk", "slaney"):
                args = (n_freqs, f_min, f_max, n_mels, sr, norm, scale)
                _assert_equal(
                    f"fbanks{args}",
                    libkk.audio.melscale_fbanks(*args),
                    torchaudio.functional.melscale_fbanks(*args),
                )


def test_spectrogram_functional_equal() -> None:
    x = noise(11, (3, 4000))
    window = torch.hann_window(320)
    for power in (None, 1.0, 2.0):
        for normalized in (False, True, "frame_length"):
            args = (x, 7, window, 512, 128, 320, power, normalized)
            _assert_equal(
                f"spectrogram power={power} normalized={normalized}",
                libkk.audio.spectrogram(*args),
                torchaudio.functional.spectrogram(*args),
            )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", FULL_CASES, ids=[c.id for c in FULL_CASES])
def test_cuda_equal_torchaudio(case: Case) -> None:
    x = case.input().cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.kind == "resample_transform":
            ours = libkk.audio.Resample(**case.params).cuda()(x)
            ref = TA.Resample(**case.params).cuda()(x)
        elif case.kind == "resample_functional":
            ours = libkk.audio.resample(x, **case.params)
            ref = TA.resample(x, **case.params)
        else:
            ours = libkk.audio.MelSpectrogram(**mel_kwargs(case.params)).cuda()(x)
            ref = TA.MelSpectrogram(**mel_kwargs(case.params)).cuda()(x)
    _assert_equal(case.id, ours, ref)
    assert math.isfinite(ours.double().sum().item())
