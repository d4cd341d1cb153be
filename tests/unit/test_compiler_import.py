"""compiler_imported_alongside: torch.compile's stack imported on a thread during a block."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from libkk.graphs import compile as compile_mod


def test_the_block_ends_with_the_compiler_imported():
    # A fresh interpreter: this one may have imported Dynamo already.
    code = (
        "import sys, threading\n"
        "from libkk.graphs.compile import compiler_imported_alongside\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "with compiler_imported_alongside():\n"
        "    assert any(t.name == 'libkk-compiler-import' for t in threading.enumerate())\n"
        "assert 'torch._dynamo' in sys.modules and 'torch._inductor.compile_fx' in sys.modules\n"
        "assert not any(t.name == 'libkk-compiler-import' for t in threading.enumerate())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_failed_import_is_left_to_the_compile(monkeypatch):
    monkeypatch.setattr(compile_mod, "_COMPILER_MODULES", ("libkk_no_such_module",))
    with compile_mod.compiler_imported_alongside():
        pass  # no error here: the first compile that needs the module raises it


def test_an_error_in_the_block_still_waits_for_the_thread(monkeypatch):
    monkeypatch.setattr(compile_mod, "_COMPILER_MODULES", ("json",))
    interval = sys.getswitchinterval()
    with pytest.raises(ValueError, match="boom"):
        with compile_mod.compiler_imported_alongside():
            assert sys.getswitchinterval() == pytest.approx(compile_mod._SWITCH_INTERVAL_S)
            raise ValueError("boom")
    assert not any(t.name == "libkk-compiler-import" for t in threading.enumerate())
    assert sys.getswitchinterval() == interval
