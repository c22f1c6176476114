"""`kvserve router` in front of two real replicas (the tiny model; one with a process core, one
with a thread core, both publishing KV events): sessions stick to the replica holding their
prefix under kv-aware (and every placement is the best one by the replicas' own count), round-
robin alternates, chat and streaming pass through, replica errors pass through, and a replica
killed with -9 costs no client more than a clean error: requests it had not answered are
retried on the survivor, which then serves everything. The thread-core replica speculates
(prompt-lookup drafts, every one verified): through the router it answers with the other's
tokens, and its draft counts reach the client in `usage`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from contextlib import contextmanager

import httpx
import pytest

from kvserve.testing.server import ServerProcess, kv_events_config
from kvserve.testing.sessions import interleaved_sessions
from tests.helpers import read_metrics, tiny_server_flags, wait_gone, wait_router_synced

pytestmark = pytest.mark.multiprocess

# the next turn of a session comes after its events reached the router: they leave the engine
# within ~15 ms of the step that cached the blocks (docs/architecture.md)
THINK_SECONDS = 0.3
DEADLINE_SECONDS = 20


SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                          "prompt_lookup_min": 1, "adaptive": False})


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    servers = [ServerProcess(tiny_server_flags(tiny_model_dir, "--engine-core", core,
                                               "--kv-events-config", kv_events_config(),
                                               *extra, kv_blocks=512))
               for core, extra in (("process", ()),
                                   ("thread", ("--speculative-config", SPECULATIVE)))]
    for server in servers:  # both load at once
        server.start()
    for server in servers:
        server.__enter__()
    yield servers
    for server in servers:
        server.stop()


@contextmanager
def running_router(model_dir, replicas, policy: str):
    args = ["--model", str(model_dir), "--policy", policy, "--health-interval", "0.5",
            "--measure-placement", "--seed", "0", "--disable-log-requests"]
    for replica in replicas:
        args += ["--replica", replica.base_url]
    with ServerProcess(args, subcommand="router", startup_timeout=60) as router:
        wait_router_synced(router)
        yield router


def _complete(client: httpx.Client, prompt: str, max_tokens: int = 8, stream: bool = False):
    """(replica, text) of a greedy completion through the router."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.headers["x-kvserve-replica"], response.json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        replica = response.headers["x-kvserve-replica"]
    assert data[-1] == "[DONE]"
    return replica, "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]
                            if json.loads(d)["choices"])


def _placements(router) -> dict[str, float]:
    metrics = read_metrics(router.base_url)
    return {name: metrics[f"kvserve_router:placement_{name}_total"]
            for name in ("decisions", "best", "index_exact")}


def test_kv_aware_sessions_stick_to_their_prefix(tiny_model_dir, replicas):
    sessions = [f"Session {s}. " + " ".join(f"fact{s}-{i}" for i in range(40))
                for s in range(4)]
    with running_router(tiny_model_dir, replicas, "kv-aware") as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        placed: dict[int, list[str]] = {}
        histories = list(sessions)
        for turn in range(3):
            for s in range(len(sessions)):
                histories[s] += f"\nUser: question {turn}?\nAssistant:"
                replica, text = _complete(client, histories[s], stream=turn == 2)
                histories[s] += text
                placed.setdefault(s, []).append(replica)
            time.sleep(THINK_SECONDS)
        for s, chosen in placed.items():
            assert chosen == [chosen[0]] * 3, (s, placed)
        placements = _placements(router)
        assert placements["decisions"] == 12
        assert placements["best"] == 12, placements  # always a replica holding the most
        assert placements["index_exact"] == 12, placements  # the index knew exactly
        state = client.get("/router/state").json()["replicas"]
        assert all(r["fresh"] and r["resyncs"] == 1 for r in state.values()), state
        assert all(state[c[0]]["indexed_blocks"] > 0 for c in placed.values()), state


