"""examples/resample_wav.py reads PCM WAV files, resamples them and prints the mel shape."""

from __future__ import annotations

import runpy
import wave
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "resample_wav.py"


@pytest.fixture(scope="module")
def example() -> dict[str, object]:
    return runpy.run_path(str(EXAMPLE), run_name="resample_wav_example")


def _write_pcm(path: Path, ints: np.ndarray, width: int, rate: int) -> None:
    """ints [time, channels] already in the sample width's range."""
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    else:
        raw = ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    with wave.open(str(path), "wb") as f:
        f.setnchannels(ints.shape[1])
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(raw)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_read_wav_decodes_each_sample_width(
    example: dict[str, object], tmp_path: Path, width: int
) -> None:
    full_scale = 2 ** (8 * width - 1)
    ints = np.array([[0, -full_scale], [full_scale // 2, full_scale - 1]], dtype=np.int64)
    path = tmp_path / f"w{width}.wav"
    _write_pcm(path, ints, width, 8000)
    waveform, rate = example["read_wav"](str(path))  # type: ignore[operator]
    assert rate == 8000 and waveform.shape == (2, 2)
    expected = ints.T / full_scale
    np.testing.assert_allclose(waveform.numpy(), expected, atol=1e-7)


def test_main_resamples_and_prints_mel_shape(
    example: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = np.arange(22050) / 22050
    ints = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 880 * t)], axis=1)
    src, out = tmp_path / "in.wav", tmp_path / "out.wav"
    _write_pcm(src, np.round(ints * 16000).astype(np.int64), 2, 22050)
    example["main"]([str(src), "--rate", "16000", "--out", str(out)])  # type: ignore[operator]
    printed = capsys.readouterr().out
    assert "2 ch x 16000 samples at 16000 Hz" in printed
    assert "mel frames: (2, 80, 101)" in printed
    with wave.open(str(out), "rb") as f:
        assert (f.getframerate(), f.getnchannels(), f.getnframes()) == (16000, 2, 16000)


def test_main_runs_without_a_file(
    example: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    example["main"]([])  # type: ignore[operator]
    assert "mel frames: (2, 80, 101)" in capsys.readouterr().out
