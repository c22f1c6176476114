"""Run one HTTP request through an ASGI app in this process and stream what it sends back.

The replica serves Ray Serve calls with the plain server's FastAPI app (validation, errors,
streaming, aborts) instead of a copy of its handlers. httpx's ASGITransport would buffer a whole
response; this yields the app's messages as they come. Closing the iterator early (Ray Serve
cancels the call when the client goes away) tells the app its client disconnected, which
aborts the engine requests exactly as a dropped HTTP connection does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

logger = logging.getLogger(__name__)

# how long the app gets to unwind after its client left, before its task is cancelled
_UNWIND_SECONDS = 5.0


def http_scope(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> dict:
    headers = [(k, v) for k, v in headers if k != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method, "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def call_app(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """The app's `http.response.start` and `http.response.body` messages, in order; an
    exception the app raised (it normally answers errors itself) is raised here."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.put_nowait(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:
                task.result()
                return
            if message["type"] in ("http.response.start", "http.response.body"):
                yield message
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), _UNWIND_SECONDS)
            except BaseException:  # noqa: BLE001 - timed out or cancelled again: stop it
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