def test_kv_aware_chat_follows_the_chat_template(tiny_model_dir, replicas):
    """The router renders the chat template as the server does: its index overlap for the
    second turn is exact, and the turn goes where the first one ran."""
    messages = [{"role": "system", "content": "You answer in riddles. " * 12},
                {"role": "user", "content": "Where is the library?"}]
    with running_router(tiny_model_dir, replicas, "kv-aware") as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        first = client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        answer = first.json()["choices"][0]["message"]["content"]
        time.sleep(THINK_SECONDS)
        body["messages"] = messages + [{"role": "assistant", "content": answer},
                                       {"role": "user", "content": "And then?"}]
        body["stream"] = True
        with client.stream("POST", "/v1/chat/completions", json=body) as second:
            assert second.status_code == 200
            lines = [line for line in second.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert second.headers["x-kvserve-replica"] == first.headers["x-kvserve-replica"]
        assert _placements(router) == {"decisions": 2, "best": 2, "index_exact": 2}


def test_kv_aware_hashes_a_cache_salt_as_the_replicas_do(tiny_model_dir, replicas):
    """A salted session's second turn goes where its first ran, and the router's index knew
    exactly what that replica holds (the probe asks under the same salt); the same prompt
    under another salt holds nothing anywhere."""
    prompt = "Salted session. " + " ".join(f"item{i}" for i in range(40))
    with running_router(tiny_model_dir, replicas, "kv-aware") as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "cache_salt": "user-7"}
        first = client.post("/v1/completions", json=body)
        time.sleep(THINK_SECONDS)
        body["prompt"] = prompt + first.json()["choices"][0]["text"] + " and more"
        second = client.post("/v1/completions", json=body)
        assert second.headers["x-kvserve-replica"] == first.headers["x-kvserve-replica"]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        other = client.post("/v1/completions", json={**body, "cache_salt": "user-8"})
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _placements(router) == {"decisions": 3, "best": 3, "index_exact": 3}


def test_round_robin_alternates_and_errors_pass_through(tiny_model_dir, replicas):
    urls = [replica.base_url for replica in replicas]
    with running_router(tiny_model_dir, replicas, "round-robin") as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        answers = [_complete(client, "The same prompt every time.", max_tokens=24)
                   for _ in range(4)]
        assert [replica for replica, _ in answers] == urls + urls
        assert len({text for _, text in answers}) == 1  # drafts or not, the same tokens
        body = {"prompt": "one two one two one two one two", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}
        usage = {}
        for _ in range(2):  # one goes to each replica
            response = client.post("/v1/completions", json=body)
            usage[response.headers["x-kvserve-replica"]] = response.json()["usage"]
        details = usage[urls[1]]["completion_tokens_details"]  # the speculator's
        assert details["accepted_prediction_tokens"] > 0
        # the replica's own 400 and 404, status and body as it sent them
        bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        missing = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        assert client.post("/v1/completions", content=b"{not json").status_code == 400
        models = client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["object"] == "model"


