"""Keep one OpenMP team per process: the step's. Other threads either run alone or exit.

Why: libgomp (the OpenMP runtime torch ships, which our kernels share) counts the worker
threads of every team in the process. Once they outnumber the CPUs it treats the process as
oversubscribed, and a worker waiting for the next parallel region spins ~100 times before it
sleeps in a futex, instead of ~300,000. A decode step opens dozens of parallel regions a few
microseconds apart, so throttled, every region pays a futex wake-up and the step waits on it.
Measured on a 2-core Zen 5 with the Qwen3-MoE shape (docs/performance-journal.md): once the
autotuner's background thread had timed the shapes (and so held a second team), a token took
11.0 ms in process; timed from a thread that exits, 6.8-8.3 ms.

A thread gets a team of its own the first time it runs a parallel region (a large torch op or
one of our kernels) and keeps it until it exits. So:
- work that needs every core but runs off the step's thread (the autotuner's timings) runs in
  `run_in_transient_thread`: the thread exits and libgomp frees its team;
- a long-lived helper thread (a KV tier's loader) calls `run_alone` first: its regions then run
  on the thread itself and make no team.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def run_in_transient_thread(work: Callable[[], T], name: str) -> T:
    """`work()` in a new thread that exits when it returns: its OpenMP team goes with it.
    Returns what `work` returns; raises what it raises."""
    outcome: dict[str, object] = {}

    def body() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller's thread, re-raised there
            outcome["error"] = exc

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def run_alone() -> None:
    """Make the calling thread's parallel regions run on itself alone (an OpenMP team of one,
    which adds no worker thread). Torch sets each thread's team size from the process-wide one
    at its first parallel op (`get_num_threads` does that here), so this thread's own setting
    is lowered after it, through the libgomp torch loaded: the process-wide count, which
    `torch.set_num_threads` would change, stays as it is."""
    torch.get_num_threads()
    libgomp = _libgomp()
    if libgomp is not None:
        libgomp.omp_set_num_threads(1)


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp already in the process (torch's: dlopen finds it by its soname), or None
    with a torch built without OpenMP."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except OSError:
        return None
