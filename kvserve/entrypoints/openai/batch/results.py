"""The results file: appended one whole line at a time, so a run killed at any moment leaves
every finished line readable and at most one torn line at the end, which the next run drops
before it appends (and redoes that line).
"""

from __future__ import annotations

import json
import logging
import os

from kvserve.entrypoints.openai.batch.lines import LineKey, record_key

logger = logging.getLogger(__name__)


class CorruptResultsError(ValueError):
    """A line before the last one of the results file is not a result line."""


def recover_results(path: str) -> set[LineKey]:
    """The keys of the input lines the results file answers already. Bytes after the last
    newline are what a crash mid-write leaves (every line is written with its newline last):
    they are truncated away. A line that is not a result line anywhere else is not ours to
    guess about: CorruptResultsError."""
    if not os.path.exists(path):
        return set()
    keys: set[LineKey] = set()
    complete = 0  # bytes up to the last newline
    with open(path, "rb") as results:
        for number, raw in enumerate(results, start=1):
            if not raw.endswith(b"\n"):
                break
            complete += len(raw)
            if raw.strip():
                keys.add(_key_of(path, number, raw))
    size = os.path.getsize(path)
    if complete < size:
        _truncate(path, complete, size)
    return keys


def _key_of(path: str, number: int, raw: bytes) -> LineKey:
    record = _parse(raw)
    key = record_key(record) if record is not None else None
    if key is None:
        raise CorruptResultsError(f"{path}: line {number} is not a result line of a batch "
                                  "run; fix or remove it before resuming")
    return key


def _parse(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _truncate(path: str, good_end: int, size: int) -> None:
    logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run; its "
                   "request runs again", path, size - good_end)
    with open(path, "r+b") as results:
        results.truncate(good_end)


class ResultsWriter:
    """Appends result lines, each with one write on an O_APPEND descriptor (no buffer to lose
    or split): a line is either in the file whole or, if the process dies inside the write,
    torn at the end where `recover_results` finds it."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        while data:
            written = os.write(self._fd, data)
            data = data[written:]

    def close(self) -> None:
        os.close(self._fd)
