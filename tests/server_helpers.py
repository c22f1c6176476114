"""Helpers for end-to-end server tests."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def read_metrics(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """Sample name -> value (summed over label sets), parsed with prometheus_client."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def finished_by_reason(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """kvserve:request_success_total per finished_reason label (stop, length, abort, error)."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    reasons: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvserve:request_success_total":
                reason = sample.labels["finished_reason"]
                reasons[reason] = reasons.get(reason, 0.0) + sample.value
    return reasons


def finished_count(metrics: dict[str, float]) -> float:
    return metrics.get("kvserve:request_success_total", 0.0)


def wait_idle(base_url: str, timeout: float = 3.0, headers: dict | None = None,
              finished_at_least: float = 0.0) -> dict:
    """Poll /metrics until nothing runs, nothing waits, no KV block is in use, and at least
    `finished_at_least` requests have finished (aborts included)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(base_url, headers)
        idle = (metrics["kvserve:num_requests_running"] == 0
                and metrics["kvserve:num_requests_waiting"] == 0
                and metrics["kvserve:kv_cache_usage_perc"] == 0
                and finished_count(metrics) >= finished_at_least)
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def tiny_server_flags(model_dir, *extra: str, kv_blocks: int = 1024,
                      max_model_len: int = 2048) -> list[str]:
    """`kvserve serve` flags for the tiny random model in float32."""
    return ["--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks", str(kv_blocks),
            "--max-model-len", str(max_model_len), "--disable-log-requests", *extra]


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def assert_idle(base_url: str, timeout: float = 30.0, headers: dict | None = None,
                quiet_seconds: float = 0.5) -> dict:
    """Wait for idle metrics, assert them, and check no zombie keeps generating tokens."""
    metrics = wait_idle(base_url, timeout=timeout, headers=headers)
    assert metrics["kvserve:num_requests_running"] == 0, metrics
    assert metrics["kvserve:num_requests_waiting"] == 0, metrics
    assert metrics["kvserve:kv_cache_usage_perc"] == 0, metrics
    time.sleep(quiet_seconds)
    later = read_metrics(base_url, headers)
    assert later["kvserve:generation_tokens_total"] == metrics["kvserve:generation_tokens_total"]
    return later


async def complete(client, prompt: str, stream: bool = False, max_tokens: int = 8):
    """A greedy /v1/completions call: (status, JSON body), or (status, the SSE data lines)
    when streaming."""
    payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": stream}
    if not stream:
        response = await client.post("/v1/completions", json=payload)
        return response.status_code, response.json()
    events = []
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return response.status_code, events
