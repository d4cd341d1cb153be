"""STFT power spectrogram and mel filterbank, bit-for-bit with torchaudio 2.x.

The filterbank is built in float32 on the CPU from the same expressions as torchaudio's
`melscale_fbanks` (linspace of STFT bin frequencies, linspace of mel points, triangular slopes),
and the mel product is `(spec^T @ fb)^T`, the order torchaudio uses, because a different
association of the same product changes the last bits.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from libkk.audio._checks import as_float, as_int, as_rate, bad, check_waveform, one_of
from libkk.errors import InvalidRequestError

MEL_SCALES = ("htk", "slaney")
FBANK_NORMS = (None, "slaney")
PAD_MODES = ("reflect", "constant", "replicate", "circular")
SPEC_NORMS = (False, True, "window", "frame_length")

# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
_SLANEY_F_SP = 200.0 / 3
_SLANEY_MIN_LOG_HZ = 1000.0
_SLANEY_MIN_LOG_MEL = (_SLANEY_MIN_LOG_HZ - 0.0) / _SLANEY_F_SP
_SLANEY_LOGSTEP = math.log(6.4) / 27.0


def hz_to_mel(freq: float, mel_scale: str = "htk") -> float:
    """One frequency in Hz to mels (python float math, as torchaudio)."""
    one_of("hz_to_mel.mel_scale", mel_scale, MEL_SCALES)
    if mel_scale == "htk":
        return 2595.0 * math.log10(1.0 + (freq / 700.0))
    if freq >= _SLANEY_MIN_LOG_HZ:
        return _SLANEY_MIN_LOG_MEL + math.log(freq / _SLANEY_MIN_LOG_HZ) / _SLANEY_LOGSTEP
    return (freq - 0.0) / _SLANEY_F_SP


def mel_to_hz(mels: torch.Tensor, mel_scale: str = "htk") -> torch.Tensor:
    """Mels to Hz, elementwise in the tensor's dtype (the inverse of `hz_to_mel`)."""
    one_of("mel_to_hz.mel_scale", mel_scale, MEL_SCALES)
    if mel_scale == "htk":
        return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    freqs = 0.0 + _SLANEY_F_SP * mels
    log_part = mels >= _SLANEY_MIN_LOG_MEL
    freqs[log_part] = _SLANEY_MIN_LOG_HZ * torch.exp(
        _SLANEY_LOGSTEP * (mels[log_part] - _SLANEY_MIN_LOG_MEL)
    )
    return freqs


def _triangular_filterbank(all_freqs: torch.Tensor, f_pts: torch.Tensor) -> torch.Tensor:
    """[n_freqs, n_filters] triangles with corners at consecutive points of `f_pts`."""
    f_diff = f_pts[1:] - f_pts[:-1]  # [n_filters + 1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)  # [n_freqs, n_filters + 2]
    down_slopes = (-1.0 * slopes[:, :-2]) / f_diff[:-1]  # [n_freqs, n_filters]
    up_slopes = slopes[:, 2:] / f_diff[1:]  # [n_freqs, n_filters]
    return torch.max(torch.zeros(1), torch.min(down_slopes, up_slopes))


