"""Kernel tests run the Triton ops on CUDA, or on CPU under Triton's interpreter.

Triton picks the interpreter only for functions decorated while TRITON_INTERPRET=1 is set, and its
own library functions are decorated when triton is first imported. This conftest sets the
variable as early as it can; if something imported triton before (a whole-suite run where an
earlier test module pulled it in), `test_interpreter_process.py` reruns the kernel tests in a
fresh process instead, started here once the suite is collected so that it runs beside the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
RERUN_TEST = "test_kernel_tests_in_interpreter_process"
RERUN_TIMEOUT_S = 900


def needs_interpreter_rerun() -> bool:
    from libkk.kernels._jit import INTERPRETED

    return not torch.cuda.is_available() and not INTERPRETED


@dataclass
class _Rerun:
    process: subprocess.Popen
    log: tempfile._TemporaryFileWrapper

    def wait(self) -> tuple[int, str]:
        """(exit status, output) once the rerun ends."""
        self.process.wait(timeout=RERUN_TIMEOUT_S)
        self.log.seek(0)
        return self.process.returncode, self.log.read()


def _start_rerun() -> _Rerun:
    # One thread: the rerun shares the machine with the rest of the suite.
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
    cmd += [
        str(p) for p in sorted(HERE.glob("test_*.py")) if p.name != "test_interpreter_process.py"
    ]
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        cmd, cwd=HERE.parents[1], env=env, stdout=log, stderr=subprocess.STDOUT, text=True
    )
    return _Rerun(process, log)


_RERUN = pytest.StashKey[_Rerun]()


def _rerun(config: pytest.Config) -> _Rerun:
    if _RERUN not in config.stash:
        config.stash[_RERUN] = _start_rerun()
    return config.stash[_RERUN]


@pytest.fixture
def interpreter_rerun(request: pytest.FixtureRequest) -> _Rerun:
    """The rerun of the kernel tests in a fresh process (started now if collection did not)."""
    if not needs_interpreter_rerun():
        pytest.skip("the kernel tests run in this process")
    return _rerun(request.config)


def pytest_collection_finish(session: pytest.Session) -> None:
    if needs_interpreter_rerun() and any(item.name == RERUN_TEST for item in session.items):
        _rerun(session.config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    rerun = session.config.stash.get(_RERUN, None)
    if rerun is not None and rerun.process.poll() is None:  # the waiting test did not run
        rerun.process.kill()
        rerun.process.wait()
