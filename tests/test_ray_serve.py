"""Engine replicas on Ray Serve (kvserve/ray_serve/).

Without a cluster: KVAwareRequestRouter's `choose_replicas` on replica-like objects, with real
ZeroMQ publishers and block pools behind its subscriber (the prefix holder ranks first, load
moves a request off it, a removed replica's entries go; round-robin; least-loaded with another
ingress's load from routing stats); the request object Ray's PrefixCacheAffinityRouter reads;
`build_app`'s arguments.

End to end, on one local Ray instance for the module: `kvserve serve --replicas 2` (the real
CLI, connected through RAY_ADDRESS) with the tiny model: greedy answers equal the in-process
engine's, streaming and errors pass through, sessions stick to the replica that caches their
prefix under kv-aware (the engine's own cached-token count says so), the bench reads hit rates
through /router/state, a replica actor killed mid-request costs no client more than a clean
error within seconds and Serve replaces it, SIGTERM deletes the app; then Ray's
PrefixCacheAffinityRouter serves the same app deployed through `build_app`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from kvserve import SamplingParams
from kvserve.ray_serve.request import OpenAIRequest
from kvserve.testing.server import ServerProcess, free_port
from tests.helpers import (
    EVENT_BLOCK,
    RAW_PROMPTS,
    cache_tokens,
    kv_event_publisher,
    read_metrics,
    tiny_server_flags,
    wait_until,
)

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve.request_router", reason="needs kvserve[ray] (ray[serve])")

from ray.serve._private.common import (  # noqa: E402 - after the skip
    DeploymentHandleSource,
    DeploymentID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402

from kvserve.ray_serve.router import KVAwareRequestRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="test")
COMPLETIONS = "/v1/completions"


# ---- the router, without a cluster ------------------------------------------------------------
class ReplicaLike:
    """What the router reads of Ray Serve's RunningReplica."""

    def __init__(self, name: str, kv_events: dict | None = None, stats: dict | None = None):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.replica_metadata = {"kv_events": kv_events} if kv_events else {}
        self.routing_stats = stats or {}
        self.max_ongoing_requests = 8
        self.node_id = self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _pending(request_id: str, body: dict, path: str = COMPLETIONS) -> PendingRequest:
    request = OpenAIRequest(path, json.dumps(body).encode(), [])
    return PendingRequest(args=[request], kwargs={},
                          metadata=RequestMetadata(request_id=request_id,
                                                   internal_request_id=request_id))


def _router(model_dir, policy: str) -> KVAwareRequestRouter:
    router = KVAwareRequestRouter(deployment_id=DEPLOYMENT,
                                  handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(model=str(model_dir), policy=policy, seed=0)
    return router


def _names(tiers) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in tier] for tier in tiers]


def _events_info(pub_port: int, replay_port: int) -> dict:
    return {"enabled": True, "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "",
            "block_size": EVENT_BLOCK}


