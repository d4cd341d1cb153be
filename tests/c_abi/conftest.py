"""Builds libkk's C library once per test session and compiles the programs that drive it."""

from __future__ import annotations

import pytest
from c_host import Programs, build_programs


@pytest.fixture(scope="session")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Programs:
    return build_programs(tmp_path_factory)
