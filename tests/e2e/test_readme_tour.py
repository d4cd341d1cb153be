"""README.md's "A short tour" runs against the real API and prints each thing it computes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tour() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A short tour", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_tour_runs_and_prints_every_result(tiny_llama_dir, capsys):
    code = _tour()
    assert "libkk.Session()" in code
    # The tiny model stands in for the default one (same tokenizer and chat template).
    code = code.replace("libkk.Session()", f"libkk.Session({str(tiny_llama_dir)!r})")
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r".* (length|stop) \d+\.\d+", lines[0]), lines  # text, finish, ttft
    assert lines[1].startswith("'Hello' -> ") and lines[2].startswith("'Bonjour' -> "), lines
    # the streamed text, then the chat reply, then the loop's outputs
    assert any(line.startswith("req-") and line.endswith(("length", "stop")) for line in lines)
    assert len(lines) >= 6, lines


def test_every_value_the_tour_computes_is_printed():
    """An assignment whose value no later line uses is a result the reader never sees."""
    code = _tour()
    for name in re.findall(r"^\s*(\w+) = ", code, re.M):
        uses = re.findall(rf"\b{name}\b", code)
        assert len(uses) >= 2 or name == "rid", f"{name} is computed and never shown"