def test_bench_multi_turn_reports_hit_rate_and_placement_through_the_router(
        tiny_model_dir, replicas, tmp_path, capsys):
    """The benchmark driver end to end on a toy load (not a measurement): it finds the
    replicas behind the router, and reports their hit rate and the router's placements."""
    from kvserve.cli import main

    with running_router(tiny_model_dir, replicas, "kv-aware") as router:
        output = tmp_path / "multi-turn.json"
        assert main(["bench", "serve", "--base-url", router.base_url, "--model",
                     str(tiny_model_dir), "--tokenizer", str(tiny_model_dir), "--workload",
                     "multi-turn", "--num-prompts", "3", "--turns", "2", "--input-len", "20",
                     "--output-len", "4", "--system-prompt-len", "40", "--no-progress",
                     "--output-json", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "prefix-cache hit rate" in printed and "placement:" in printed
    summary = json.loads(output.read_text())["summary"]
    assert summary["completed"] == 6
    assert summary["server"]["placement_decisions"] == 6
    assert summary["server"]["prefix_cache_hits"] > 0  # the shared system prompt at least
    assert summary["ttft_later_turns_s"]["p50"] > 0


async def _stream_outcome(client: httpx.AsyncClient, prompt: str) -> tuple[int, list[str]]:
    body = {"prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    return response.status_code, lines


async def _until_generating(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = (await client.get("/metrics")).text
            running = [line for line in text.splitlines()
                       if line.startswith("kvserve:num_requests_running")]
            if running and float(running[0].split()[-1]) >= 2:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the replica never ran both requests")


def test_a_replica_killed_behind_the_router(tiny_model_dir, replicas):  # last: kills one
    """Round-robin puts a stream and a plain request on the first replica, which is killed
    with -9 mid-generation: the plain request (not answered yet) is retried on the survivor;
    the stream ends at once, with an SSE error event and [DONE] if it had begun (else it was
    retried too); later requests all go to the survivor; the router stays healthy."""
    victim, survivor = replicas
    with running_router(tiny_model_dir, replicas, "round-robin") as router:
        async def scenario():
            async with httpx.AsyncClient(base_url=router.base_url, timeout=60) as client:
                stream = asyncio.ensure_future(_stream_outcome(client, "A long story."))
                await asyncio.sleep(0.2)
                short = await client.post("/v1/completions", json={
                    "prompt": "Short.", "max_tokens": 4, "temperature": 0})
                plain = asyncio.ensure_future(client.post("/v1/completions", json={
                    "prompt": "Another long story.", "max_tokens": 1500, "temperature": 0,
                    "ignore_eos": True}))
                await _until_generating(victim.base_url)
                os.kill(victim.process.pid, signal.SIGKILL)
                killed = time.monotonic()
                (status, lines), answer = await asyncio.wait_for(
                    asyncio.gather(stream, plain), DEADLINE_SECONDS)
                return short, status, lines, answer, time.monotonic() - killed

        short, status, lines, answer, seconds = asyncio.run(scenario())
        assert short.headers["x-kvserve-replica"] == survivor.base_url
        assert seconds < DEADLINE_SECONDS
        assert answer.status_code == 200, answer.text  # retried on the survivor
        assert answer.headers["x-kvserve-replica"] == survivor.base_url
        assert answer.json()["usage"]["completion_tokens"] == 1500
        assert status == 200 and lines[-1] == "data: [DONE]"
        payloads = [json.loads(line[6:]) for line in lines[:-1]]
        finished = any(c.get("finish_reason") for p in payloads for c in p.get("choices", []))
        failed = any("error" in p for p in payloads)
        assert finished != failed, payloads[-2:]  # a whole answer (retried) or a clean error
        with httpx.Client(base_url=router.base_url, timeout=60) as client:
            after = [_complete(client, f"After the kill {i}.")[0] for i in range(4)]
            assert after == [survivor.base_url] * 4
            assert client.get("/health").json() == {"healthy_replicas": [survivor.base_url]}
            state = client.get("/router/state").json()["replicas"][victim.base_url]
            assert not state["healthy"] and state["indexed_blocks"] == 0
        assert wait_gone(victim.process.pid)


# ---- replicas started with defaults -------------------------------------------------------------
@pytest.mark.parametrize("events", ["default", "disabled"])
def test_router_over_replicas_started_with_defaults_caches_the_sessions(tiny_model_dir, events):
    """Replicas with nothing said about KV events publish them (free loopback ports,
    /kv_events_info); replicas told not to are guessed from what the router sent them. Either
    way six interleaved sessions find most of their earlier context cached."""
    extra = () if events == "default" else ("--kv-events-config",
                                            '{"enable_kv_cache_events": false}')
    servers = [ServerProcess(tiny_server_flags(tiny_model_dir, *extra)) for _ in range(2)]
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.__enter__()
        args = ["--model", str(tiny_model_dir), "--health-interval", "0.5",
                "--disable-log-requests"]
        for server in servers:
            args += ["--replica", server.base_url]
        with ServerProcess(args, subcommand="router", startup_timeout=60) as router:
            deadline = time.monotonic() + DEADLINE_SECONDS
            while True:
                state = httpx.get(router.base_url + "/router/state").json()["replicas"]
                ready = [s["healthy"] and (s["synced"] if events == "default"
                                           else s["approximate_index"])
                         for s in state.values()]
                if all(ready):
                    break
                assert time.monotonic() < deadline, state
                time.sleep(0.1)
            assert all(s["kv_events"] == (events == "default") for s in state.values())
            share = interleaved_sessions(router.base_url, think_seconds=THINK_SECONDS)
    finally:
        for server in servers:
            server.stop()
    assert share >= (0.85 if events == "default" else 0.80), share
