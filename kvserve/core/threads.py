"""Compute threads that follow the cores other processes leave free.

Why: the engine's kernels run on an OpenMP team, one thread per core, whose barriers wait for
the slowest thread. When another process keeps one of the two cores busy, the scheduler
deschedules one of our threads for whole time slices and every parallel call waits for it. On
the Zen 4 machine (benchmarks/profile_step.py, one neighbour spinning on a core) a batch-1 step
went from 7.3 to 23.5 ms with two threads, and batch 32 from 66 to 250 ms; with one thread it was
9.3 and 132 ms. Binding threads to cores (OMP_PROC_BIND) helped less (15 and 146 ms), and the
passive wait policy cost 2x when idle. So the governor measures, once a second, how much CPU
time the other processes took on our cores, and sets torch's thread count to the cores left
(at least one, at most the configured count); it changes only after two windows agree, so a
short burst does not make it flap. docs/performance-journal.md has the figures.

It reads Linux's /proc/stat (per-CPU busy time) and /proc/self/stat (our own), through
kvserve/kernels/cpu_load.py: elsewhere, or where /proc cannot be read, it does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from kvserve.kernels.cpu_load import (CpuSample, neighbour_cores, read_cpu_sample,
                                      ticks_per_second)
from kvserve.kernels.cpu_load import allowed_cpus as _allowed_cpus

logger = logging.getLogger(__name__)

ADAPTIVE_THREADS_ENV = "KVSERVE_ADAPTIVE_THREADS"  # "0" switches the governor off (the tests do)
CHECK_INTERVAL_S = 1.0
# a neighbour counts once it takes this much of a core; below, short bursts (a shell, the
# kernel's own threads) would cost us a thread for nothing
MIN_NEIGHBOUR_CORES = 0.5


def env_allows() -> bool:
    return os.environ.get(ADAPTIVE_THREADS_ENV, "1").strip().lower() not in (
        "0", "false", "no", "off")


def threads_for(max_threads: int, cores: int, others: float) -> int:
    """The thread count that leaves the neighbours' share of the cores to them."""
    if others < MIN_NEIGHBOUR_CORES:
        return max_threads
    free = cores - round(others)
    return max(1, min(max_threads, free))


class ThreadGovernor:
    """Call `tick()` once per engine step; it samples at most once a second and changes torch's
    thread count when two windows in a row ask for the same new count."""

    def __init__(self, max_threads: int, enabled: bool = True,
                 sample: Callable[[], CpuSample | None] = read_cpu_sample,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 interval_s: float = CHECK_INTERVAL_S):
        self.max_threads = max_threads
        self.threads = max_threads
        self.cores = len(_allowed_cpus())
        self._sample, self._set_threads, self._interval = sample, set_threads, interval_s
        self._ticks_per_second = ticks_per_second()
        self._last = sample() if enabled and max_threads > 1 else None
        self._proposed: int | None = None
        self.enabled = self._last is not None
        self.changes = 0

    def tick(self) -> None:
        if not self.enabled or time.monotonic() - self._last.wall < self._interval:
            return
        now = self._sample()
        if now is None:
            self.enabled = False
            return
        others = neighbour_cores(self._last, now, self._ticks_per_second)
        self._last = now
        wanted = threads_for(self.max_threads, self.cores, others)
        if wanted == self.threads:
            self._proposed = None
        elif wanted != self._proposed:
            self._proposed = wanted  # wait for a second window to agree
        else:
            logger.info("other processes use %.1f of %d cores: %d compute threads (was %d)",
                        others, self.cores, wanted, self.threads)
            self._set_threads(wanted)
            self.threads, self._proposed = wanted, None
            self.changes += 1
