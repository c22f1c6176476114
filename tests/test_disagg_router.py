"""`kvserve router --prefill ... --decode ...`: disaggregated prefill/decode behind the router,
on real servers (the tiny model, process cores).

Greedy text through the router equals one aggregated server's (float32 and the default dtype),
streamed or not, completions and chat; usage reports the transferred prompt tokens; every
server ends idle with no KV block in use. Faults: the prefill server killed with -9 while a
decode server pulls from it (the `kv_send` fault holds the pull open) and while another request
streams from the decode server; decode servers killed before they pull (the router retries
the next with the same handle; with none left the client gets a clean error and the prefill
server frees the held blocks after its hold timeout).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from kvserve.testing.server import ServerProcess, kv_events_config
from tests.helpers import (
    kill_server_tree,
    read_metrics,
    tiny_server_flags,
    wait_idle,
    wait_router_synced,
)

pytestmark = pytest.mark.multiprocess

PROMPTS = [f"Session {i}: tell me about the rivers of country number {i}. " * (1 + i % 4)
           for i in range(16)]
PREFILL_HEADER = "x-kvserve-prefill-replica"
TRANSFER_TIMEOUT_S = 2
HOLD_TIMEOUT_S = 2


def _server(model_dir, tmp_path, role: str, name: str, default_dtype: bool, env=None):
    extra = {"prefill": {"hold_timeout_s": HOLD_TIMEOUT_S},
             "decode": {"transfer_timeout_s": TRANSFER_TIMEOUT_S}}[role]
    flags = tiny_server_flags(model_dir, "--kv-role", role,
                              "--kv-events-config", kv_events_config(), "--kv-transfer-config",
                              json.dumps({"kv_connector_extra_config": extra}), kv_blocks=512)
    if default_dtype:  # the model's own dtype instead of float32
        at = flags.index("--dtype")
        del flags[at:at + 2]
    return ServerProcess(flags, log_path=tmp_path / f"{name}.log", env=env)


@contextmanager
def _deployment(model_dir, tmp_path, num_decode: int = 1, default_dtype: bool = False,
                router_flags=()):
    """Prefill server, decode servers (all started at once) and the router over them."""
    prefill = _server(model_dir, tmp_path, "prefill", "prefill", default_dtype,
                      env={"KVSERVE_PLUGINS": "kvserve.testing.faults:register"})
    decodes = [_server(model_dir, tmp_path, "decode", f"decode{i}", default_dtype)
               for i in range(num_decode)]
    with ExitStack() as stack:
        for server in (prefill, *decodes):
            server.start()
        for server in (prefill, *decodes):
            stack.enter_context(server)
        args = ["--model", str(model_dir), "--health-interval", "0.5", "--seed", "0",
                "--disable-log-requests", "--prefill", prefill.base_url, *router_flags]
        for decode in decodes:
            args += ["--decode", decode.base_url]
        router = stack.enter_context(ServerProcess(args, subcommand="router",
                                                   startup_timeout=60,
                                                   log_path=tmp_path / "router.log"))
        wait_router_synced(router)
        yield prefill, decodes, router


def _body(prompt: str, max_tokens: int = 12, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def _streamed_text(client: httpx.Client, url: str, body: dict) -> tuple[str, dict]:
    text, usage = "", {}
    with client.stream("POST", url, json={**body, "stream": True,
                                          "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += "".join(c.get("text", "") for c in chunk.get("choices", []))
            usage = chunk.get("usage") or usage
    return text, usage


def _assert_idle(*servers) -> None:
    for server in servers:
        metrics = wait_idle(server.base_url, timeout=HOLD_TIMEOUT_S + 10)
        assert metrics["kvserve:kv_cache_usage_perc"] == 0, (server.base_url, metrics)
        assert metrics["kvserve:num_requests_running"] == 0
        assert metrics["kvserve:num_requests_waiting"] == 0


@pytest.mark.parametrize("default_dtype", [False, True], ids=["float32", "default-dtype"])
def test_disaggregated_behind_the_router_equals_one_server(tiny_model_dir, tmp_path,
                                                           default_dtype):
    with _deployment(tiny_model_dir, tmp_path, default_dtype=default_dtype) as (
            prefill, (decode,), router), \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        for i, prompt in enumerate(PROMPTS):
            # one aggregated server: the prefill server without a handle (asking the decode
            # server would cache the prompt there, and the router would let it prefill)
            expected = httpx.post(prefill.base_url + "/v1/completions", json=_body(prompt),
                                  timeout=60).json()
            if i % 4 == 3:
                text, usage = _streamed_text(client, "/v1/completions", _body(prompt))
            else:
                response = client.post("/v1/completions", json=_body(prompt))
                assert response.status_code == 200, response.text
                assert response.headers[PREFILL_HEADER] == prefill.base_url
                assert response.headers["x-kvserve-replica"] == decode.base_url
                text, usage = response.json()["choices"][0]["text"], response.json()["usage"]
            assert text == expected["choices"][0]["text"], i
            assert usage["prompt_tokens_details"]["transferred_tokens"] == \
                usage["prompt_tokens"] - 1
        chat = {"messages": [{"role": "user", "content": "Say something about rivers."}],
                "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        expected = httpx.post(prefill.base_url + "/v1/chat/completions", json=chat,
                              timeout=60).json()
        got = client.post("/v1/chat/completions", json=chat).json()
        assert got["choices"][0]["message"] == expected["choices"][0]["message"]
        assert got["usage"]["prompt_tokens_details"]["transferred_tokens"] > 0
        metrics = read_metrics(router.base_url)
        assert metrics["kvserve_router:remote_prefills_total"] == len(PROMPTS) + 1
        _assert_idle(prefill, decode)


def test_short_prompts_and_several_choices_are_prefilled_on_the_decode_server(
        tiny_model_dir, tmp_path):
    with _deployment(tiny_model_dir, tmp_path, router_flags=(
            "--max-local-prefill-length", "40")) as (prefill, (decode,), router), \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        short = client.post("/v1/completions", json=_body("A short one.")).json()
        assert short["usage"]["prompt_tokens_details"]["transferred_tokens"] == 0
        long = client.post("/v1/completions", json=_body(PROMPTS[3])).json()
        assert long["usage"]["prompt_tokens"] > 40
        assert long["usage"]["prompt_tokens_details"]["transferred_tokens"] > 0
        two = client.post("/v1/completions", json=_body(PROMPTS[7], n=2)).json()
        assert len(two["choices"]) == 2
        assert two["usage"]["prompt_tokens_details"]["transferred_tokens"] == 0
        bad = client.post("/v1/completions", json=_body(PROMPTS[5], max_tokens=0))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        metrics = read_metrics(router.base_url)
        assert metrics["kvserve_router:remote_prefills_total"] == 1
        _assert_idle(prefill, decode)


def test_prefill_server_killed_during_a_transfer_and_a_stream(tiny_model_dir, tmp_path):
    """A stream is decoding on the decode server while a second request's pull hangs on the
    prefill server (`kv_send` fault); the prefill server is killed with -9. The stream ends
    whole, the hung pull times out and the decode server recomputes, later requests are
    prefilled on the decode server; nothing is left in use."""
    with _deployment(tiny_model_dir, tmp_path) as (prefill, (decode,), router):
        hung_prompt = "kvserve-fault:kv_send " + PROMPTS[2]
        expected = httpx.post(prefill.base_url + "/v1/completions", timeout=60,
                              json=_body(hung_prompt)).json()["choices"][0]["text"]

        async def scenario():
            async with httpx.AsyncClient(base_url=router.base_url, timeout=60) as client:
                stream = asyncio.ensure_future(asyncio.to_thread(
                    _streamed_text, httpx.Client(base_url=router.base_url, timeout=60),
                    "/v1/completions", _body(PROMPTS[1], max_tokens=400)))
                await _until(decode.base_url, "kvserve:num_requests_running", 1)
                hung = asyncio.ensure_future(client.post("/v1/completions",
                                                         json=_body(hung_prompt)))
                await _until(decode.base_url, "kvserve:num_requests_waiting", 1)
                kill_server_tree(prefill)
                killed = time.monotonic()
                (text, usage), answer = await asyncio.wait_for(asyncio.gather(stream, hung), 30)
                return text, usage, answer, time.monotonic() - killed

        text, usage, answer, seconds = asyncio.run(scenario())
        assert usage["completion_tokens"] == 400 and text
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected
        assert answer.json()["usage"]["prompt_tokens_details"]["transferred_tokens"] == 0
        assert seconds < TRANSFER_TIMEOUT_S + 10
        with httpx.Client(base_url=router.base_url, timeout=60) as client:
            for prompt in PROMPTS[:3]:  # the prefill server is gone: prefilled on decode
                got = client.post("/v1/completions", json=_body(prompt))
                assert got.status_code == 200, got.text
                assert got.json()["usage"]["prompt_tokens_details"]["transferred_tokens"] == 0
            assert client.get("/health").status_code == 200
        metrics = read_metrics(router.base_url)
        assert metrics["kvserve_router:local_prefills_total"] >= 3
        _assert_idle(decode)


def test_decode_servers_killed_before_they_pull(tiny_model_dir, tmp_path):
    """Round-robin over two decode servers, the router not told they died (long health
    interval). The first is killed: the request goes to the second with the same handle. The
    second is killed too: the client gets a clean 502 at once, and the prefill server frees
    the blocks it held for a pull that never came within its hold timeout."""
    with _deployment(tiny_model_dir, tmp_path, num_decode=2, router_flags=(
            "--policy", "round-robin", "--health-interval", "60")) as (
            prefill, (first, second), router), \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        kill_server_tree(first)
        got = client.post("/v1/completions", json=_body(PROMPTS[4]))
        assert got.status_code == 200, got.text
        assert got.headers["x-kvserve-replica"] == second.base_url
        assert got.json()["usage"]["prompt_tokens_details"]["transferred_tokens"] > 0
        kill_server_tree(second)
        started = time.monotonic()
        failed = client.post("/v1/completions", json=_body(PROMPTS[6]))
        assert failed.status_code == 502 and failed.json()["error"]["code"] == \
            "replica_unavailable"
        assert time.monotonic() - started < 5
        assert client.get("/health").status_code == 503
        started = time.monotonic()
        _assert_idle(prefill)  # the held blocks: freed by the hold timeout
        assert time.monotonic() - started < HOLD_TIMEOUT_S + 5


async def _until(base_url: str, metric: str, at_least: float) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = (await client.get("/metrics")).text
            values = [float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith(metric)]
            if values and values[0] >= at_least:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{base_url}: {metric} never reached {at_least}")