def test_kv_aware_ranks_the_prefix_holder_first_until_its_load_outweighs_it(tiny_model_dir,
                                                                             tokenizer):
    prompt = "The replica that computed this prompt keeps its blocks: " * 3
    token_ids = tokenizer.encode(prompt)
    ports = {name: (free_port(), free_port()) for name in "ab"}
    publishers = {name: kv_event_publisher(*ports[name]) for name in "ab"}
    cache_tokens(*publishers["a"], token_ids)  # a holds the prompt's blocks
    cache_tokens(*publishers["b"], list(range(1000, 1040)))  # b holds something else
    router = _router(tiny_model_dir, "kv-aware")
    a, b = (ReplicaLike(name, _events_info(*ports[name])) for name in "ab")
    prompt_blocks = len(token_ids) // EVENT_BLOCK

    async def scenario():
        router.update_replicas([a, b])
        wait_until(lambda: router.subscriber.fresh("a", 3.0) and router.subscriber.fresh("b", 3.0)
              and router.index.num_blocks("a") >= prompt_blocks)
        first = _pending("first", {"prompt": prompt, "max_tokens": 4})
        tiers = await router.choose_replicas([b, a], first)
        assert _names(tiers) == [["a"], ["b"]]
        assert first.routing_context.should_backoff  # every replica ranked: back off after
        assert router.overlaps([a, b], token_ids) == {"a": prompt_blocks, "b": 0}
        # under another salt the same prompt is other blocks: nothing cached anywhere
        assert router.overlaps([a, b], token_ids, "t2") == {"a": 0, "b": 0}
        # b holds the same prompt under tenant t2's salt: a t2 request goes to b, a plain one
        # to a (a salted request's blocks are hashed under its salt, as the replicas do)
        cache_tokens(*publishers["b"], token_ids, cache_salt="t2")
        wait_until(lambda: router.overlaps([b], token_ids, "t2")["b"] == prompt_blocks)
        assert router.overlaps([a, b], token_ids, "t2") == {"a": 0, "b": prompt_blocks}
        salted = _pending("salted", {"prompt": prompt, "max_tokens": 4, "cache_salt": "t2"})
        assert _names(await router.choose_replicas([a, b], salted)) == [["b"], ["a"]]
        plain = _pending("plain", {"prompt": prompt, "max_tokens": 4})
        assert _names(await router.choose_replicas([a, b], plain)) == [["a"], ["b"]]
        # requests routed to a and not finished: its blocks in use outweigh the cache hit
        for serial in range(3):
            routed = _pending(f"busy-{serial}", {"prompt": prompt, "max_tokens": 4})
            await router.choose_replicas([a, b], routed)
            router.on_request_routed(routed, a.replica_id, None)
        assert router.active_blocks(a, time.time()) == 3 * (prompt_blocks + 1)
        tiers = await router.choose_replicas([a, b], _pending("second", {"prompt": prompt}))
        assert _names(tiers) == [["b"], ["a"]]
        for serial in range(3):
            router.on_request_completed(a.replica_id, f"busy-{serial}")
        tiers = await router.choose_replicas([a, b], _pending("third", {"prompt": prompt}))
        assert _names(tiers) == [["a"], ["b"]]
        # a chat is tokenized through the chat template; no overlap -> ranked by load alone
        chat = _pending("chat", {"messages": [{"role": "user", "content": "hi"}]},
                        "/v1/chat/completions")
        assert sorted(_names(await router.choose_replicas([a, b], chat))) == [["a"], ["b"]]
        router.update_replicas([b])  # a left: its entries go
        wait_until(lambda: router.index.num_blocks("a") == 0)
        assert _names(await router.choose_replicas([b], _pending("last", {"prompt": prompt}))) \
            == [["b"]]

    try:
        asyncio.run(scenario())
    finally:
        router.subscriber.close()
        for _, source in publishers.values():
            source.close()


def test_round_robin_alternates_and_least_loaded_counts_other_ingresses(tiny_model_dir):
    a, b = ReplicaLike("a"), ReplicaLike("b")

    async def round_robin():
        router = _router(tiny_model_dir, "round-robin")
        firsts = [_names(await router.choose_replicas([b, a], _pending(str(i), {})))[0][0]
                  for i in range(4)]
        router.subscriber.close()
        return firsts

    firsts = asyncio.run(round_robin())
    assert firsts in (["a", "b", "a", "b"], ["b", "a", "b", "a"])

    async def least_loaded():
        router = _router(tiny_model_dir, "least-loaded")
        now = time.time()
        # another ingress keeps 50 blocks busy on a (its stats are recent), b is idle
        a.routing_stats = {"time": now, "kv_blocks_used": 50}
        order = _names(await router.choose_replicas([a, b], _pending("x", {"prompt": "x"})))
        a.routing_stats = {"time": now - 60, "kv_blocks_used": 50}  # stale: not counted
        for serial in range(2):  # ours: two requests on b
            routed = _pending(f"b{serial}", {"prompt": "x"})
            await router.choose_replicas([a, b], routed)
            router.on_request_routed(routed, b.replica_id, None)
        later = _names(await router.choose_replicas([a, b], _pending("y", {"prompt": "x"})))
        router.subscriber.close()
        return order, later

    order, later = asyncio.run(least_loaded())
    assert order == [["b"], ["a"]]
    assert later == [["a"], ["b"]]


