"""The OpenAI-compatible server, end to end against a real `kvserve serve` subprocess serving
the real model in float32, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.testing.server import ServerProcess
from tests.helpers import finished_count, read_metrics, wait_idle

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

# a 256-token step budget chunks long prompts, so a disconnect lands mid-prefill
SERVER_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks", "400",
                "--max-num-batched-tokens", "256", "--served-model-name", "smol"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(SERVER_FLAGS, log_path=log) as process:
        yield process
    assert process.exit_code == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


CHAT = [{"role": "user", "content": "Name three colors."}]


def test_chat_non_streaming(client):
    response = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=12,
                                              temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 12
    assert response.usage.total_tokens == (response.usage.prompt_tokens
                                           + response.usage.completion_tokens)


def test_chat_streaming_matches_non_streaming(client):
    full = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=16,
                                          temperature=0).choices[0].message.content
    stream = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full
    assert finish in ("stop", "length") and usage.completion_tokens > 0


def test_completions_stream_and_not(client):
    text = client.completions.create(model="smol", prompt="The capital of France is",
                                     max_tokens=8, temperature=0).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=8, temperature=0,
        stream=True) if c.choices)
    assert text == streamed and text


def test_n_and_stop_and_logprobs(client):
    response = client.completions.create(model="smol", prompt="Count: one, two,", n=2,
                                         max_tokens=12, temperature=0.8, seed=3, stop=[","],
                                         logprobs=2)
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert "," not in choice.text
        assert choice.finish_reason in ("stop", "length")
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy picks the top one


def test_seed_reproducibility(client):
    def sample():
        return client.completions.create(model="smol", prompt="Once upon a time",
                                         max_tokens=16, temperature=1.0, seed=1234).choices[0].text
    assert sample() == sample()


def test_cached_tokens_after_repeated_prefix(client):
    system = "You are a meticulous assistant. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    client.chat.completions.create(model="smol", messages=messages, max_tokens=2)
    again = client.chat.completions.create(model="smol", messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64


def test_greedy_http_equals_offline(server):
    from kvserve import LLM, SamplingParams

    prompts = ["The quick brown fox", "def square(x):\n    return", "My favourite food is"]
    llm = LLM(dtype="float32", max_model_len=2048, num_kv_blocks=200)
    offline = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)]
    http = [httpx.post(server.base_url + "/v1/completions", json={
        "model": "smol", "prompt": p, "max_tokens": 20, "temperature": 0}, timeout=60
    ).json()["choices"][0]["text"] for p in prompts]
    assert http == offline


def test_disconnect_mid_stream_frees_everything(server):
    before = finished_count(read_metrics(server.base_url))
    with httpx.stream("POST", server.base_url + "/v1/completions", json={
            "model": "smol", "prompt": "Tell me a long story.", "max_tokens": 500,
            "ignore_eos": True, "stream": True}, timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(4)]
        assert any(line.startswith("data:") for line in received)
    metrics = wait_idle(server.base_url, finished_at_least=before + 1)
    assert finished_count(metrics) == before + 1
    assert metrics["kvserve:num_requests_running"] == 0
    assert metrics["kvserve:kv_cache_usage_perc"] == 0


def test_disconnect_mid_prefill_frees_everything(server):
    long_prompt = "word " * 1800
    before = finished_count(read_metrics(server.base_url))
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", json={
            "model": "smol", "prompt": long_prompt, "max_tokens": 100}, timeout=0.3)
    metrics = wait_idle(server.base_url, finished_at_least=before + 1)
    assert finished_count(metrics) == before + 1
    assert metrics["kvserve:num_requests_running"] == 0
    assert metrics["kvserve:num_requests_waiting"] == 0
    assert metrics["kvserve:kv_cache_usage_perc"] == 0


def test_32_concurrent_streams_complete(server):
    async def one(client: httpx.AsyncClient, i: int) -> int:
        tokens = 0
        async with client.stream("POST", "/v1/completions", json={
                "model": "smol", "prompt": f"Story number {i}:", "max_tokens": 8,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    payload = json.loads(line[6:])
                    if payload.get("usage"):
                        tokens = payload["usage"]["completion_tokens"]
        return tokens

    async def all_of_them():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(all_of_them()) == [8] * 32


def test_metrics_parse_and_move(server):
    before = read_metrics(server.base_url)
    httpx.post(server.base_url + "/v1/completions", json={
        "model": "smol", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}, timeout=60)
    after = read_metrics(server.base_url)
    assert after["kvserve:generation_tokens_total"] - before[
        "kvserve:generation_tokens_total"] == 5
    assert after["kvserve:prompt_tokens_total"] > before["kvserve:prompt_tokens_total"]
    assert after["kvserve:request_success_total"] == before["kvserve:request_success_total"] + 1
    assert after["kvserve:time_to_first_token_seconds_count"] > before[
        "kvserve:time_to_first_token_seconds_count"]
    assert after["kvserve:e2e_request_latency_seconds_count"] > before[
        "kvserve:e2e_request_latency_seconds_count"]
    for name in ("kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total",
                 "kvserve:num_preemptions_total", "kvserve:inter_token_latency_seconds_count",
                 "kvserve:request_queue_time_seconds_count", "kvserve:request_prompt_tokens_count",
                 "kvserve:request_generation_tokens_count"):
        assert name in after
