"""kvserve on a Ray cluster of several nodes started on this machine (`ray.cluster_utils.Cluster`:
a head without CPUs, where the drivers connect, and node_a and node_b, each with a custom
resource of its own name that KVSERVE_RAY_RANK_RESOURCES places ranks with). Two Ray nodes
count as two hosts (platform.host_identity reads Ray's node id), so nothing takes a one-host
shortcut between them, as on real machines:

- tensor parallel 2, rank 0 on node_a and rank 1 on node_b: fp32 greedy tokens equal one
  process's; the ranks all-reduce over gloo, not /dev/shm;
- a prefill server whose rank is on node_a and a decode server whose rank is on node_b, both
  asking for the /dev/shm transport: 12 prompts' greedy tokens equal one engine's, each handle
  names node_a's IP (not loopback) and the KV went as TCP frames;
- `kvserve router` over those two servers under streaming load while node_b is removed (its
  raylet and every process under it killed): every stream ends within DEADLINE_SECONDS, the
  router marks the decode server down, the survivor answers what follows, and node_b's
  processes, the decode server and its engine core are gone.

And without Ray, KVSERVE_CROSS_HOST=1 makes two processes of one machine two hosts.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from kvserve import LLM, SamplingParams
from kvserve.testing.server import ServerProcess, kv_events_config
from tests.helpers import (
    complete_with_kv,
    tiny_server_flags,
    wait_gone,
    wait_router_synced,
    wait_until,
)

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.multiprocess

PROMPTS = [f"Node test {i}: say something about the harbour of town number {i}. " * (1 + i % 3)
           for i in range(12)]
NEW_TOKENS = 16
DEADLINE_SECONDS = 45
SECRET = "multinode-test-secret-0123456789"  # KV senders bind beyond loopback: CURVE needed
# a node marked dead 1.5 s after its raylet goes (Ray's default is ~15 s)
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster():
    """(cluster, {"node_a": node, "node_b": node}); this process is a driver on the head."""
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "another module left Ray connected"
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
    try:
        nodes = {name: cluster.add_node(num_cpus=1, resources={name: 1})
                 for name in ("node_a", "node_b")}
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llm):
    """One process's greedy fp32 outputs of PROMPTS."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return tiny_llm.generate(PROMPTS, params, use_tqdm=False)


def _ray_env(resources) -> dict[str, str]:
    return {"KVSERVE_RAY_RANK_RESOURCES": json.dumps(resources),
            "KVSERVE_RAY_CPUS_PER_RANK": "0.25", "KVSERVE_ZMQ_SECRET": SECRET}


def test_tensor_parallel_ranks_on_two_nodes_match_one_process(cluster, nodes_env, tiny_model_dir,
                                                              reference):
    _, nodes = cluster
    nodes_env(_ray_env([{"node_a": 0.01}, {"node_b": 0.01}]))
    llm = LLM(model=str(tiny_model_dir), dtype="float32", engine_core="thread",
              distributed_executor_backend="ray", tensor_parallel_size=2, num_threads=1,
              num_kv_blocks=256)
    executor = llm.llm_engine.engine_core.executor
    try:
        ranks = executor.describe_ranks()
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                       ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [rank["node_id"] for rank in ranks] == [nodes["node_a"].node_id,
                                                    nodes["node_b"].node_id]
    assert ranks[0]["host_id"] != ranks[1]["host_id"]
    assert [rank["all_reduce"] for rank in ranks] == ["torch", "torch"]  # not /dev/shm
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in reference]
    assert all(wait_gone(pid, timeout=15) for pid in executor.worker_pids)