def test_openai_request_shows_ray_the_prompt_text_only():
    from ray.serve._private.request_router.common import PendingRequest as Pending

    from kvserve.ray_serve.ray_prefix import TextPrefixCacheAffinityRouter

    completion = OpenAIRequest(COMPLETIONS, b'{"prompt": "Once upon", "stream": true}', [])
    chat = OpenAIRequest("/v1/chat/completions",
                         b'{"messages": [{"role": "user", "content": "hi"}]}', [])
    token_ids = OpenAIRequest(COMPLETIONS, b'{"prompt": [1, 2, 3]}', [])
    garbage = OpenAIRequest(COMPLETIONS, b"not json", [])
    assert completion.prompt == "Once upon" and completion.stream
    assert not hasattr(completion, "messages")
    assert chat.messages[0]["content"] == "hi" and not hasattr(chat, "prompt")
    assert not hasattr(token_ids, "prompt") and not hasattr(garbage, "prompt")
    assert not garbage.stream
    copy = pickle.loads(pickle.dumps(completion))
    assert "_payload" not in pickle.loads(pickle.dumps(copy)).__dict__
    assert (copy.method, copy.path, copy.body, copy.prompt) == ("POST", COMPLETIONS,
                                                                completion.body, "Once upon")
    # Ray's router takes the text it finds; none (token ids) -> its power-of-two fallback
    router = object.__new__(TextPrefixCacheAffinityRouter)
    metadata = RequestMetadata(request_id="r", internal_request_id="r")

    async def texts():
        return [router._extract_text_from_request(Pending([request], {}, metadata))
                for request in (completion, chat, token_ids)]

    assert asyncio.run(texts()) == ["Once upon", "hi", None]


def test_build_app_arguments_are_the_serve_flags():
    from kvserve.ray_serve.app import app_parser, args_to_argv, request_router_config
    from kvserve.ray_serve.config import RayServeConfig

    argv = args_to_argv({"model": "/m", "replicas": "4", "request_router": "prefix-cache-affinity",
                         "enable-prefix-caching": "false", "num_cpus_per_replica": 0.5,
                         "max_model_len": 512})
    assert argv[:2] == ["--model", "/m"] and "--no-enable-prefix-caching" in argv
    namespace = app_parser().parse_args(argv)
    assert (namespace.replicas, namespace.request_router, namespace.enable_prefix_caching,
            namespace.num_cpus_per_replica, namespace.max_model_len) == (
        4, "prefix-cache-affinity", False, 0.5, 512)
    with pytest.raises(SystemExit):
        app_parser().parse_args(args_to_argv({"request_router": "random"}))
    processors = app_parser().parse_args(args_to_argv(
        {"logits_processors": ["a.b:C", "d:E"]})).logits_processors  # a config file's list
    assert processors == ("a.b:C", "d:E")
    from kvserve.engine_config import EngineConfig

    ours = request_router_config(EngineConfig(model="/m"), RayServeConfig(overlap_weight=2.0))
    assert ours.request_router_class == "kvserve.ray_serve.router:KVAwareRequestRouter"
    assert ours.request_router_kwargs == {"model": "/m", "policy": "kv-aware",
                                          "overlap_weight": 2.0, "stale_after": 3.0}
    theirs = request_router_config(EngineConfig(), RayServeConfig(
        request_router="prefix-cache-affinity", request_router_kwargs='{"imbalanced_threshold":'
        ' 4}'))  # imports without vLLM or pyarrow
    assert theirs.request_router_class.endswith(":TextPrefixCacheAffinityRouter")
    assert theirs.request_router_kwargs == {"imbalanced_threshold": 4}
    with pytest.raises(ValueError):
        request_router_config(EngineConfig(), RayServeConfig(request_router_kwargs="[4]"))


