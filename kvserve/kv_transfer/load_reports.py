"""A worker-side connector's finished loads, reported from its load threads and taken after
each step (`get_finished`, `get_load_errors`); an idle core in the same process sleeps on it
(`wait_for_finished`) until a load ends."""

from __future__ import annotations

import queue
import threading


class LoadReports:
    def __init__(self) -> None:
        self._finished: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self._errors: dict[str, str] = {}
        self._wake = threading.Event()

    def report(self, request_id: str, error: str | None) -> None:
        """From a load thread: the request's load ended (`error`: why it failed)."""
        self._finished.put((request_id, error))
        self._wake.set()

    def nudge(self) -> None:
        """Wake a core waiting in `wait` without a report: work is ready for the next
        `take_finished` (a connector that finishes loads on the worker's thread)."""
        self._wake.set()

    def take_finished(self) -> set[str]:
        """Requests whose load ended since the last call; their failures are kept for
        `take_errors`."""
        self._wake.clear()
        finished: set[str] = set()
        while True:
            try:
                request_id, error = self._finished.get_nowait()
            except queue.Empty:
                return finished
            finished.add(request_id)
            if error is not None:
                self._errors[request_id] = error

    def take_errors(self) -> dict[str, str]:
        errors, self._errors = self._errors, {}
        return errors

    def wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
