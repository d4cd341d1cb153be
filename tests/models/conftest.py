from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model, converted once into the user cache and shared by every test."""
    from libkk.errors import MissingDependencyError
    from libkk.models.default import default_model_path

    try:
        return default_model_path(progress=False)
    except MissingDependencyError as exc:
        pytest.skip(str(exc))