def melscale_fbanks(
    n_freqs: int,
    f_min: float,
    f_max: float,
    n_mels: int,
    sample_rate: int,
    norm: str | None = None,
    mel_scale: str = "htk",
) -> torch.Tensor:
    """Mel filterbank [n_freqs, n_mels] (float32, CPU): `spec[..., n_freqs] @ fb` gives mels.

    STFT bins are taken at linspace(0, sample_rate // 2, n_freqs) and the n_mels + 2 filter
    corners evenly in mel between f_min and f_max. norm="slaney" divides each triangle by its
    width in Hz (constant area). Warns, as torchaudio does, when a filter is all zeros.
    """
    n_freqs = as_int("melscale_fbanks.n_freqs", n_freqs, 1)
    n_mels = as_int("melscale_fbanks.n_mels", n_mels, 1)
    sample_rate = as_rate("melscale_fbanks.sample_rate", sample_rate)
    f_min = as_float("melscale_fbanks.f_min", f_min)
    f_max = as_float("melscale_fbanks.f_max", f_max)
    if f_min < 0.0:
        bad("melscale_fbanks.f_min", f_min, "a frequency >= 0 Hz")
    if not f_max > f_min:
        bad("melscale_fbanks.f_max", f_max, f"a frequency above f_min ({f_min} Hz)")
    one_of("melscale_fbanks.norm", norm, FBANK_NORMS)
    one_of("melscale_fbanks.mel_scale", mel_scale, MEL_SCALES)

    with torch.inference_mode(False), torch.no_grad():
        all_freqs = torch.linspace(0, sample_rate // 2, n_freqs)
        m_min = hz_to_mel(f_min, mel_scale=mel_scale)
        m_max = hz_to_mel(f_max, mel_scale=mel_scale)
        m_pts = torch.linspace(m_min, m_max, n_mels + 2)
        f_pts = mel_to_hz(m_pts, mel_scale=mel_scale)
        fb = _triangular_filterbank(all_freqs, f_pts)
        if norm == "slaney":
            enorm = 2.0 / (f_pts[2 : n_mels + 2] - f_pts[:n_mels])
            fb = fb * enorm.unsqueeze(0)

    if (fb.max(dim=0).values == 0.0).any():
        warnings.warn(
            f"melscale_fbanks: at least one mel filter is all zeros; n_mels={n_mels} may be too "
            f"high for n_freqs={n_freqs}",
            stacklevel=2,
        )
    return fb


def _spec_norms(normalized: bool | str) -> tuple[bool, bool]:
    """(normalize inside torch.stft by sqrt(frame length), divide by the window's L2 norm)."""
    if normalized == "frame_length":
        return True, False
    return False, normalized is True or normalized == "window"


def _check_length(where: str, length: int, n_fft: int, center: bool, pad_mode: str) -> None:
    if not center:
        need, why = n_fft, "n_fft samples for one frame without centering"
    elif pad_mode == "reflect":
        need, why = n_fft // 2 + 1, "more than n_fft // 2 samples for reflect padding"
    elif pad_mode == "circular":
        need, why = n_fft // 2, "at least n_fft // 2 samples for circular padding"
    else:
        return
    if length < need:
        raise InvalidRequestError(
            f"{where}.shape[-1]={length} (after `pad`) is too short: expected {why} (>= {need})"
        )


def _stft_spectrogram(
    waveform: torch.Tensor,
    pad: int,
    window: torch.Tensor,
    n_fft: int,
    hop_length: int,
    win_length: int,
    power: float | None,
    normalized: bool | str,
    center: bool,
    pad_mode: str,
    onesided: bool,
) -> torch.Tensor:
    if pad > 0:
        waveform = F.pad(waveform, (pad, pad), "constant")
    frame_length_norm, window_norm = _spec_norms(normalized)
    if window.dtype != waveform.dtype or window.device != waveform.device:
        window = window.to(device=waveform.device, dtype=waveform.dtype)
    shape = waveform.shape
    spec = torch.stft(
        waveform.reshape(-1, shape[-1]),
        n_fft=n_fft,
        hop_length=hop_length,
        win_length=win_length,
        window=window,
        center=center,
        pad_mode=pad_mode,
        normalized=frame_length_norm,
        onesided=onesided,
        return_complex=True,
    )  # [batch, freq, frames]
    spec = spec.reshape(shape[:-1] + spec.shape[-2:])
    if window_norm:
        spec = spec / window.pow(2.0).sum().sqrt()
    if power is None:
        return spec
    if power == 1.0:
        return spec.abs()
    return spec.abs().pow(power)


def _check_stft_args(
    where: str,
    pad: Any,
    n_fft: Any,
    hop_length: Any,
    win_length: Any,
    power: Any,
    normalized: Any,
    pad_mode: Any,
) -> None:
    as_int(f"{where}.pad", pad, 0)
    as_int(f"{where}.n_fft", n_fft, 1)
    as_int(f"{where}.hop_length", hop_length, 1)
    as_int(f"{where}.win_length", win_length, 1)
    if win_length > n_fft:
        bad(f"{where}.win_length", win_length, f"at most n_fft ({n_fft})")
    if power is not None and not as_float(f"{where}.power", power) > 0:
        bad(f"{where}.power", power, "a positive exponent, or None for the complex STFT")
    if not any(normalized is c or (isinstance(c, str) and normalized == c) for c in SPEC_NORMS):
        bad(f"{where}.normalized", normalized, "False, True, 'window' or 'frame_length'")
    one_of(f"{where}.pad_mode", pad_mode, PAD_MODES)


def spectrogram(
    waveform: torch.Tensor,
    pad: int,
    window: torch.Tensor,
    n_fft: int,
    hop_length: int,
    win_length: int,
    power: float | None,
    normalized: bool | str,
    center: bool = True,
    pad_mode: str = "reflect",
    onesided: bool = True,
) -> torch.Tensor:
    """Spectrogram [..., freq, frames] of `waveform` [..., time] (torchaudio's functional).

    power None returns the complex STFT; 1 the magnitude; 2 the power. normalized True or
    "window" divides by the window's L2 norm, "frame_length" asks torch.stft to normalize.
    """
    check_waveform("spectrogram.waveform", waveform)
    _check_stft_args("spectrogram", pad, n_fft, hop_length, win_length, power, normalized, pad_mode)
    if not isinstance(window, torch.Tensor) or window.shape != (win_length,):
        got = tuple(window.shape) if isinstance(window, torch.Tensor) else type(window).__name__
        bad("spectrogram.window", got, f"a 1-D tensor of win_length ({win_length}) values")
    _check_length("spectrogram.waveform", waveform.shape[-1] + 2 * pad, n_fft, center, pad_mode)
    return _stft_spectrogram(
        waveform,
        pad,
        window,
        n_fft,
        hop_length,
        win_length,
        power,
        normalized,
        center,
        pad_mode,
        onesided,
    )


class Spectrogram(torch.nn.Module):
    """Power spectrogram with a stored window; the `spectrogram` submodule of `MelSpectrogram`."""

    window: torch.Tensor

    def __init__(
        self,
        n_fft: int,
        win_length: int,
        hop_length: int,
        pad: int,
        window: torch.Tensor,
        power: float,
        normalized: bool | str,
        center: bool,
        pad_mode: str,
    ) -> None:
        super().__init__()
        self.n_fft = n_fft
        self.win_length = win_length
        self.hop_length = hop_length
        self.pad = pad
        self.power = power
        self.normalized = normalized
        self.center = center
        self.pad_mode = pad_mode
        self.register_buffer("window", window)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        return _stft_spectrogram(
            waveform,
            self.pad,
            self.window,
            self.n_fft,
            self.hop_length,
            self.win_length,
            self.power,
            self.normalized,
            self.center,
            self.pad_mode,
            True,
        )


class MelScale(torch.nn.Module):
    """Applies a mel filterbank to [..., freq, frames]; the `mel_scale` submodule."""

    fb: torch.Tensor

    def __init__(self, fb: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("fb", fb)  # [n_freqs, n_mels]

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        fb = self.fb
        if fb.dtype != spec.dtype or fb.device != spec.device:
            fb = fb.to(device=spec.device, dtype=spec.dtype)
        # [..., frames, freq] @ [freq, n_mels] -> [..., n_mels, frames]
        return torch.matmul(spec.transpose(-1, -2), fb).transpose(-1, -2)


class MelSpectrogram(torch.nn.Module):
    """Mel spectrogram [..., n_mels, frames] of [..., time] waveforms (torchaudio's transform).

    Defaults: win_length = n_fft, hop_length = win_length // 2, f_max = sample_rate // 2,
    periodic Hann window, power 2, centered reflect-padded onesided STFT, HTK mel scale without
    filter normalization, no log. Buffers sit at `spectrogram.window` and `mel_scale.fb`, the
    same state_dict keys as torchaudio.
    """

    def __init__(
        self,
        sample_rate: int,
        n_fft: int = 400,
        win_length: int | None = None,
        hop_length: int | None = None,
        f_min: float = 0.0,
        f_max: float | None = None,
        pad: int = 0,
        n_mels: int = 128,
        window_fn: Callable[..., torch.Tensor] = torch.hann_window,
        power: float = 2.0,
        normalized: bool | str = False,
        center: bool = True,
        pad_mode: str = "reflect",
        norm: str | None = None,
        mel_scale: str = "htk",
        *,
        wkwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        where = "MelSpectrogram"
        self.sample_rate = as_rate(f"{where}.sample_rate", sample_rate)
        self.n_fft = as_int(f"{where}.n_fft", n_fft, 1)
        self.win_length = self.n_fft if win_length is None else win_length
        self.hop_length = self.win_length // 2 if hop_length is None else hop_length
        if power is None:
            bad(f"{where}.power", power, "a positive exponent (a mel spectrogram is real)")
        _check_stft_args(
            where, pad, self.n_fft, self.hop_length, self.win_length, power, normalized, pad_mode
        )
        if not isinstance(center, bool):
            bad(f"{where}.center", center, "True or False")
        self.pad = pad
        self.power = float(power)
        self.normalized = normalized
        self.center = center
        self.pad_mode = pad_mode
        self.n_mels = as_int(f"{where}.n_mels", n_mels, 1)
        self.f_min = as_float(f"{where}.f_min", f_min)
        self.f_max = f_max
        fb_f_max = (
            float(self.sample_rate // 2) if f_max is None else as_float(f"{where}.f_max", f_max)
        )
        if not 0.0 <= self.f_min < fb_f_max:
            bad(f"{where}.f_min", f_min, f"0 <= f_min < f_max ({fb_f_max} Hz)")
        one_of(f"{where}.norm", norm, FBANK_NORMS)
        one_of(f"{where}.mel_scale", mel_scale, MEL_SCALES)
        self.norm = norm
        self.mel_scale_name = mel_scale

        window = window_fn(self.win_length, **(wkwargs or {}))
        if not isinstance(window, torch.Tensor) or window.shape != (self.win_length,):
            bad(
                f"{where}.window_fn",
                window_fn,
                f"a function returning a 1-D tensor of win_length ({self.win_length}) values",
            )
        self.spectrogram = Spectrogram(
            self.n_fft,
            self.win_length,
            self.hop_length,
            self.pad,
            window,
            self.power,
            normalized,
            center,
            pad_mode,
        )
        fb = melscale_fbanks(
            self.n_fft // 2 + 1,
            self.f_min,
            fb_f_max,
            self.n_mels,
            self.sample_rate,
            norm,
            mel_scale,
        )
        self.mel_scale = MelScale(fb)

    @property
    def fb(self) -> torch.Tensor:
        """The mel filterbank [n_fft // 2 + 1, n_mels]."""
        return self.mel_scale.fb

    def num_frames(self, length: int) -> int:
        """Number of output frames for `length` input samples."""
        padded = length + 2 * self.pad
        if self.center:
            padded += 2 * (self.n_fft // 2)
        return (padded - self.n_fft) // self.hop_length + 1

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        check_waveform("MelSpectrogram.waveform", waveform)
        _check_length(
            "MelSpectrogram.waveform",
            waveform.shape[-1] + 2 * self.pad,
            self.n_fft,
            self.center,
            self.pad_mode,
        )
        return self.mel_scale(self.spectrogram(waveform))
