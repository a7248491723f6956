"""How busy the machine is: idle CPU share from /proc/stat, and waiting for a quiet moment.

Other work on a shared machine delays every process under test; measuring while it runs
measures the machine. The benchmarks wait (bounded) for the CPUs to be idle enough
before each measurement, and report the idle share during it.
"""

from __future__ import annotations

import time


def cpu_ticks() -> tuple[int, int]:
    """(idle, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


def idle_since(start: tuple[int, int]) -> float:
    """The machine's idle CPU share since `start` (a cpu_ticks() reading)."""
    idle, total = cpu_ticks()
    return (idle - start[0]) / max(1, total - start[1])


def wait_quiet(min_idle: float, timeout: float) -> float:
    """Wait (at most `timeout` s) until the CPUs are `min_idle` idle over 2 s.

    Returns the idle share last seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        start = cpu_ticks()
        time.sleep(2.0)
        idle = idle_since(start)
        if idle >= min_idle or time.monotonic() > deadline:
            return idle
