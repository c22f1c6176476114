"""Shutdown: SIGTERM while requests are in flight. With a long enough grace period they all
finish in full; when it runs out, each gets a clean error (a 503 body, or an SSE error event and
[DONE]), never a cut connection. Either way the process exits 0 and leaves no child behind.
"""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import psutil

from kvserve.testing.server import ServerProcess
from tests.helpers import tiny_server_flags


class StartGate:
    """Opens once `count` streams have received their first event."""

    def __init__(self, count: int):
        self.remaining = count
        self.opened = asyncio.Event()

    def arrive(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.opened.set()


async def _stream(client, index: int, max_tokens: int, gate: StartGate):
    payload = {"prompt": f"Story {index}:", "max_tokens": max_tokens, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    events = []
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    gate.arrive()
    return response.status_code, events


async def _plain(client, max_tokens: int):
    response = await client.post("/v1/completions", json={
        "prompt": "Waiting", "max_tokens": max_tokens, "ignore_eos": True})
    return response.status_code, response.json()


def _sigterm_during_load(model_dir, log_dir, grace: int, streams: int, plain: int,
                         max_tokens: int):
    """Start a server with `grace` seconds of shutdown timeout and the requests, SIGTERM once
    every stream has its first event; check the exit; return (stream, plain) results."""
    flags = tiny_server_flags(model_dir, "--shutdown-timeout", str(grace))
    with ServerProcess(flags, log_path=log_dir / "server.log") as server:
        return _sigterm(server, streams, plain, max_tokens)


def _sigterm(server: ServerProcess, streams: int, plain: int, max_tokens: int):
    children = psutil.Process(server.process.pid).children(recursive=True)

    async def scenario():
        gate = StartGate(streams)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            tasks = [asyncio.ensure_future(_stream(client, i, max_tokens, gate))
                     for i in range(streams)]
            tasks += [asyncio.ensure_future(_plain(client, max_tokens)) for _ in range(plain)]
            await asyncio.wait_for(gate.opened.wait(), 120)
            await asyncio.sleep(0.2)  # the non-streaming ones are in the engine too
            server.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    exit_code = server.process.wait(60)
    assert exit_code == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    return results[:streams], results[streams:]


def test_sigterm_with_grace_lets_requests_finish(tiny_model_dir, tmp_path):
    streams, plain = _sigterm_during_load(tiny_model_dir, tmp_path, grace=120, streams=8,
                                          plain=2, max_tokens=32)
    for status, events in streams:
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 32
    for status, body in plain:
        assert status == 200 and body["usage"]["completion_tokens"] == 32


def test_sigterm_after_grace_gives_clean_errors(tiny_model_dir, tmp_path):
    streams, plain = _sigterm_during_load(tiny_model_dir, tmp_path, grace=0, streams=4,
                                          plain=2, max_tokens=1900)
    for status, events in streams:
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "shutting down" in error["message"]
    for status, body in plain:
        assert status == 503 and "shutting down" in body["error"]["message"]