# ---- end to end: kvserve serve --replicas 2 on a local Ray ------------------------------------
APP = "kvserve"
DEADLINE_SECONDS = 30


@pytest.fixture(scope="module")
def serving(ray_address, tiny_model_dir, tmp_path_factory):
    flags = tiny_server_flags(tiny_model_dir, "--replicas", "2", "--num-cpus-per-replica",
                              "0.5", "--request-router", "kv-aware", "--measure-placement",
                              kv_blocks=512)
    log = tmp_path_factory.mktemp("ray-serve") / "serve.log"
    server = ServerProcess(flags, startup_timeout=240, log_path=log,
                           env={"RAY_ADDRESS": ray_address})
    server.start()
    try:
        server._wait_healthy()
        _until_replicas(server.base_url, 2)
        yield server
    finally:
        server.stop()


def _current_replicas(base_url: str) -> dict[str, dict]:
    state = httpx.get(base_url + "/router/state", timeout=10).json()["replicas"]
    return {info["replica_id"]: info for info in state.values() if info.get("current")}


def _until_replicas(base_url: str, count: int, timeout: float = 60.0, gone: str | None = None):
    """Requests until the router knows `count` replicas, all in step with their events, and
    each has answered one (so the ingress knows where to probe it)."""
    deadline = time.monotonic() + timeout
    answered = set()
    for serial in itertools.count():
        response = httpx.post(base_url + COMPLETIONS, timeout=30,
                              json={"prompt": f"warm-up {serial}", "max_tokens": 1})
        answered.add(response.headers.get("x-kvserve-replica"))
        current = _current_replicas(base_url)
        if len(current) == count and gone not in current and set(current) <= answered \
                and all(r["synced"] and r["fresh"] for r in current.values()):
            return current
        assert time.monotonic() < deadline, (current, answered)
        time.sleep(0.2)


def _indexed_blocks(base_url: str) -> dict[str, int]:
    """Blocks the router's index holds, per current replica; a replica whose events the
    router does not count as fresh (a late heartbeat on a busy machine: its overlap then
    counts 0 and its sessions go by load) reads -1, so a wait for a steady index waits it
    out too."""
    return {replica: info["indexed_blocks"] if info.get("fresh", True) else -1
            for replica, info in _current_replicas(base_url).items()}


def _until_indexed(base_url: str, before: dict[str, int], served: set[str],
                   timeout: float = 20.0) -> dict[str, int]:
    """Waits until the index of every replica in `served` (those that answered since `before`)
    has grown and the whole index held still for a few polls: the KV events of the requests
    just answered have all arrived. (A fixed sleep lost this race on a busy 2-core machine,
    and so did waiting for the total to grow: one replica's events came, the other's had not,
    and a session's next turn went by load.)"""
    deadline = time.monotonic() + timeout
    history: list[dict[str, int]] = []
    while True:
        history.append(_indexed_blocks(base_url))
        grown = all(history[-1].get(r, 0) > before.get(r, 0) for r in served)
        if len(history) >= 3 and grown and history[-1] == history[-2] == history[-3]:
            return history[-1]
        assert time.monotonic() < deadline, history
        time.sleep(0.15)


