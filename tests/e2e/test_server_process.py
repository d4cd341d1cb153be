"""`libkk serve` as a process: SIGTERM with a stream in flight ends the stream cleanly and the
process exits 0; without FastAPI the command says how to install it; bad settings fail before the
model loads; `import libkk` never needs the server's packages."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from libkk.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def server_process(default_model_dir, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - read back on failure
    args = [sys.executable, "-m", "libkk.cli", "serve", str(default_model_dir)]
    args += ["--port", str(port), "--threads", "1", "--no-progress", "--shutdown-timeout", "1"]
    args += ["--set", "device=cpu", "--set", "max_model_len=512"]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def output() -> str:
        log.seek(0)
        return log.read()

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"the server exited early:\n{output()}"
        assert time.monotonic() < deadline, f"the server did not start:\n{output()}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    try:
        yield proc, url, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_sigterm_with_a_stream_in_flight_exits_promptly_with_status_0(server_process):
    proc, url, output = server_process
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 450, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 2:
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
    # The stream ended as streams end: the last choice chunk, then [DONE].
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    tokens = "".join(
        json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1]
    )
    assert tokens  # it had generated before the signal
    assert proc.wait(timeout=30) == 0, output()
    # Grace 1 s, then the abort and the session's close.
    assert time.monotonic() - signalled < 20
    assert "Application shutdown complete" in output()


def test_serve_without_the_extra_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` fails
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert 'pip install "libkk[serve]"' in err and "fastapi" in err


def test_bad_settings_fail_before_the_model_loads(monkeypatch, capsys):
    def no_session(*args, **kwargs):
        raise AssertionError("the model would load")

    monkeypatch.setattr("libkk.api.session.Session", no_session)
    assert main(["serve", "--set", "max_num_seqs=0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_import_libkk_leaves_the_server_packages_out():
    code = (
        "import sys, libkk, libkk.cli\n"
        "loaded = [m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules]\n"
        "sys.exit(f'loaded: {loaded}' if loaded else 0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
