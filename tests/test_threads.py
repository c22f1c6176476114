"""The thread governor: its decision from CPU samples (fed by hand), and its /proc reading
against a real busy neighbour process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvserve.core import threads
from kvserve.core.threads import CpuSample, ThreadGovernor, neighbour_cores, threads_for


def test_threads_for_leaves_the_neighbours_cores():
    assert threads_for(2, 2, 0.0) == 2
    assert threads_for(2, 2, 0.3) == 2   # a short burst is not a neighbour
    assert threads_for(2, 2, 1.0) == 1
    assert threads_for(2, 2, 2.0) == 1   # never fewer than one
    assert threads_for(8, 16, 4.2) == 8  # never more than configured
    assert threads_for(16, 16, 4.2) == 12


class FakeProc:
    """CPU samples scripted per window of one second: (busy ticks of all our CPUs, our own
    ticks); the sample clock starts near zero, so every tick (interval 0) takes a sample."""

    def __init__(self, windows):
        self.windows = iter(windows)
        self.busy = self.own = 0
        self.wall = 0.0

    def __call__(self):
        busy, own = next(self.windows, (0, 0))
        self.busy += busy
        self.own += own
        self.wall += 1.0
        return CpuSample(self.busy, self.own, self.wall)


def test_governor_drops_a_thread_for_a_neighbour_and_takes_it_back(monkeypatch):
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: {0, 1})
    hz = 100
    # per window: all cores' busy ticks and ours; the neighbour = the difference
    proc = FakeProc([(0, 0),                    # the governor's first sample
                     (200, 100), (200, 100),    # a neighbour on one core: two windows agree
                     (150, 150),                # it left ...
                     (180, 180), (190, 190)])   # ... and stays gone
    calls = []
    governor = ThreadGovernor(2, sample=proc, set_threads=calls.append, interval_s=0)
    governor._ticks_per_second = hz
    for _ in range(2):
        governor.tick()
    assert calls == [1] and governor.threads == 1
    governor.tick()  # one window without the neighbour: not yet
    assert calls == [1]
    governor.tick()
    assert calls == [1, 2] and governor.threads == 2 and governor.changes == 2


def test_governor_ignores_one_window_alone(monkeypatch):
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: {0, 1})
    proc = FakeProc([(0, 0), (200, 100), (100, 100), (200, 100), (100, 100)])
    calls = []
    governor = ThreadGovernor(2, sample=proc, set_threads=calls.append, interval_s=0)
    governor._ticks_per_second = 100
    for _ in range(4):
        governor.tick()
    assert calls == []


def test_governor_is_off_for_one_thread_or_without_proc():
    assert not ThreadGovernor(1).enabled
    assert not ThreadGovernor(2, sample=lambda: None).enabled


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_proc_sample_sees_a_real_busy_neighbour():
    before = threads.read_cpu_sample()
    assert before is not None and before.busy_ticks > 0 and before.own_ticks >= 0
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter's start-up is not the measured window
        start = threads.read_cpu_sample()
        time.sleep(1.5)
        end = threads.read_cpu_sample()
    finally:
        spinner.kill()
        spinner.wait()
    hz = threads.os.sysconf("SC_CLK_TCK")
    # the spinner takes about a core; loose bound: the machine may be busy with other work too
    assert neighbour_cores(start, end, hz) >= 0.5
