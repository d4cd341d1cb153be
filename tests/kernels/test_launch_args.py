"""Launch arguments: programmatic dependent launch only where the hardware has it."""

from __future__ import annotations

import pytest
import torch
from libkk.kernels import _jit


def test_pdl_is_off_on_the_cpu():
    assert _jit.pdl_args(torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize(("major", "on"), [(8, False), (9, True), (10, True)])
def test_pdl_follows_the_compute_capability(monkeypatch, major, on):
    monkeypatch.setattr(_jit, "INTERPRETED", False)
    monkeypatch.setattr(_jit, "_major", lambda index: major)
    want = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
    assert _jit.pdl_args(torch.device("cuda", 0)) == want


def test_the_interpreter_never_gets_pdl(monkeypatch):
    monkeypatch.setattr(_jit, "INTERPRETED", True)
    monkeypatch.setattr(_jit, "_major", lambda index: 9)
    assert _jit.pdl_args(torch.device("cuda", 0)) == {"PDL": False}
