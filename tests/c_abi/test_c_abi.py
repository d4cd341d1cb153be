"""libkk from C and C++ hosts: the built library, the examples, the ABI test program, loading with
RTLD_LOCAL under the C locale, and picking the Python environment (virtualenvs)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from c_host import ROOT, TIMEOUT_S, Programs, host_env, run

from libkk import SamplingParams, Session

TINY_PROMPT = "Once upon a time"
TINY_TOKENS = 12


def _lines(result: subprocess.CompletedProcess[str]) -> str:
    return f"rc={result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def _info(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("info: "))
    return json.loads(line.removeprefix("info: "))


@pytest.fixture(scope="module")
def tiny_expected(tiny_llama_dir: Path) -> str:
    """What the Python API generates for the examples' request on the tiny model."""
    with Session(str(tiny_llama_dir), max_num_seqs=4, progress=False) as session:
        params = SamplingParams(max_tokens=TINY_TOKENS, temperature=0.0)
        return session.generate(TINY_PROMPT, params).text


def test_library_exports_exactly_the_header(programs: Programs) -> None:
    header = (programs.build / "libkk.h").read_text()
    assert header == (ROOT / "bindings_c/include/libkk.h").read_text()
    declared = set(re.findall(r"KK_API\s[^;{]*?\b(kk_\w+)\s*\(", header))
    assert {"kk_runtime_init", "kk_generate", "kk_submit", "kk_step", "kk_poll"} <= declared
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not on PATH")
    table = run([nm, "-D", "--defined-only", programs.build / "libkk.so"]).stdout
    exported = {f.split()[-1] for f in table.splitlines() if f.split()[1:2] == ["T"]}
    # Everything else (cffi's glue, the _kk_py_* functions) stays hidden.
    assert exported == declared | {"PyInit__libkk_c"}


def test_abi_program_in_the_c_locale(programs: Programs, tiny_llama_dir: Path) -> None:
    result = run([programs.abi_test, tiny_llama_dir], env=host_env(c_locale=True))
    assert result.returncode == 0 and "FAIL" not in result.stdout, _lines(result)
    sections = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert sections == [
        "before_init",
        "init",
        "sessions",
        "handles",
        "arguments",
        "generate",
        "stream",
        "loop",
        "free_while_running",
        "threads",
        "shutdown",
    ]
    # Nothing is lost at exit: the last line comes after kk_runtime_shutdown.
    assert result.stdout.endswith("ALL OK\n"), _lines(result)
    assert "Traceback" not in result.stderr, _lines(result)


def test_sessions_in_threads_each_equal_alone(programs: Programs, tiny_llama_dir: Path) -> None:
    """Four sessions on one model, each driven by its own host thread at once: every request's
    tokens equal the same session's alone (libkk.h: any function from several threads)."""
    result = run([programs.threads_test, tiny_llama_dir])
    assert result.returncode == 0, _lines(result)
    assert "0 mismatches" in result.stdout, _lines(result)


def test_examples_on_the_default_model(programs: Programs, default_model_dir: Path) -> None:
    # default_model_dir: the default model is converted (once, into the user cache) up front.
    prompt = "The capital of France is"
    blocking = run([programs.generate, "-n", "8", prompt])
    assert blocking.returncode == 0, _lines(blocking)
    assert "Paris" in blocking.stdout and "[8 tokens" in blocking.stderr, _lines(blocking)
    streamed = run([programs.stream, "-n", "8", prompt])
    assert streamed.returncode == 0, _lines(streamed)
    assert streamed.stdout == blocking.stdout, _lines(streamed)


def test_json_example_answers_in_its_schema(programs: Programs, default_model_dir: Path) -> None:
    """examples/c/json.c: structured_json holds the answer to the schema, sampled (several
    seeds), and the C program reads the fields back."""
    import jsonschema

    source = (ROOT / "examples/c/json.c").read_text()
    literal = re.search(r"SCHEMA\[\] =\s*(.*?);", source, re.S)[1]
    schema = json.loads(
        "".join(json.loads(part) for part in re.findall(r'"(?:\\.|[^"\\])*"', literal))
    )
    for seed in ("1", "2", "3"):
        result = run([programs.json, "-s", seed, "Invent a character for a fantasy novel."])
        assert result.returncode == 0, _lines(result)
        answer, fields = result.stdout.splitlines()[:2]
        value = json.loads(answer)
        jsonschema.validate(value, schema["json_schema"])
        assert fields == f"name={value['name']} class={value['class']} age={value['age']}"


def test_examples_on_a_tiny_model_match_the_python_api(
    programs: Programs, tiny_llama_dir: Path, tiny_expected: str
) -> None:
    for program in (programs.generate, programs.stream):
        args = [program, "-m", tiny_llama_dir, "-n", str(TINY_TOKENS), TINY_PROMPT]
        result = run(args, env=host_env(c_locale=True))
        assert result.returncode == 0, _lines(result)
        assert result.stdout == tiny_expected + "\n", _lines(result)


