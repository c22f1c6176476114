"""Waiting for a result while the HTTP client may leave: the one helper the routes that answer
whole (not streamed) and the router's pass-through share. Plain asyncio, no torch: the router
imports it."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from starlette.requests import Request

POLL_SECONDS = 0.2  # how often a waiting answer asks whether its client is still there


async def until_disconnected(raw: Request, awaitable: Awaitable[Any]) -> Any:
    """The awaitable's result, or None once the client has gone away: the awaitable is then
    cancelled (what it ran aborts as it unwinds)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=POLL_SECONDS)
            if not task.done() and await raw.is_disconnected():
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
