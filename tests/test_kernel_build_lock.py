"""A kernel build killed mid-way (a test timeout, kill -9) must not make every later load wait
forever on torch's lock file."""

from __future__ import annotations

import multiprocessing
import os
import signal

from kvserve.kernels.cpu_ext import _exclusive_build


def test_a_stale_torch_lock_is_removed_under_our_lock(tmp_path):
    (tmp_path / "lock").touch()  # what a killed torch build leaves behind
    with _exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def _hold_forever(directory, ready):
    with _exclusive_build(directory):
        (directory / "lock").touch()
        ready.set()
        signal.pause()


def test_our_lock_dies_with_its_holder(tmp_path):
    """kill -9 of a builder frees the flock at once (and its torch lock is then stale)."""
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    holder = context.Process(target=_hold_forever, args=(tmp_path, ready))
    holder.start()
    assert ready.wait(30)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(30)
    with _exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
