"""Records torchaudio's outputs for the cases in audio_cases.py, for CI machines without it.

Run from the repository root where torchaudio is importable:

    python tests/audio/record_torchaudio_reference.py

It writes tests/audio/torchaudio_reference.safetensors (the tensors, keyed `<case id>/<name>`)
and tests/audio/torchaudio_reference.json (the case list, torch/torchaudio versions, CPU
capability). Everything runs on the CPU, as CI does. Inputs are regenerated from seeds, so only
outputs are stored: whole outputs for short signals, edges, middle and float64 sums for long ones.
Needs torch, numpy, safetensors and torchaudio; it does not import libkk.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import types
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import audio_cases  # noqa: E402

REFERENCE_STEM = "torchaudio_reference"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE, help="where to write the two files")
    args = parser.parse_args(argv)

    try:
        import torchaudio
        from safetensors.torch import save_file
    except ImportError as exc:
        print(f"cannot record: {exc} (needs torchaudio and safetensors)", file=sys.stderr)
        return 2

    api = types.SimpleNamespace(
        Resample=torchaudio.transforms.Resample,
        resample=torchaudio.functional.resample,
        MelSpectrogram=torchaudio.transforms.MelSpectrogram,
    )
    tensors: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # torchaudio warns about empty mel filters for its own default settings
        warnings.simplefilter("ignore")
        with torch.inference_mode():
            for case in audio_cases.CASES:
                tensors.update(audio_cases.record(case, audio_cases.run_case(case, api)))

    versions = {
        "torch": torch.__version__,
        "torchaudio": torchaudio.__version__,
        "numpy": audio_cases.np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tensor_path = args.out_dir / f"{REFERENCE_STEM}.safetensors"
    json_path = args.out_dir / f"{REFERENCE_STEM}.json"
    save_file(tensors, str(tensor_path), metadata=versions)
    # One case per line keeps the checked-in file short and its diffs readable.
    cases = ",\n".join("  " + json.dumps(case.describe()) for case in audio_cases.CASES)
    json_path.write_text(
        f'{{\n "recorded_with": {json.dumps(versions)},\n "device": "cpu",\n'
        f' "cases": [\n{cases}\n ]\n}}\n'
    )
    size = tensor_path.stat().st_size
    print(f"wrote {len(audio_cases.CASES)} cases, {len(tensors)} tensors, {size / 1e6:.2f} MB")
    print(f"  {tensor_path}\n  {json_path}\n  {versions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
