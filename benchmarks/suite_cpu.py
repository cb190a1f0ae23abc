"""CPU seconds of each test, every process counted (the ranks a test forks, their compile
workers, the subprocesses it launches): where the suite's time goes on a machine whose cores it
fills.

    sudo python benchmarks/suite_cpu.py [--top 30] [--json OUT] [-- PYTEST ARGS...]

Wall time per test says little on 2 cores (one test's 8 ranks share them; a single-process test
leaves one idle), and ``time``'s user+sys misses the ranks, which are children of a fork server.
This runs pytest inside a cgroup of the cgroup-v1 ``cpuacct`` controller
(``/sys/fs/cgroup/cpuacct``, root needed) and reads its ``cpuacct.usage`` (nanoseconds of CPU of
every process in it) before and after each test, through a pytest plugin defined here. Prints
the total and the ``--top`` tests by CPU, with their wall time.

Raises SystemExit with one line when the controller is not there or not writable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _usage_s(group: Path) -> float:
    """CPU seconds used so far by every process of ``group``."""
    return int((group / "cpuacct.usage").read_text()) / 1e9


class CpuPerTest:
    """pytest plugin: ``rows`` of ``(cpu_s, wall_s, nodeid)``, one per test (setup, call and
    teardown together)."""

    def __init__(self, group: Path):
        self.group, self.rows = group, []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        cpu, wall = _usage_s(self.group), time.perf_counter()
        yield
        self.rows.append((_usage_s(self.group) - cpu, time.perf_counter() - wall, item.nodeid))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=30, help="tests to print, most CPU first")
    p.add_argument("--json", help="write every test's (cpu_s, wall_s, nodeid) here")
    p.add_argument("--group", default="tetrad_suite", help="the cpuacct cgroup's name")
    p.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default tests)")
    args = p.parse_args(argv)
    if not os.access(CPUACCT, os.W_OK):
        raise SystemExit(
            f"suite_cpu: {CPUACCT} is missing or not writable: run as root on cgroup v1"
        )
    group = CPUACCT / args.group
    group.mkdir(exist_ok=True)
    (group / "cpuacct.usage").write_text("0")
    (group / "cgroup.procs").write_text(str(os.getpid()))  # this process and all it starts
    plugin = CpuPerTest(group)
    wall = time.perf_counter()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *(args.pytest_args or ["tests"])], [plugin])
    rows = sorted(plugin.rows, reverse=True)
    total = _usage_s(group)
    print(f"\nsuite_cpu: {total:.0f} s of CPU in {time.perf_counter() - wall:.0f} s of wall time")
    for cpu, w, nodeid in rows[: args.top]:
        print(f"{cpu:8.1f} s CPU {w:8.1f} s wall  {nodeid}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