@pytest.fixture
def nodes_env(monkeypatch):
    """Set environment variables for this test (the executor reads them, and passes the
    KVSERVE_* ones to its actors)."""
    def set_env(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    return set_env


# ---- two servers, one on each node -------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(cluster, tiny_model_dir, tmp_path_factory):
    """A prefill server with its rank on node_a and a decode server with its rank on node_b
    (engine cores here, on the head), both asking for the /dev/shm transport."""
    ray_cluster, _ = cluster
    logs = tmp_path_factory.mktemp("multinode")
    transport = json.dumps({"kv_connector_extra_config": {"transport": "shm"}})
    started = [ServerProcess(
        tiny_server_flags(tiny_model_dir, "--distributed-executor-backend", "ray",
                          "--num-threads", "1", "--kv-role", role, "--kv-transfer-config",
                          transport, "--kv-events-config", kv_events_config(), kv_blocks=512),
        log_path=logs / f"{role}.log", startup_timeout=240,
        env={"RAY_ADDRESS": ray_cluster.address, **_ray_env({node: 0.01})})
        for node, role in (("node_a", "prefill"), ("node_b", "decode"))]
    for server in started:  # both load at once
        server.start()
    try:
        for server in started:
            server.__enter__()
        yield started
    finally:
        for server in started:
            server.stop()


def test_prefill_on_one_node_and_decode_on_another_match_one_engine(cluster, servers,
                                                                    reference):
    _, nodes = cluster
    prefill, decode = servers
    node_a_ip = nodes["node_a"].node_ip_address
    for prompt, expected in zip(PROMPTS, reference):
        handle = complete_with_kv(prefill.base_url, prompt, 1,
                                  {"do_remote_decode": True})["kv_transfer_params"]
        assert handle["remote_host"] == node_a_ip != "127.0.0.1"
        got = complete_with_kv(decode.base_url, prompt, NEW_TOKENS, handle)
        assert got["choices"][0]["text"] == expected.outputs[0].text, prompt
        details = got["usage"]["prompt_tokens_details"]
        assert details["transferred_tokens"] == got["usage"]["prompt_tokens"] - 1
    # the prefill rank's KV sender says how the decode rank's pulls went (its log reaches the
    # server's through Ray's log streaming)
    log = prefill.log_path
    wait_until(lambda: "KV pulls from host" in log.read_text(), timeout=20,
               what="the prefill rank's log line about its pulls")
    lines = [line for line in log.read_text().splitlines() if "KV pulls from host" in line]
    assert lines and all("as TCP frames" in line and "ray-node:" + nodes["node_b"].node_id
                         in line for line in lines), lines


# ---- the router across the nodes, and a node lost under load -----------------------------------
async def _stream(client: httpx.AsyncClient, prompt: str) -> tuple[int, str, list[str]]:
    body = {"prompt": prompt, "max_tokens": 600, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        replica = response.headers.get("x-kvserve-replica", "")
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    return response.status_code, replica, lines


def _running(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvserve:num_requests_running"))


def _processes_of(pid: int) -> list[int]:
    process = psutil.Process(pid)
    return [pid] + [child.pid for child in process.children(recursive=True)]


def _ends(status: int, lines: list[str]) -> str:
    """How a stream ended: "finished" (every choice has a finish reason) or "error" (an SSE
    error event, or a non-200 answer); anything else fails."""
    if status != 200:
        return "error"
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    if any("error" in payload for payload in payloads):
        return "error"
    assert any(c.get("finish_reason") == "length" for p in payloads
               for c in p.get("choices", [])), payloads[-2:]
    return "finished"


def test_router_across_nodes_survives_losing_a_node(cluster, servers, tiny_model_dir):
    ray_cluster, nodes = cluster
    survivor, victim = servers
    args = ["--model", str(tiny_model_dir), "--policy", "round-robin", "--health-interval",
            "0.5", "--disable-log-requests", "--replica", survivor.base_url,
            "--replica", victim.base_url]
    raylet = nodes["node_b"].all_processes["raylet"][0].process.pid
    with ServerProcess(args, subcommand="router", startup_timeout=60,
                       env={"KVSERVE_ZMQ_SECRET": SECRET}) as router:
        wait_router_synced(router)

        async def scenario():
            async with httpx.AsyncClient(base_url=router.base_url, timeout=120) as client:
                streams = [asyncio.ensure_future(_stream(client, f"A long story {i}."))
                           for i in range(4)]
                deadline = time.monotonic() + 30
                while _running(victim.base_url) < 2:
                    assert time.monotonic() < deadline, "node_b never ran its two streams"
                    await asyncio.sleep(0.05)
                doomed = _processes_of(raylet) + _processes_of(victim.process.pid)
                await asyncio.to_thread(ray_cluster.remove_node, nodes["node_b"], False)
                removed = time.monotonic()
                outcomes = await asyncio.wait_for(asyncio.gather(*streams), DEADLINE_SECONDS)
                return outcomes, doomed, time.monotonic() - removed

        outcomes, doomed, seconds = asyncio.run(scenario())
        assert seconds < DEADLINE_SECONDS
        by_replica = {}
        for status, replica, lines in outcomes:
            by_replica.setdefault(replica, []).append(_ends(status, lines))
        # node_b's streams had begun: they end with an error event (a stream that had not
        # would have been retried on the survivor, and finished there)
        assert set(by_replica.pop(victim.base_url, [])) == {"error"}, by_replica
        assert set(by_replica.pop(survivor.base_url)) == {"finished"} and not by_replica
        with httpx.Client(base_url=router.base_url, timeout=60) as client:
            wait_until(lambda: client.get("/health").json() == {
                "healthy_replicas": [survivor.base_url]}, timeout=15,
                what="the router marking node_b's server down")
            state = client.get("/router/state").json()["replicas"][victim.base_url]
            assert not state["healthy"]
            for i in range(4):
                response = client.post("/v1/completions", json={
                    "prompt": f"After the loss {i}.", "max_tokens": 8, "temperature": 0})
                assert response.status_code == 200, response.text
                assert response.headers["x-kvserve-replica"] == survivor.base_url
    # node_b's raylet and everything under it, the decode server and its engine core
    assert all(wait_gone(pid, timeout=30) for pid in doomed), \
        [psutil.Process(pid).cmdline() for pid in doomed if psutil.pid_exists(pid)]
    assert victim.process.poll() is not None


# ---- the switch, without Ray ------------------------------------------------------------------
def _host_identity(cross_host: str | None) -> str:
    env = {key: value for key, value in os.environ.items()
           if key not in ("KVSERVE_CROSS_HOST", "KVSERVE_NODE_ID")}
    if cross_host is not None:
        env["KVSERVE_CROSS_HOST"] = cross_host
    return subprocess.run([sys.executable, "-c", "from kvserve.platform import host_identity; "
                           "print(host_identity())"], env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_cross_host_switch_makes_every_process_a_host_of_its_own(monkeypatch):
    from kvserve.platform import host_identity

    plain, crossed = _host_identity(None), _host_identity("1")
    assert plain == host_identity()  # one machine, one host: shortcuts allowed
    assert crossed != plain
    monkeypatch.setenv("KVSERVE_CROSS_HOST", "1")
    assert host_identity() not in (plain, crossed)  # each process a host of its own


def test_rank_resources_must_name_every_rank(monkeypatch):
    from kvserve.executor.ray_executor import _rank_resources

    monkeypatch.setenv("KVSERVE_RAY_RANK_RESOURCES", '{"node_a": 0.01}')
    assert _rank_resources(2) == [{"node_a": 0.01}, {"node_a": 0.01}]
    monkeypatch.setenv("KVSERVE_RAY_RANK_RESOURCES", '[{"node_a": 0.01}]')
    with pytest.raises(ValueError, match="list of 2 objects"):
        _rank_resources(2)
    monkeypatch.setenv("KVSERVE_RAY_RANK_RESOURCES", "node_a")
    with pytest.raises(ValueError, match="not JSON"):
        _rank_resources(2)
