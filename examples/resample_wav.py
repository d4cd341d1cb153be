"""Resample a WAV file with libkk.audio and print the shape of its mel spectrogram.

    python examples/resample_wav.py speech.wav --rate 16000 --out speech_16k.wav

Without a file it writes and uses a one-second 44.1 kHz stereo test tone. Reads 8/16/24/32-bit
PCM with the standard library's `wave`; the mel front-end is 25 ms windows every 10 ms, 80 mels.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import wave

import numpy as np
import torch

from libkk.audio import MelSpectrogram, Resample


def read_wav(path: str) -> tuple[torch.Tensor, int]:
    """Samples as float32 in [-1, 1), [channels, time], and the sample rate."""
    with wave.open(path, "rb") as f:
        rate, channels, width = f.getframerate(), f.getnchannels(), f.getsampwidth()
        raw = f.readframes(f.getnframes())
    if width == 1:  # unsigned 8-bit
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # little-endian 24-bit: widen to int32 via the top three bytes
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] << 8 | b[:, 1] << 16 | b[:, 2] << 24) >> 8
        samples = ints.astype(np.float32) / 2.0**23
    else:
        ints = np.frombuffer(raw, {2: "<i2", 4: "<i4"}[width])
        samples = ints.astype(np.float32) / 2.0 ** (8 * width - 1)
    return torch.from_numpy(samples.reshape(-1, channels).T.copy()), rate


def write_wav(path: str, waveform: torch.Tensor, rate: int) -> None:
    """16-bit PCM from float samples [channels, time]."""
    pcm = (waveform.clamp(-1.0, 1.0 - 2.0**-15) * 32768.0).round().to(torch.int16)
    with wave.open(path, "wb") as f:
        f.setnchannels(waveform.shape[0])
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.T.contiguous().numpy().astype("<i2").tobytes())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Resample a WAV file and compute mel frames.")
    parser.add_argument("wav", nargs="?", help="input WAV (default: a generated test tone)")
    parser.add_argument("--rate", type=int, default=16000, help="target sample rate in Hz")
    parser.add_argument("--out", help="write the resampled audio here as 16-bit PCM")
    args = parser.parse_args(argv)

    path = args.wav
    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            t = torch.arange(44100, dtype=torch.float64) / 44100
            tone = torch.stack([torch.sin(2 * math.pi * f * t) for f in (440, 660)])
            path = f"{tmp}/tone.wav"
            write_wav(path, 0.5 * tone.float(), 44100)
        waveform, rate = read_wav(path)
    print(f"input:     {path}: {waveform.shape[0]} ch x {waveform.shape[1]} samples at {rate} Hz")
    resampled = Resample(rate, args.rate)(waveform)
    print(f"resampled: {resampled.shape[0]} ch x {resampled.shape[1]} samples at {args.rate} Hz")
    if args.out:
        write_wav(args.out, resampled, args.rate)
        print(f"wrote:     {args.out}")

    mel = MelSpectrogram(args.rate, n_fft=args.rate // 40, hop_length=args.rate // 100, n_mels=80)
    frames = mel(resampled)  # [channels, n_mels, frames]
    print(f"mel frames: {tuple(frames.shape)} (channels, n_mels, frames)")


if __name__ == "__main__":
    main()
