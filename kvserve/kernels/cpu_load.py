"""How busy other processes keep our cores, from Linux's /proc/stat (per-CPU busy time) and
/proc/self/stat (this process's own CPU time). The thread governor (core/threads.py) follows it
to leave a busy neighbour its core; the kernel autotuner (autotune.py) refuses to keep timings
taken while a neighbour ran (on 2 cores it slowed our parallel kernels by whole time slices,
~10 ms a call, and a table measured so chose the dense GEMM everywhere: decode 5x slower)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuSample:
    """Clock ticks: busy time of every CPU we may run on, and this process's own CPU time."""
    busy_ticks: int
    own_ticks: int
    wall: float


def allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def read_cpu_sample(cpus: set[int] | None = None) -> CpuSample | None:
    """One sample from /proc, or None where it cannot be read."""
    cpus = allowed_cpus() if cpus is None else cpus
    try:
        with open("/proc/stat") as stat:
            lines = stat.readlines()
        with open("/proc/self/stat") as own:
            # fields after the command name (which may hold spaces): utime, stime are 14th, 15th
            fields = own.read().rpartition(")")[2].split()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal ...: busy = all but idle, iowait, steal
        ticks = [int(v) for v in rest.split()[:8]]
        busy += ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]
    return CpuSample(busy, int(fields[11]) + int(fields[12]), time.monotonic())


def neighbour_cores(before: CpuSample, after: CpuSample, ticks_per_second: float) -> float:
    """Cores' worth of CPU time other processes used between two samples."""
    elapsed = after.wall - before.wall
    if elapsed <= 0:
        return 0.0
    others = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
    return max(0.0, others / ticks_per_second / elapsed)


def ticks_per_second() -> float:
    return float(os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
