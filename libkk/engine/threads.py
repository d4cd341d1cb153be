"""How many CPU threads torch runs on: `num_threads` resolved to a number.

NOTE: torch's own default counts the cores of the machine, not those this process may run on (a
container or `taskset` limits them through the affinity mask), and hyper-threads share a core's
arithmetic units. Oversubscribed, the CPU forward slows down sharply: on a loaded 2-core machine
the default ran 0.5 tok/s where one thread ran 16-20 tok/s.
"""

from __future__ import annotations

import os
from pathlib import Path

from libkk.errors import ConfigError

_CPUINFO = Path("/proc/cpuinfo")


def physical_cores(cpuinfo: str | None = None, allowed: set[int] | None = None) -> int:
    """The physical cores this process may run on: distinct (physical id, core id) pairs of
    /proc/cpuinfo among the CPUs of `os.sched_getaffinity(0)`; without that information, the CPUs
    it may run on, else `os.cpu_count()`. At least 1.

    `cpuinfo` and `allowed` replace the file's text and the affinity mask (for tests)."""
    if allowed is None and hasattr(os, "sched_getaffinity"):
        allowed = set(os.sched_getaffinity(0))
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    cores = _cores_of(cpuinfo, allowed)
    if cores:
        return len(cores)
    if allowed:
        return len(allowed)
    return max(1, os.cpu_count() or 1)


def resolve_num_threads(setting: int | None) -> int:
    """The CPU threads for torch: `setting` if given (an int >= 1), else `physical_cores()`."""
    if setting is None:
        return physical_cores()
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ConfigError(f"num_threads={setting!r} is invalid: expected an integer >= 1 or None")
    return setting


def _cores_of(cpuinfo: str, allowed: set[int] | None) -> set[tuple[str, str]]:
    """(physical id, core id) of every allowed processor; empty when a processor lacks either."""
    cores: set[tuple[str, str]] = set()
    for block in cpuinfo.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" not in fields:
            continue
        try:
            cpu = int(fields["processor"])
        except ValueError:
            return set()
        if allowed is not None and cpu not in allowed:
            continue
        if "physical id" not in fields or "core id" not in fields:
            return set()  # no topology (some VMs and architectures): count CPUs instead
        cores.add((fields["physical id"], fields["core id"]))
    return cores
