"""Cases shared by the torchaudio reference recorder and the tests that check against it.

Depends on torch and numpy only (not on libkk, not on torchaudio), so the recorder runs on any
machine that has torchaudio. Inputs are regenerated, never stored: a splitmix64 stream of 24-bit
integers scaled by a power of two gives float32 samples that are exact on every platform and
every torch version.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

RATES = (8000, 11025, 16000, 22050, 24000, 44100, 48000)
RATE_PAIRS = tuple((a, b) for a, b in itertools.permutations(RATES, 2))

SHORT_LENGTH = 997  # prime: exercises the ceil() truncation for every rate pair
# A summary keeps this many samples (resample) or whole frames (mel) at each end and the middle.
EDGE = 64
MEL_EDGE_FRAMES = 4

# One splitmix64 constant set (Steele et al.); only reproducibility matters here.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def noise(seed: int, shape: tuple[int, ...], scale_log2: int = -1) -> torch.Tensor:
    """Deterministic float32 noise in [-2**scale_log2, 2**scale_log2) with 24-bit resolution."""
    count = int(np.prod(shape))
    with np.errstate(over="ignore"):
        # counter (seed << 32) + i: streams of different seeds never overlap
        counter = (np.uint64(seed) << np.uint64(32)) + np.arange(1, count + 1, dtype=np.uint64)
        z = counter * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    top24 = (z >> np.uint64(40)).astype(np.int64) - (1 << 23)  # [-2**23, 2**23)
    values = np.ldexp(top24.astype(np.float64), scale_log2 - 23)  # exact in float32
    return torch.from_numpy(values.astype(np.float32)).reshape(shape)


@dataclass(frozen=True)
class Case:
    """One recorded computation: `kind` picks the API call, `params` its arguments."""

    id: str
    kind: str  # "resample_transform" | "resample_functional" | "mel"
    params: dict[str, Any]
    shape: tuple[int, ...]  # input shape [..., time]
    seed: int
    dtype: str = "float32"
    full: bool = True  # store the whole output, else a summary (edges, middle, float64 sums)
    extra: dict[str, Any] = field(default_factory=dict)

    def input(self) -> torch.Tensor:
        return noise(self.seed, self.shape).to(getattr(torch, self.dtype))

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "params": self.params,
            "shape": list(self.shape),
            "seed": self.seed,
            "dtype": self.dtype,
            "full": self.full,
        }


WINDOWS: dict[str, Callable[..., torch.Tensor]] = {
    "hann": torch.hann_window,
    "hamming": torch.hamming_window,
}

# MelSpectrogram settings: torchaudio's defaults and the front-ends of common speech models.
MEL_CONFIGS: dict[str, dict[str, Any]] = {
    "default-16k": {"sample_rate": 16000},
    "speech-16k-80": {"sample_rate": 16000, "n_fft": 400, "hop_length": 160, "n_mels": 80},
    "speech-16k-128": {"sample_rate": 16000, "n_fft": 400, "hop_length": 160, "n_mels": 128},
    "vocoder-24k": {
        "sample_rate": 24000,
        "n_fft": 1024,
        "hop_length": 256,
        "n_mels": 100,
        "power": 1.0,
    },
    "vocoder-22k-slaney": {
        "sample_rate": 22050,
        "n_fft": 1024,
        "win_length": 1024,
        "hop_length": 256,
        "n_mels": 80,
        "f_min": 0.0,
        "f_max": 8000.0,
        "norm": "slaney",
        "mel_scale": "slaney",
        "center": False,
        "power": 1.0,
    },
    "kaldi-like-16k": {
        "sample_rate": 16000,
        "n_fft": 512,
        "win_length": 400,
        "hop_length": 160,
        "n_mels": 80,
        "f_min": 20.0,
        "f_max": 7600.0,
        "window": "hamming",
    },
    "wide-44k-window-norm": {
        "sample_rate": 44100,
        "n_fft": 2048,
        "hop_length": 512,
        "pad": 100,
        "normalized": True,
        "pad_mode": "constant",
        "n_mels": 64,
        "norm": "slaney",
    },
    "narrow-8k-frame-norm": {
        "sample_rate": 8000,
        "n_fft": 256,
        "hop_length": 80,
        "n_mels": 40,
        "normalized": "frame_length",
        "pad_mode": "replicate",
        "power": 1.5,
        "mel_scale": "slaney",
    },
}


def _resample_cases() -> list[Case]:
    cases: list[Case] = []
    for i, (a, b) in enumerate(RATE_PAIRS):
        params = {"orig_freq": a, "new_freq": b}
        cases.append(
            Case(
                f"rs-t/{a}-{b}/stereo-short",
                "resample_transform",
                params,
                (2, SHORT_LENGTH),
                seed=1000 + i,
            )
        )
        cases.append(
            Case(
                f"rs-t/{a}-{b}/mono-1s",
                "resample_transform",
                params,
                (1, a),
                seed=2000 + i,
                full=False,
            )
        )
    functional = [
        ((44100, 16000), {}, "float32"),
        ((48000, 24000), {}, "float32"),
        ((8000, 22050), {}, "float32"),
        ((22050, 16000), {}, "float64"),
        ((16000, 44100), {}, "float64"),
        ((44100, 16000), {"resampling_method": "sinc_interp_kaiser"}, "float32"),
        ((16000, 48000), {"resampling_method": "sinc_interp_kaiser", "beta": 8.555}, "float64"),
        ((24000, 16000), {"lowpass_filter_width": 16, "rolloff": 0.85}, "float32"),
    ]
    for i, ((a, b), kw, dtype) in enumerate(functional):
        tag = "-".join(f"{k}={v}" for k, v in kw.items()) or "default"
        cases.append(
            Case(
                f"rs-f/{a}-{b}/{tag}/{dtype}",
                "resample_functional",
                {"orig_freq": a, "new_freq": b, **kw},
                (2, 2000),
                seed=3000 + i,
                dtype=dtype,
            )
        )
    transform_variants = [
        ((44100, 16000), {"resampling_method": "sinc_interp_kaiser"}),
        ((11025, 48000), {"resampling_method": "sinc_interp_kaiser", "beta": 5.0}),
        ((48000, 16000), {"lowpass_filter_width": 24, "rolloff": 0.945}),
    ]
    for i, ((a, b), kw) in enumerate(transform_variants):
        tag = "-".join(f"{k}={v}" for k, v in kw.items())
        cases.append(
            Case(
                f"rs-t/{a}-{b}/{tag}",
                "resample_transform",
                {"orig_freq": a, "new_freq": b, **kw},
                (2, 3, 700),
                seed=4000 + i,
            )
        )
    return cases


def _mel_cases() -> list[Case]:
    cases: list[Case] = []
    for i, (name, cfg) in enumerate(MEL_CONFIGS.items()):
        sr = cfg["sample_rate"]
        cases.append(Case(f"mel/{name}/stereo-short", "mel", cfg, (2, sr * 3 // 10), seed=5000 + i))
        cases.append(
            Case(f"mel/{name}/mono-3s", "mel", cfg, (1, 3 * sr), seed=6000 + i, full=False)
        )
    return cases


CASES: tuple[Case, ...] = tuple(_resample_cases() + _mel_cases())


def mel_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """MelSpectrogram keyword arguments for a config (the window name becomes window_fn)."""
    kwargs = {k: v for k, v in params.items() if k != "window"}
    kwargs["window_fn"] = WINDOWS[params.get("window", "hann")]
    return kwargs


def run_case(case: Case, api: Any) -> dict[str, torch.Tensor]:
    """Runs `case` with `api` (torchaudio-like: .Resample, .resample, .MelSpectrogram).

    Returns the output and the built constant (resample kernel or mel filterbank) when the case
    goes through a transform.
    """
    x = case.input()
    if case.kind == "resample_transform":
        module = api.Resample(**case.params)
        return {"out": module(x), "kernel": module.kernel}
    if case.kind == "resample_functional":
        return {"out": api.resample(x, **case.params)}
    if case.kind == "mel":
        module = api.MelSpectrogram(**mel_kwargs(case.params))
        return {"out": module(x), "fb": module.mel_scale.fb}
    raise ValueError(f"unknown case kind {case.kind!r}")


def record(case: Case, results: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What is kept of one case's results, keyed `<case id>/<name>`."""
    kept: dict[str, torch.Tensor] = {}
    out = results["out"].detach().cpu()
    if case.full:
        kept["out"] = out
    else:
        kept.update(summarize(out, case.kind))
    # The transform's constants are the same for every input: kept with the full-output case.
    if "kernel" in results and case.full:
        kernel = results["kernel"].detach().cpu()  # [new, 1, taps]
        kept["kernel_first"] = kernel[0, 0]
        kept["kernel_last"] = kernel[-1, 0]
        kept["kernel_sum"] = kernel.double().sum().reshape(1)
    if "fb" in results and case.full:
        kept.update(sparse_fb(results["fb"].detach().cpu()))
    # clone: kept tensors must not share storage (safetensors refuses aliases)
    return {f"{case.id}/{k}": v.clone().contiguous() for k, v in kept.items()}


def sparse_fb(fb: torch.Tensor) -> dict[str, torch.Tensor]:
    """A mel filterbank [n_freqs, n_mels] as its nonzero entries (most of it is zero)."""
    flat = fb.reshape(-1)
    index = torch.nonzero(flat).reshape(-1)
    return {
        "fb_shape": torch.tensor(fb.shape, dtype=torch.int64),
        "fb_index": index.to(torch.int32),
        "fb_value": flat[index],
    }


def dense_fb(shape: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Inverse of `sparse_fb`."""
    flat = torch.zeros(int(shape.prod()), dtype=value.dtype)
    flat[index.long()] = value
    return flat.reshape(shape.tolist())


def summarize(out: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """Edges and middle of a long output plus float64 sums and its shape."""
    n = MEL_EDGE_FRAMES if kind == "mel" else EDGE  # along [..., n_mels, frames] or [..., time]
    size = out.shape[-1]
    mid = size // 2
    return {
        "head": out[..., :n],
        "mid": out[..., mid - n // 2 : mid + n // 2],
        "tail": out[..., size - n :],
        "sum": out.double().sum().reshape(1),
        "sumsq": out.double().square().sum().reshape(1),
        "shape": torch.tensor(out.shape, dtype=torch.int64),
    }
