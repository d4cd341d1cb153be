"""Audio front-end: torchaudio-exact resampling and mel spectrograms in plain PyTorch.

Used whether or not torchaudio is installed; outputs equal torchaudio 2.x's bit for bit on the
same torch build and device.
"""

from __future__ import annotations

from libkk.audio.mel import MelSpectrogram, melscale_fbanks, spectrogram
from libkk.audio.resampling import Resample, resample

__all__ = ["MelSpectrogram", "Resample", "melscale_fbanks", "resample", "spectrogram"]
