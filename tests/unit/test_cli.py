"""The `libkk` command's argument handling: checks before the model loads, --version, -v anywhere,
help texts with defaults, where the chat prompt and the progress bars go, quantize on a dense
model. No test here loads a model."""

from __future__ import annotations

import argparse
import io

import pytest

import libkk
from libkk.cli import _engine_config, build_parser, main


class _NoModel:
    """Stands in for Session: a test that reaches it would load a model."""

    created = 0

    def __init__(self, *args, **kwargs):
        type(self).created += 1
        raise AssertionError("the model would load")


@pytest.fixture
def no_model(monkeypatch):
    _NoModel.created = 0
    monkeypatch.setattr("libkk.api.session.Session", _NoModel)
    return _NoModel


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"libkk {libkk.__version__}"


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    "flags, field",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-k", "-7"], "top_k"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--min-p", "1.5"], "min_p"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--seed", str(2**64)], "seed"),
        (["--stop", ""], "stop"),
        (["--threads", "0"], "num_threads"),
        (["--set", "max_num_seqs=0"], "max_num_seqs"),
    ],
)
def test_bad_values_fail_before_the_model_loads(no_model, capsys, command, flags, field):
    argv = [command, *(["hello"] if command == "generate" else []), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("libkk: error:") and field in err, err
    assert no_model.created == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "generate", "x"],
        ["generate", "-v", "x"],
        ["generate", "x", "--verbose"],
        ["info", "-v"],
        ["-v", "cache", "list"],
        ["cache", "list", "-v"],
    ],
)
def test_verbose_before_or_after_the_subcommand(argv):
    assert build_parser().parse_args(argv).verbose is True


def test_not_verbose_by_default():
    assert build_parser().parse_args(["generate", "x"]).verbose is False


def _parsers(parser: argparse.ArgumentParser, name: str = "libkk"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_command_has_a_description_and_shows_its_defaults():
    commands = dict(_parsers(build_parser()))
    assert {"libkk generate", "libkk chat", "libkk quantize", "libkk cache warm"} <= set(commands)
    for name, parser in commands.items():
        assert parser.description, f"{name} --help has no description"
        formatter = parser._get_formatter()
        for action in parser._actions:
            takes_value = action.nargs != 0 and not isinstance(action, argparse._SubParsersAction)
            if action.default is argparse.SUPPRESS or action.required or not takes_value:
                continue
            if not action.option_strings and action.nargs != "?":
                continue  # a required positional has no default
            text = formatter._expand_help(action)
            assert "default" in text, f"{name} {action.dest}: {text!r}"
        assert "show this help message" in parser.format_help()


def test_chat_prompt_goes_to_stderr_when_stdout_is_not_a_terminal(monkeypatch, capsys):
    class Reply:
        text = "a reply"

    class FakeSession:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def chat(self, messages, params):
            assert messages[-1] == {"role": "user", "content": "hi"}
            return Reply()

    monkeypatch.setattr("libkk.api.session.Session", FakeSession)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n\n"))
    assert main(["chat"]) == 0
    out, err = capsys.readouterr()
    assert out == "a reply\n"  # replies only: redirected output holds no prompt
    assert err.count("> ") == 2


def test_progress_bars_only_on_a_terminal_unless_asked(monkeypatch):
    parser = build_parser()

    def progress(argv):
        return _engine_config(parser.parse_args(argv)).progress

    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert progress(["info"]) is False
    assert progress(["info", "--progress"]) is True
    assert progress(["info", "--set", "progress=true"]) is True
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert progress(["info"]) is True
    assert progress(["info", "--no-progress"]) is False


def test_threads_and_settings_reach_the_config():
    args = build_parser().parse_args(["generate", "x", "--threads", "1", "--set", "max_num_seqs=3"])
    config = _engine_config(args)
    assert config.num_threads == 1 and config.scheduler.max_num_seqs == 3
    assert _engine_config(build_parser().parse_args(["info"])).num_threads is None


def test_quantize_refuses_a_dense_model(tiny_llama_dir, tmp_path, capsys):
    dst = tmp_path / "q"
    assert main(["quantize", str(tiny_llama_dir), str(dst), "--format", "mxfp4"]) == 2
    err = capsys.readouterr().err
    assert "no MoE expert weights" in err and "dense" in err, err
    assert not dst.exists()


def test_quantize_a_missing_model(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "nope"), str(tmp_path / "q"), "--format", "nvfp4"]) == 2
    assert "nope" in capsys.readouterr().err