def _complete(base_url: str, body: dict, path: str = COMPLETIONS):
    response = httpx.post(base_url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.headers["x-kvserve-replica"], response.json()


def _stream(base_url: str, body: dict, path: str = COMPLETIONS) -> tuple[str, list[str]]:
    with httpx.stream("POST", base_url + path, json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return response.headers["x-kvserve-replica"], data


@pytest.mark.multiprocess
def test_greedy_answers_equal_the_in_process_engine(serving, tiny_llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in tiny_llm.generate(RAW_PROMPTS, params,
                                                             use_tqdm=False)]
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(len(RAW_PROMPTS)) as pool:  # at once: both replicas batch
        answers = list(pool.map(lambda p: _complete(serving.base_url, {**body, "prompt": p}),
                                RAW_PROMPTS))
    assert [a[1]["choices"][0]["text"] for a in answers] == expected
    streamed = []
    for prompt in RAW_PROMPTS[:2]:
        _, data = _stream(serving.base_url, {**body, "prompt": prompt,
                                             "stream_options": {"include_usage": True}})
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        streamed.append("".join(c["choices"][0]["text"] for c in chunks if c["choices"]))
    assert streamed == expected[:2]
    _, data = _stream(serving.base_url, {"messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 4}, "/v1/chat/completions")
    assert data[-1] == "[DONE]" and json.loads(data[0])["object"] == "chat.completion.chunk"


@pytest.mark.multiprocess
def test_errors_and_models_pass_through(serving):
    response = httpx.post(serving.base_url + COMPLETIONS, json={"prompt": "x",
                                                                "max_tokens": -1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    assert response.headers["x-kvserve-replica"]
    response = httpx.post(serving.base_url + COMPLETIONS, json={"prompt": "x",
                                                                "model": "nope"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    response = httpx.post(serving.base_url + COMPLETIONS, content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    models = httpx.get(serving.base_url + "/v1/models", timeout=10).json()
    assert models["data"][0]["root"].endswith("tiny-model0")


@pytest.mark.multiprocess
def test_kv_aware_sessions_land_where_their_prefix_is_cached(serving):
    sessions = [f"Session {s}. " + " ".join(f"fact{s}-{i}" for i in range(40))
                for s in range(4)]
    placed: dict[int, list[str]] = {}
    cached: dict[int, list[int]] = {}
    before = read_metrics(serving.base_url)
    indexed = _indexed_blocks(serving.base_url)
    for turn in range(3):
        for s in range(len(sessions)):
            sessions[s] += f"\nUser: question {turn}?\nAssistant:"
            replica, answer = _complete(serving.base_url, {"prompt": sessions[s],
                                                           "max_tokens": 8, "temperature": 0,
                                                           "ignore_eos": True})
            sessions[s] += answer["choices"][0]["text"]
            placed.setdefault(s, []).append(replica)
            cached.setdefault(s, []).append(
                answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        served = {placed[s][-1] for s in placed}  # this turn's events arrived, from each
        indexed = _until_indexed(serving.base_url, indexed, served)
    for s, chosen in placed.items():
        assert chosen == [chosen[0]] * 3, placed
        # the engine itself found the session's earlier turns in its cache
        assert all(tokens >= 100 for tokens in cached[s][1:]), cached
    after = read_metrics(serving.base_url)  # --measure-placement: the engines' own count
    placements = {name: after[f"kvserve_router:placement_{name}_total"]
                  - before[f"kvserve_router:placement_{name}_total"]
                  for name in ("decisions", "best")}
    assert placements == {"decisions": 12, "best": 12}, placements
    from kvserve.bench import server_metrics

    urls, behind_router = server_metrics.metrics_urls(serving.base_url, None, {})
    assert behind_router and len(urls) >= 2
    counts = server_metrics.read(serving.base_url, urls, behind_router, {})
    assert 0 < counts["prefix_cache_hits"] < counts["prefix_cache_queries"]


def _engine_cores_under_replicas() -> set[int]:
    """Engine core processes whose parent is a Serve replica of the app."""
    cores = set()
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "kvserve.core.core_process" in " ".join(process.info["cmdline"] or ()):
                parent = process.parent()
                if parent and f"ServeReplica:{APP}:" in " ".join(parent.cmdline()):
                    cores.add(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return cores


@pytest.mark.multiprocess
def test_a_killed_replica_costs_a_clean_error_and_serve_replaces_it(serving):
    base_url = serving.base_url
    long_body = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    victim, stream_lines = [], []

    def stream():  # long enough to be mid-stream when the kill lands: at ~1 ms a token the
        # tiny model finished 400 tokens within the 0.5 s before it
        with httpx.stream("POST", base_url + COMPLETIONS, timeout=60,
                          json={**long_body, "max_tokens": 1900, "prompt": "a long story",
                                "stream": True}) as r:
            victim.append(r.headers["x-kvserve-replica"])
            for line in r.iter_lines():
                stream_lines.append((time.monotonic(), line))

    def complete(i: int):
        response = httpx.post(base_url + COMPLETIONS, timeout=60,
                              json={**long_body, "prompt": f"story number {i}"})
        return response.status_code, response.json(), time.monotonic()

    with ThreadPoolExecutor(5) as pool:
        streaming = pool.submit(stream)
        wait_until(lambda: len(stream_lines) > 10, timeout=DEADLINE_SECONDS)
        others = [pool.submit(complete, i) for i in range(4)]
        time.sleep(0.5)
        actor = ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#{victim[0]}",
                              namespace="serve")
        ray.kill(actor, no_restart=True)
        killed = time.monotonic()
        streaming.result(timeout=DEADLINE_SECONDS)
        results = [other.result(timeout=DEADLINE_SECONDS) for other in others]
    assert stream_lines[-2][1] == "data: [DONE]"
    error = json.loads(next(line[6:] for _, line in stream_lines if "replica_unavailable"
                            in line))
    assert error["error"]["code"] == "replica_unavailable"
    assert stream_lines[-1][0] - killed < 10
    for status, body, finished in results:  # retried on the survivor, or a clean error
        assert status == 200 or (status == 502 and body["error"]["code"] ==
                                 "replica_unavailable"), body
        assert finished - killed < DEADLINE_SECONDS
    for i in range(4):  # the survivor serves everything meanwhile
        replica, _ = _complete(base_url, {"prompt": f"after {i}", "max_tokens": 4})
        assert replica != victim[0]
    replaced = _until_replicas(base_url, 2, timeout=90, gone=victim[0])
    assert victim[0] not in replaced
    wait_until(lambda: len(_engine_cores_under_replicas()) == 2, timeout=DEADLINE_SECONDS)


@pytest.mark.multiprocess
def test_sigterm_deletes_the_app(serving, ray_address):
    from ray import serve

    cores = _engine_cores_under_replicas()
    assert len(cores) == 2
    assert serving.stop(timeout=60) == 0
    assert APP not in serve.status().applications
    wait_until(lambda: not _engine_cores_under_replicas(), timeout=DEADLINE_SECONDS)


@pytest.mark.multiprocess
def test_rays_prefix_cache_affinity_router_serves_the_same_app(serving, tiny_model_dir):
    """`build_app` with Ray's router, on the Serve instance the CLI left (its proxy's port)."""
    from ray import serve

    from kvserve.ray_serve.app import build_app

    app = build_app({"model": str(tiny_model_dir), "dtype": "float32", "num_kv_blocks": 256,
                     "replicas": 2, "num_cpus_per_replica": 0.5,
                     "request_router": "prefix-cache-affinity", "disable_log_requests": True})
    serve.run(app, name="kvserve-pca", route_prefix="/")
    try:
        base_url = serving.base_url
        prompt = "A shared opening that Ray's prefix tree remembers as text. " * 4
        replicas = [_complete(base_url, {"prompt": prompt + str(i), "max_tokens": 4})[0]
                    for i in range(4)]
        assert len(set(replicas)) == 1  # the same text prefix: the same replica
        _, chat = _complete(base_url, {"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 4}, "/v1/chat/completions")
        assert chat["choices"][0]["message"]["role"] == "assistant"
        _, tokens = _complete(base_url, {"prompt": [1, 2, 3, 4], "max_tokens": 2})
        assert tokens["usage"]["prompt_tokens"] == 4  # no text: Ray's fallback placed it
        state = httpx.get(base_url + "/router/state", timeout=10).json()
        assert state["policy"] == "prefix-cache-affinity" and state["replicas"]
    finally:
        serve.delete("kvserve-pca")
