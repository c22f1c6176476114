"""One line of an OpenAI batch file in, one result line out.

A line is checked here only for what the batch itself needs (JSON, a custom_id, POST, a path, a
body that does not stream); everything about the body is the server's routes' business, so a
batch line is validated exactly as the same request over HTTP would be.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

# what keys a line: its custom_id, or ("line", n) for a line without a usable one
LineKey = str | tuple[str, int]


@dataclass(frozen=True)
class BatchLine:
    """A line of the input: where it is (1-based), its key, and either a request to send
    (`url`, `body`) or the reason it cannot be sent (`error`: code, message)."""

    number: int
    custom_id: str | None
    url: str = ""
    body: dict | None = None
    error: tuple[str, str] | None = None

    @property
    def key(self) -> LineKey:
        return self.custom_id if self.custom_id is not None else ("line", self.number)


def parse_line(number: int, raw: bytes) -> BatchLine:
    """The line's request, or the first thing wrong with it."""
    try:
        item = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return BatchLine(number, None, error=("invalid_json", f"not a JSON object: {exc}"))
    if not isinstance(item, dict):
        return BatchLine(number, None, error=("invalid_json", "not a JSON object"))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, error=(
            "invalid_custom_id", f"custom_id must be a non-empty string, got {custom_id!r}"))
    problem = _request_problem(item)
    if problem is not None:
        return BatchLine(number, custom_id, error=problem)
    return BatchLine(number, custom_id, url=item["url"], body=item["body"])


def _request_problem(item: dict) -> tuple[str, str] | None:
    if item.get("method") != "POST":
        return "invalid_method", f"method must be \"POST\", got {item.get('method')!r}"
    url = item.get("url")
    if not isinstance(url, str) or not url.startswith("/") or url.startswith("//"):
        return "invalid_url", f"url must be an endpoint path such as " \
                              f"\"/v1/chat/completions\", got {url!r}"
    body = item.get("body")
    if not isinstance(body, dict):
        return "invalid_body", "body must be a JSON object (the endpoint's request)"
    if body.get("stream") not in (None, False):
        return "stream_unsupported", "a batch line cannot stream: remove \"stream\" or set " \
                                     "it to false"
    return None


def read_lines(path: str) -> Iterator[BatchLine]:
    """Every non-blank line of the input file, parsed, in order."""
    with open(path, "rb") as source:
        for number, raw in enumerate(source, start=1):
            if raw.strip():
                yield parse_line(number, raw)


def scan_keys(path: str) -> list[LineKey]:
    """The keys of the input's lines, in order; refuses a file where two lines share a
    custom_id, since then neither the results nor a resumed run could tell them apart."""
    keys: list[LineKey] = []
    first_seen: dict[str, int] = {}
    duplicates: list[str] = []
    for line in read_lines(path):
        if line.custom_id is not None:
            if line.custom_id in first_seen:
                duplicates.append(f"{line.custom_id!r} (lines {first_seen[line.custom_id]} "
                                  f"and {line.number})")
            first_seen.setdefault(line.custom_id, line.number)
        keys.append(line.key)
    if duplicates:
        shown = ", ".join(duplicates[:5]) + (", ..." if len(duplicates) > 5 else "")
        raise DuplicateCustomIdError(f"{path}: {len(duplicates)} duplicate custom_id(s): "
                                     f"{shown}; each line needs its own custom_id")
    return keys


class DuplicateCustomIdError(ValueError):
    """Two input lines share a custom_id."""


# ---- result lines (OpenAI's batch output format) --------------------------------------------
def response_record(custom_id: str, status_code: int, body: Any) -> dict:
    """The endpoint's answer, whatever its status: OpenAI's `response` part."""
    request_id = body.get("id") if isinstance(body, dict) else None
    if not isinstance(request_id, str):
        request_id = f"req_{uuid.uuid4().hex}"
    return {"id": _new_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None}


def error_record(line: BatchLine) -> dict:
    """A line that was never sent: OpenAI's `error` part, with the line number (as OpenAI's
    batch errors carry) so a line without a custom_id can still be found, and skipped when
    the run is resumed."""
    code, message = line.error
    return {"id": _new_id(), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line.number}}


def record_key(record: dict) -> LineKey | None:
    """The input line a result line answers, or None if it does not say."""
    custom_id = record.get("custom_id")
    if isinstance(custom_id, str):
        return custom_id
    error = record.get("error")
    if isinstance(error, dict) and isinstance(error.get("line"), int):
        return ("line", error["line"])
    return None


def is_failed(record: dict) -> bool:
    response = record.get("response")
    return record.get("error") is not None or not isinstance(response, dict) \
        or response.get("status_code", 500) >= 400


def _new_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"
