"""Reruns the kernel tests in a fresh process when this one cannot interpret Triton kernels.

That happens on CPU when something imported triton before `tests/kernels/conftest.py` could set
TRITON_INTERPRET=1 (see there); the kernel tests then skip themselves here and run there. The
rerun starts as soon as the suite is collected, so it runs beside the rest of the suite; this
test waits for it.
"""

from __future__ import annotations


def test_kernel_tests_in_interpreter_process(interpreter_rerun):
    status, output = interpreter_rerun.wait()
    assert status == 0, output[-12000:]
    assert " passed" in output
