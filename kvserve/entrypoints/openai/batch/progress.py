"""How far a batch run is, on stderr: tqdm's bar where tqdm is installed, else a plain line
rewritten at most once a second (a log file gets a few lines, not one per request)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`start()`, then `update(failed)` once per finished line; `close()` at the end."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None,
                 use_tqdm: bool = True):
        self.total, self.done, self.failed = total, 0, 0
        self._stream = stream or sys.stderr
        self._enabled, self._use_tqdm = enabled, use_tqdm
        self._bar = None
        self._plain = False
        self._last_print = 0.0

    def start(self) -> "Progress":
        if self._enabled:
            self._bar = _tqdm_bar(self.total, self._stream) if self._use_tqdm else None
            self._plain = self._bar is None
        return self

    def update(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(failed=self.failed, refresh=False)
        elif self._plain and (time.monotonic() - self._last_print >= 1.0
                              or self.done == self.total):
            self._print_line()

    def _print_line(self) -> None:
        self._last_print = time.monotonic()
        self._stream.write(f"run-batch: {self.done}/{self.total} lines "
                           f"({self.failed} failed)\n")
        self._stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _tqdm_bar(total: int, stream: TextIO):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=stream, unit="req", dynamic_ncols=True)
