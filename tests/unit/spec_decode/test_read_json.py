"""Checkpoint JSON files that cannot be read raise CorruptCheckpointError naming the file."""

from __future__ import annotations

import pytest

from libkk.errors import CorruptCheckpointError
from libkk.fsutil import read_json
from libkk.spec_decode.dflash_model import CONFIG_FILE, read_drafter_config


def test_read_json_returns_the_content_or_names_the_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": [1, 2]}')
    assert read_json(good) == {"a": [1, 2]}
    for name, data in (("cut.json", b'{"a": [1,'), ("latin.json", b'{"a": "\xff"}')):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CorruptCheckpointError, match=name):
            read_json(tmp_path / name)


def test_a_drafter_with_a_cut_config_is_corrupt(tmp_path):
    (tmp_path / CONFIG_FILE).write_text('{"block_size": ')
    with pytest.raises(CorruptCheckpointError, match=CONFIG_FILE):
        read_drafter_config(tmp_path)
