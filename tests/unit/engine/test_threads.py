"""num_threads: None counts the physical cores the process may run on; an int is taken as is."""

from __future__ import annotations

import os

import pytest

from libkk.config import EngineConfig
from libkk.engine.threads import physical_cores, resolve_num_threads
from libkk.errors import ConfigError


def _cpuinfo(cpus: list[tuple[int, int, int]], topology: bool = True) -> str:
    """/proc/cpuinfo text for (processor, physical id, core id) triples."""
    blocks = []
    for cpu, package, core in cpus:
        lines = [f"processor\t: {cpu}", "vendor_id\t: GenuineIntel", "model name\t: Test CPU"]
        if topology:
            lines += [f"physical id\t: {package}", "siblings\t: 4", f"core id\t\t: {core}"]
        lines.append("flags\t\t: fpu sse2")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\n"


# Two sockets of two cores, each core with two hyper-threads: 8 logical CPUs, 4 cores.
TWO_SOCKETS = _cpuinfo(
    [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (4, 0, 0), (5, 0, 1), (6, 1, 0), (7, 1, 1)]
)


def test_hyper_threads_count_once():
    assert physical_cores(TWO_SOCKETS, allowed=set(range(8))) == 4


def test_only_the_cpus_of_the_affinity_mask_count():
    assert physical_cores(TWO_SOCKETS, allowed={0, 4}) == 1  # two threads of one core
    assert physical_cores(TWO_SOCKETS, allowed={0, 1}) == 2
    assert physical_cores(TWO_SOCKETS, allowed={0, 2, 6}) == 2  # same core id, two sockets


def test_without_topology_the_allowed_cpus_count():
    flat = _cpuinfo([(0, 0, 0), (1, 0, 0), (2, 0, 0)], topology=False)
    assert physical_cores(flat, allowed={0, 1, 2}) == 3
    assert physical_cores("", allowed={3, 5}) == 2


def test_this_machine_is_within_its_affinity_mask():
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= physical_cores() <= (allowed or 1)


def test_resolve_num_threads():
    assert resolve_num_threads(None) == physical_cores()
    assert resolve_num_threads(3) == 3
    for bad in (0, -2, True, 1.5, "2"):
        with pytest.raises(ConfigError, match="num_threads"):
            resolve_num_threads(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, "four", 2.5, True])
def test_bad_num_threads_setting_names_its_path(bad):
    with pytest.raises(ConfigError, match=r"\$\.num_threads"):
        EngineConfig.from_settings(num_threads=bad)


def test_num_threads_setting():
    assert EngineConfig().num_threads is None
    assert EngineConfig.from_settings(num_threads=2).num_threads == 2
    assert EngineConfig.from_dict({"num_threads": 1}).num_threads == 1
