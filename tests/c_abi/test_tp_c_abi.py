"""The C ABI with tensor_parallel_size > 1: the same text as one rank, and no worker left after
kk_session_free (CPU, gloo)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from c_host import HERE, Programs, host_env, run

WORKER = "from libkk.engine.tp_worker import worker_entry"


@pytest.fixture(scope="module")
def tp_generate(programs: Programs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    out = tmp_path_factory.mktemp("tp-bin") / "tp_generate"
    b = programs.build
    cmd = [cc, "-std=c99", "-Wall", "-Wextra", "-Werror", HERE / "tp_generate.c"]
    cmd += ["-I", b, "-L", b, "-lkk", f"-Wl,-rpath,{b}", "-o", out]
    result = run(cmd)
    assert result.returncode == 0, result.stderr
    return out


def _workers() -> set[str]:
    found = subprocess.run(["pgrep", "-f", WORKER], capture_output=True, text=True)
    return set(found.stdout.split())


def test_tensor_parallel_through_the_c_abi(tp_generate: Path, tiny_llama_dir: Path) -> None:
    before = _workers()
    texts = []
    for tp in (1, 2):
        settings = json.dumps(
            {
                "tensor_parallel_size": tp,
                "max_num_seqs": 2,
                "num_gpu_blocks": 32,
                "max_model_len": 128,
                "progress": False,
            }
        )
        args = [tp_generate, tiny_llama_dir, settings, "8", "Once upon a time"]
        result = run(args, env=host_env())
        assert result.returncode == 0, result.stderr
        texts.append(result.stdout)
    assert texts[0].strip() and texts[1] == texts[0]
    assert _workers() <= before  # kk_session_free stopped the workers
