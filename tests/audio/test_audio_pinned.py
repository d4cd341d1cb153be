"""libkk.audio against torchaudio outputs recorded by record_torchaudio_reference.py.

For CI machines without torchaudio. Skips (does not fail) while the reference files are absent.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from audio_cases import CASES, Case, dense_fb, record, run_case

import libkk.audio

HERE = Path(__file__).resolve().parent
TENSORS = HERE / "torchaudio_reference.safetensors"
MANIFEST = HERE / "torchaudio_reference.json"
RECORD_COMMAND = "python tests/audio/record_torchaudio_reference.py"

# With the torch build and CPU capability that recorded the references, every value must be
# bit-identical (torch.equal). Another torch build may round float32 conv1d, FFT and elementwise
# math differently in the last bits, so there each value must lie within PINNED_ULPS epsilons of
# its dtype times the tensor's scale: its largest magnitude, or for a sum sqrt(N * sum of squares).
# Measured, torch 2.13 CPU against the torch 2.11 CPU recording (both AVX512), max |diff| / scale:
# resample outputs 7.9e-7 (float32) and 2.3e-16 (float64), mel outputs 7.0e-7, mel filterbanks
# 1.7e-6 (one element off by one ulp), output sums 7.1e-8, kernel sums 1.9e-16: at most 15
# epsilons. A real error (a wrong tap, phase or filter edge) is off by 1e-3 or more.
PINNED_ULPS = 64
# Kernels built in float64 and stored as float32 came out identical across builds: kept exact.
EXACT_ACROSS_BUILDS = ("kernel_first", "kernel_last")


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], dict[str, torch.Tensor], bool]:
    if not (TENSORS.exists() and MANIFEST.exists()):
        pytest.skip(
            f"{TENSORS.name} / {MANIFEST.name} not recorded yet: run `{RECORD_COMMAND}` "
            "where torchaudio is importable and check both files in"
        )
    from safetensors.torch import load_file

    manifest = json.loads(MANIFEST.read_text())
    recorded = manifest["recorded_with"]
    same_build = (recorded["torch"], recorded["cpu_capability"]) == (
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
    )
    return {c["id"]: c for c in manifest["cases"]}, load_file(str(TENSORS)), same_build


def _data_dtype(key: str, tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype of the values behind `key` (float64 sums summarize float32 data)."""
    stem, name = key.rsplit("/", 1)
    source = {"sum": "head", "sumsq": "head", "kernel_sum": "kernel_first"}.get(name)
    return tensors[f"{stem}/{source}"].dtype if source else tensors[key].dtype


def _scale(key: str, tensors: dict[str, torch.Tensor]) -> float:
    ref = tensors[key].double()
    stem, name = key.rsplit("/", 1)
    if name == "sum":  # of a signed signal: cancellation makes |sum| itself no scale
        count = int(tensors[f"{stem}/shape"].prod())
        return math.sqrt(count * tensors[f"{stem}/sumsq"].item())
    return ref.abs().max().item()


def _check(key: str, ours: torch.Tensor, tensors: dict[str, torch.Tensor], exact: bool) -> None:
    ref = tensors[key]
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (
        f"{key}: ours {ours.dtype}{tuple(ours.shape)} vs recorded {ref.dtype}{tuple(ref.shape)}"
    )
    if torch.equal(ours, ref):
        return
    diff = (ours.double() - ref.double()).abs().max().item()
    if exact or not ours.is_floating_point():
        raise AssertionError(
            f"{key}: differs from the recorded torchaudio value (max |diff| {diff:.3e})"
        )
    bound = PINNED_ULPS * torch.finfo(_data_dtype(key, tensors)).eps * _scale(key, tensors)
    assert diff <= bound, (
        f"{key}: max |diff| {diff:.3e} exceeds {PINNED_ULPS} ulps of scale ({bound:.3e})"
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_recorded_torchaudio(
    case: Case, reference: tuple[dict[str, Any], dict[str, torch.Tensor], bool]
) -> None:
    manifest, tensors, same_build = reference
    if case.id not in manifest:
        pytest.skip(f"{case.id} was added after the references were recorded: re-run the recorder")
    assert manifest[case.id] == case.describe(), (
        f"{case.id} changed since it was recorded: re-run `{RECORD_COMMAND}`"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the all-zero mel filter warning of some settings
        ours = record(case, run_case(case, libkk.audio))

    prefix = f"{case.id}/"
    if f"{prefix}fb_value" in tensors:
        parts = ("shape", "index", "value")
        tensors = {**tensors, f"{prefix}fb": dense_fb(*(tensors[f"{prefix}fb_{k}"] for k in parts))}
        ours[f"{prefix}fb"] = dense_fb(*(ours[f"{prefix}fb_{k}"] for k in parts))
    for key in tensors:
        if key.startswith(prefix) and not key.startswith(f"{prefix}fb_"):
            assert key in ours, f"{key} recorded but not produced"
            exact = same_build or key.rsplit("/", 1)[1] in EXACT_ACROSS_BUILDS
            _check(key, ours[key], tensors, exact)
