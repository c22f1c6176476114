"""Load: many concurrent streaming clients (short and long prompts, chat and completions,
n = 1..3) against a tiny-model server on loopback. Every request must complete with exactly its
token count, the engine must end idle (nothing running or waiting, no KV block in use; cached
blocks allowed), and the server's RSS must not grow beyond a stated bound.

The quick version runs in the default suite; the full soak (256 clients, 2,000 requests) is
`make test-soak`.
"""

from __future__ import annotations

import asyncio

import pytest

from kvserve.testing.loadgen import mixed_workload, run_load
from kvserve.testing.server import ServerProcess
from tests.server_helpers import assert_idle, finished_count, read_metrics, rss_bytes, tiny_server_flags

# RSS growth allowed between the end of the warm-up round and the end of the run. Allocator
# caches (glibc arenas, torch's CPU caching) settle during warm-up; a leak of a few KiB per
# request would show as tens of MiB over 2,000 requests.
RSS_GROWTH_BOUND = 64 * 2**20


def soak(server: ServerProcess, count: int, concurrency: int, seed: int) -> dict:
    workload = mixed_workload(count + concurrency, seed=seed)
    warm_up, measured = workload[:concurrency], workload[concurrency:]
    before_metrics = read_metrics(server.base_url)
    asyncio.run(run_load(server.base_url, warm_up, concurrency))
    assert_idle(server.base_url)
    rss_before = rss_bytes(server.process.pid)
    results = asyncio.run(run_load(server.base_url, measured, concurrency))
    failures = [(r.request.kind, r.request.n, r.problems()) for r in results if r.problems()]
    assert not failures, failures[:10]
    metrics = assert_idle(server.base_url)
    rss_after = rss_bytes(server.process.pid)
    assert rss_after - rss_before < RSS_GROWTH_BOUND, (rss_before, rss_after)
    finished = finished_count(metrics) - finished_count(before_metrics)
    assert finished == len(workload)  # each finished once, none as an abort or error
    return {"requests": len(measured), "rss_growth_mib": (rss_after - rss_before) / 2**20,
            "preemptions": metrics["kvserve:num_preemptions_total"]}


def _server(tmp_path, tiny_model_dir, kv_blocks: int):
    return ServerProcess(tiny_server_flags(tiny_model_dir, kv_blocks=kv_blocks),
                         log_path=tmp_path / "server.log")


def test_load_quick(tmp_path, tiny_model_dir):
    with _server(tmp_path, tiny_model_dir, kv_blocks=1024) as server:
        figures = soak(server, count=48, concurrency=16, seed=1)
    assert server.exit_code == 0
    print("quick load:", figures)


@pytest.mark.soak
def test_load_soak_256_clients_2000_requests(tmp_path, tiny_model_dir):
    # 4,096 blocks hold ~65k tokens: 256 clients with long prompts and n = 3 overflow it, so the
    # soak also runs through preemption and resumption.
    with _server(tmp_path, tiny_model_dir, kv_blocks=4096) as server:
        figures = soak(server, count=2000, concurrency=256, seed=2)
    assert server.exit_code == 0
    print("soak:", figures)
