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


def os_threads() -> set[str]:
    """The process's OS threads by id: the tests compare which appeared, so a thread some
    earlier test left exiting meanwhile does not count."""
    return set(os.listdir("/proc/self/task"))


def parallel_op() -> float:
    """Large enough for torch to open a parallel region over every thread."""
    return float((torch.ones(1 << 22) * 2).sum())


@pytest.fixture
def baseline():
    if torch.get_num_threads() < 2:
        pytest.skip("one OpenMP thread: no team to leave behind")
    parallel_op()  # this thread's own team exists before counting
    return os_threads()


def new_threads(before: set[str], seconds: float = 5.0) -> set[str]:
    """The threads that were not there `before`, once none are (exiting threads take a
    moment), else those left."""
    deadline = time.monotonic() + seconds
    while os_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return os_threads() - before


def test_a_transient_thread_takes_its_team_with_it(baseline):
    assert run_in_transient_thread(parallel_op, name="probe") == 2 * (1 << 22)
    assert new_threads(baseline) == set()


def test_a_transient_thread_raises_in_the_caller():
    def fail():
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        run_in_transient_thread(fail, name="probe")


def test_a_thread_run_alone_makes_no_team(baseline):
    """Its regions run on itself: while it lives, it is the only thread added. Without
    run_alone the same thread adds a worker (the check that the probe sees a team at all)."""
    added = {}
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
        added[alone] = len(os_threads() - baseline)
        release.set()
        thread.join()
        new_threads(baseline)
    assert added == {True: 1, False: 1 + torch.get_num_threads() - 1}
    assert torch.get_num_threads() >= 2  # the process-wide count is untouched
