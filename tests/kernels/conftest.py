"""Kernel tests run the Triton ops on CUDA, or on CPU under Triton's interpreter.

Triton picks the interpreter only for functions decorated while TRITON_INTERPRET=1 is set, and its
own library functions are decorated when triton is first imported. This conftest sets the
variable as early as it can; if something imported triton before (a whole-suite run where an
earlier test module pulled it in), `test_interpreter_process.py` reruns the kernel tests in a
fresh process instead.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
