"""The fault suite of the process core, through the server: `kill -9` of the engine core, or of
one of its model workers (pipeline stages), under load ends every stream within seconds (a 503
body, or an SSE error event and [DONE]), /health turns 503, and then the server either exits
non-zero or, with --restart-engine-on-failure, serves again from an empty core. Killing the
front-end takes the core with it. No process is left behind on any path (checked through
/proc)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import psutil
import pytest

from kvserve.testing.server import ServerProcess
from tests.helpers import (
    assert_health_went_503_then_gone,
    assert_idle,
    complete,
    process_alive,
    tiny_server_flags,
    wait_gone,
    watch_health,
)

pytestmark = pytest.mark.multiprocess

STREAM_DEADLINE_SECONDS = 20  # streams end within this after the core is killed
WORKER_DEATH_SECONDS = 3  # and within this after a worker is (measured: 0.05 s; was 6-14 s)


def _flags(model_dir, *extra):
    return tiny_server_flags(model_dir, "--engine-core", "process", *extra)


def _core_pid(server: ServerProcess) -> int:
    """The engine core: the server's child running `python -m kvserve.core.core_process`."""
    for child in psutil.Process(server.process.pid).children(recursive=True):
        if "kvserve.core.core_process" in child.cmdline():
            return child.pid
    raise AssertionError("no engine core process")


def _descendants(server: ServerProcess) -> list[int]:
    return [child.pid for child in psutil.Process(server.process.pid).children(recursive=True)]


def _worker_pids(server: ServerProcess) -> list[int]:
    """The core's model workers (`python -m kvserve.worker.worker`), in rank order."""
    core = psutil.Process(_core_pid(server))
    workers = [child for child in core.children() if "kvserve.worker.worker" in
               child.cmdline()]
    return [w.pid for w in sorted(workers, key=lambda w: int(w.cmdline()[-5]))]


def _kill_core_under_load(server: ServerProcess, num_requests: int = 6, victim: int | None = None,
                          watch_health_until_gone: bool = False):
    """Start requests, kill -9 the core (or the process `victim`) once they stream, return
    (results, seconds to end, /health's statuses from just before the kill until the server
    went away, when asked to watch them)."""
    core = victim or _core_pid(server)

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            tasks = [asyncio.ensure_future(complete(client, f"story number {i}",
                                                    stream=i % 2 == 0, max_tokens=1500))
                     for i in range(num_requests)]
            await _until_generating(client)
            stop = asyncio.Event()
            health = asyncio.ensure_future(watch_health(server.base_url, stop)) \
                if watch_health_until_gone else None
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), STREAM_DEADLINE_SECONDS)
            seconds = time.monotonic() - killed
            statuses = await asyncio.wait_for(health, 60) if health else None
            return results, seconds, statuses

    results, seconds, statuses = asyncio.run(scenario())
    assert wait_gone(core)
    return (results, seconds, statuses) if watch_health_until_gone else (results, seconds)


async def _until_generating(client) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith("kvserve:generation_tokens_total") and float(line.split()[-1]):
                return
        await asyncio.sleep(0.05)
    raise AssertionError("no tokens generated")


def _assert_all_failed_cleanly(results) -> None:
    for status, body in results:
        if isinstance(body, dict):
            assert status == 503 and body["error"]["code"] == "engine_unavailable", body
        else:
            assert status == 200 and body[-1] == "[DONE]", body[-3:]
            assert json.loads(body[-2])["error"]["code"] == "engine_unavailable"


def test_killed_core_fails_streams_and_the_server_exits_nonzero(tiny_model_dir, tmp_path):
    with ServerProcess(_flags(tiny_model_dir), log_path=tmp_path / "server.log") as server:
        children = _descendants(server)
        results, seconds, health = _kill_core_under_load(server, watch_health_until_gone=True)
        _assert_all_failed_cleanly(results)
        assert seconds < STREAM_DEADLINE_SECONDS
        server.process.wait(30)
    assert server.process.returncode == 1
    assert_health_went_503_then_gone(health)
    assert not any(process_alive(pid) for pid in children)


@pytest.mark.timeout(600)  # two engine start-ups: ~4 min on a busy 2-core machine
def test_restarted_core_serves_again_from_empty(tiny_model_dir, tmp_path):
    flags = _flags(tiny_model_dir, "--restart-engine-on-failure", "--max-engine-restarts", "2")
    with ServerProcess(flags, log_path=tmp_path / "server.log") as server:
        first_core = _core_pid(server)
        results, _ = _kill_core_under_load(server)
        _assert_all_failed_cleanly(results)
        # the new core takes seconds to start: meanwhile /health and new requests get 503s
        health = httpx.get(server.base_url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["message"]
        late = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "not_ready"
        _wait_health(server.base_url, 200, timeout=120)
        second_core = _core_pid(server)
        assert second_core != first_core and not process_alive(first_core)
        response = httpx.post(server.base_url + "/v1/completions", timeout=60,
                              json={"prompt": "hello", "max_tokens": 5, "ignore_eos": True})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 5
        assert_idle(server.base_url)  # KV blocks in use 0 after the restart
        children = _descendants(server)
    assert server.exit_code == 0
    assert not any(process_alive(pid) for pid in children)


@pytest.mark.timeout(600)  # two start-ups of a core and its two workers
def test_killed_worker_under_load_restarts_the_engine(tiny_model_dir, tmp_path):
    """A pipeline stage's worker is killed mid-stream: the streams end cleanly, the core and its
    other worker are gone, a new core with new workers serves, and nothing leaks."""
    flags = _flags(tiny_model_dir, "--pipeline-parallel-size", "2",
                   "--restart-engine-on-failure", "--max-engine-restarts", "1")
    with ServerProcess(flags, log_path=tmp_path / "server.log") as server:
        first_core, workers = _core_pid(server), _worker_pids(server)
        assert len(workers) == 2
        results, seconds = _kill_core_under_load(server, victim=workers[1])
        _assert_all_failed_cleanly(results)
        # the core says it is dying before it stops its other worker (stuck in a collective
        # with the dead one: seconds), as a worker monitor would
        assert seconds < WORKER_DEATH_SECONDS, seconds
        assert wait_gone(first_core) and wait_gone(workers[0])
        _wait_health(server.base_url, 200, timeout=120)
        assert len(_worker_pids(server)) == 2
        response = httpx.post(server.base_url + "/v1/completions", timeout=60,
                              json={"prompt": "hello", "max_tokens": 5, "ignore_eos": True})
        assert response.json()["usage"]["completion_tokens"] == 5
        assert_idle(server.base_url)
        children = _descendants(server)
    assert server.exit_code == 0
    assert not any(process_alive(pid) for pid in children)


def test_killed_front_end_takes_the_core_along(tiny_model_dir, tmp_path):
    with ServerProcess(_flags(tiny_model_dir), log_path=tmp_path / "server.log") as server:
        core = _core_pid(server)
        children = _descendants(server)
        server.process.kill()
        server.process.wait(10)
    assert wait_gone(core, timeout=10)
    assert not any(process_alive(pid) for pid in children)


def _wait_health(base_url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health never answered {status}")