def test_readme_build_line_runs_from_any_directory(
    programs: Programs, tiny_llama_dir: Path, tiny_expected: str, tmp_path: Path
) -> None:
    """The README's gcc line, run where the README runs it (the checkout, with build/libkk), gives a
    program that finds libkk.so from any working directory."""
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("gcc ") and "generate.c" in x)
    checkout = tmp_path / "checkout"
    (checkout / "build").mkdir(parents=True)
    (checkout / "build" / "libkk").symlink_to(programs.build)
    (checkout / "examples").symlink_to(ROOT / "examples")
    built = run(["bash", "-c", line], cwd=checkout)
    assert built.returncode == 0, _lines(built)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = [checkout / "generate", "-m", tiny_llama_dir, "-n", str(TINY_TOKENS), TINY_PROMPT]
    result = run(args, cwd=elsewhere)
    assert result.returncode == 0, _lines(result)
    assert result.stdout == tiny_expected + "\n", _lines(result)


def test_stream_example_stops_on_ctrl_c(programs: Programs, tiny_llama_dir: Path) -> None:
    args = [programs.stream, "-m", str(tiny_llama_dir), "-n", "400", TINY_PROMPT]
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=host_env()
    ) as process:
        assert process.stdout is not None
        first = process.stdout.read1(1)  # type: ignore[attr-defined]
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    text = (first + stdout).decode()
    assert process.returncode == 0, stderr.decode()
    assert "interrupted" in stderr.decode() and text.strip(), stderr.decode()


def test_dlopen_with_local_symbols_in_the_c_locale(
    programs: Programs, tiny_llama_dir: Path, tiny_expected: str
) -> None:
    result = run(
        [programs.dlopen_test, programs.build / "libkk.so", "-", tiny_llama_dir, TINY_PROMPT],
        env=host_env(c_locale=True),
    )
    assert result.returncode == 0 and result.stdout.endswith("done\n"), _lines(result)
    info = _info(result.stdout)
    assert info["utf8_mode"] == 1 and info["prefix"] == sys.prefix, info
    assert f"text: {tiny_expected}\n" in result.stdout, _lines(result)


def test_python_environment_selection(programs: Programs, tmp_path: Path) -> None:
    """kk_runtime_init(executable) runs the environment of that executable, as running it would."""
    library = programs.build / "libkk.so"
    with_site = tmp_path / "venv-with-site"  # sees the base installation's packages (libkk)
    venv.create(with_site, system_site_packages=True, with_pip=False, symlinks=True)
    python = with_site / "bin" / "python"

    result = run([programs.dlopen_test, library, python, "-"])
    assert result.returncode == 0, _lines(result)
    info = _info(result.stdout)
    assert info["prefix"] == str(with_site) and info["executable"] == str(python), info
    assert Path(info["base_prefix"]).resolve() == Path(sys.base_prefix).resolve(), info

    # NULL: $LIBKK_PYTHON decides.
    result = run(
        [programs.dlopen_test, library, "-", "-"], env=host_env({"LIBKK_PYTHON": str(python)})
    )
    assert result.returncode == 0 and _info(result.stdout)["prefix"] == str(with_site)

    # A virtualenv without libkk's packages is really the one used: cffi is missing there.
    bare = tmp_path / "venv-bare"
    venv.create(bare, system_site_packages=False, with_pip=False, symlinks=True)
    result = run([programs.dlopen_test, library, bare / "bin" / "python", "-"])
    assert result.returncode == 3, _lines(result)
    assert "KK_ERR_RUNTIME" in result.stdout and str(bare) in result.stdout, _lines(result)
    assert "cffi" in result.stdout, _lines(result)

    # An executable outside any installation of this Python version is refused before anything
    # starts (Python would otherwise fall back to the installation the library was built with).
    stray = tmp_path / "stray" / "bin" / "python"
    stray.parent.mkdir(parents=True)
    stray.write_text("#!/bin/sh\n")
    stray.chmod(0o755)
    result = run([programs.dlopen_test, library, stray, "-"])
    assert result.returncode == 3 and "KK_ERR_INVALID_ARGUMENT" in result.stdout, _lines(result)
    assert "is not a Python 3." in result.stdout, _lines(result)

    # A virtualenv of another Python version is refused before anything starts.
    other = tmp_path / "venv-other-version"
    (other / "bin").mkdir(parents=True)
    (other / "bin" / "python").symlink_to(sys.executable)
    (other / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\nversion = 3.9.18\n")
    result = run([programs.dlopen_test, library, other / "bin" / "python", "-"])
    assert result.returncode == 3 and "KK_ERR_INVALID_ARGUMENT" in result.stdout, _lines(result)
    assert "3.9.18" in result.stdout, _lines(result)
