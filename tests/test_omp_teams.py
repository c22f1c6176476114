"""One OpenMP team per process (kvserve/kernels/omp_teams.py): a thread that ran a parallel
region keeps a team of worker threads until it exits, and a second team throttles the step's
workers into a futex sleep between regions. Seen here as OS threads: a team is worker threads
in /proc/self/task."""

import os
import threading
import time

import pytest
import torch

from kvserve.kernels.omp_teams import run_alone, run_in_transient_thread


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_op() -> float:
    """Large enough for torch to open a parallel region over every thread."""
    return float((torch.ones(1 << 22) * 2).sum())


@pytest.fixture
def baseline():
    if torch.get_num_threads() < 2:
        pytest.skip("one OpenMP thread: no team to leave behind")
    parallel_op()  # this thread's own team exists before counting
    return os_threads()


def settled(expected: int, seconds: float = 5.0) -> int:
    """The thread count once it reaches `expected` (exiting threads take a moment), else the
    last count seen."""
    deadline = time.monotonic() + seconds
    while os_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return os_threads()


def test_a_transient_thread_takes_its_team_with_it(baseline):
    assert run_in_transient_thread(parallel_op, name="probe") == 2 * (1 << 22)
    assert settled(baseline) == baseline


def test_a_transient_thread_raises_in_the_caller():
    def fail():
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        run_in_transient_thread(fail, name="probe")


def test_a_thread_run_alone_makes_no_team(baseline):
    """Its regions run on itself: while it lives, it is the only thread added. Without
    run_alone the same thread adds a worker (the check that the probe sees a team at all)."""
    counts = {}
    for alone in (True, False):
        done, release = threading.Event(), threading.Event()

        def helper(alone=alone):
            if alone:
                run_alone()
            parallel_op()
            done.set()
            release.wait(30)

        thread = threading.Thread(target=helper)
        thread.start()
        done.wait(30)
        counts[alone] = os_threads() - baseline
        release.set()
        thread.join()
        settled(baseline)
    assert counts == {True: 1, False: 1 + torch.get_num_threads() - 1}
    assert torch.get_num_threads() >= 2  # the process-wide count is untouched
