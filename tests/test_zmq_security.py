"""The ZeroMQ surfaces behind a shared secret (kvserve/zmq_security.py): KV events (PUB and the
replay ROUTER) and the KV sender reach only peers that know KVSERVE_ZMQ_SECRET, through CURVE;
binding beyond loopback without it is refused before anything serves."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
import zmq

from kvserve.engine_config import EngineConfig
from kvserve.kv_events import ReplayClient
from kvserve.kv_transfer.leases import LeaseTable
from kvserve.kv_transfer.tcp import KVSender, KVTransferError, pull_into
from kvserve.router.index import KVIndex
from kvserve.router.subscriber import EventSubscriber, reachable_endpoint
from kvserve.testing.server import ServerProcess, free_port
from kvserve.zmq_security import (
    SECRET_ENV,
    ZmqSecurityError,
    curve_keys,
    is_loopback,
    require_secret,
)
from tests.helpers import cache_tokens, kv_event_publisher, tiny_server_flags, wait_until

SECRET = "correct horse battery staple 42"
WRONG = "incorrect horse battery staple 42"
REFUSED_WITHIN = 0.5  # seconds a refused peer waits for an answer that never comes


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch):
    """Each test says which secret it means; none leaks in from the environment."""
    monkeypatch.delenv(SECRET_ENV, raising=False)


# ---- keys and addresses ------------------------------------------------------------------------
def test_keys_come_from_the_secret_alone(monkeypatch):
    keys = curve_keys(SECRET)
    assert curve_keys(None) is None  # no secret: plain sockets
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert curve_keys(None) == keys  # the environment's secret gives the same keys
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert zmq.curve_public(keys.client_secret) == keys.client_public
    assert keys.server_public != keys.client_public
    assert curve_keys(WRONG).server_public != keys.server_public
    assert SECRET not in repr(keys) and keys.server_secret.decode() not in repr(keys)
    monkeypatch.setenv(SECRET_ENV, "")  # empty: unset
    assert curve_keys(None) is None
    with pytest.raises(ZmqSecurityError, match=f"{SECRET_ENV} has 5 characters"):
        curve_keys("short")


def test_only_loopback_binds_without_a_secret():
    for host in ("127.0.0.1", "127.0.1.1", "::1", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "*", "10.0.0.5", "::", "eth0", "no-such-host.invalid"):
        assert not is_loopback(host), host
    for address in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "ipc:///tmp/kv", "127.0.0.1"):
        require_secret(address, "x", None)
    for address in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://[::]:5557", "10.0.0.5"):
        with pytest.raises(ZmqSecurityError, match=SECRET_ENV):
            require_secret(address, "x", None)
        require_secret(address, "x", curve_keys(SECRET))


# ---- configuration: refused before anything starts ---------------------------------------------
def _events_on(endpoint: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})


def test_engine_config_refuses_public_binds_without_a_secret(monkeypatch):
    with pytest.raises(ZmqSecurityError, match=f"--kv-events-config endpoint.*{SECRET_ENV}"):
        EngineConfig(kv_events_config=_events_on("tcp://0.0.0.0:5557"))
    producer = json.dumps({"kv_role": "kv_producer", "kv_ip": "10.0.0.5"})
    with pytest.raises(ZmqSecurityError, match=f"kv_ip.*{SECRET_ENV}"):
        EngineConfig(kv_transfer_config=producer)
    # loopback, a disabled publisher and a consumer (it binds nothing) need no secret
    EngineConfig(kv_events_config=_events_on("tcp://127.0.0.1:5557"))
    EngineConfig(kv_events_config='{"enable_kv_cache_events": false, '
                                  '"endpoint": "tcp://0.0.0.0:5557"}')
    EngineConfig(kv_transfer_config=json.dumps({"kv_role": "kv_consumer", "kv_ip": "10.0.0.5"}))
    monkeypatch.setenv(SECRET_ENV, SECRET)
    EngineConfig(kv_events_config=_events_on("tcp://0.0.0.0:5557"), kv_transfer_config=producer)
    monkeypatch.setenv(SECRET_ENV, "too short")
    with pytest.raises(ZmqSecurityError, match="too short"):
        EngineConfig()


def test_serve_exits_at_once_on_a_public_bind_without_a_secret(tiny_model_dir):
    """The real CLI: exit code 2 and the message, before the model loads or a port opens."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    port = free_port()
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir),
         "--port", str(free_port()),
         "--kv-events-config", _events_on(f"tcp://0.0.0.0:{port}")],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"set {SECRET_ENV}" in done.stderr and "--kv-events-config endpoint" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 60


# ---- KV events ---------------------------------------------------------------------------------
def test_kv_events_reach_only_subscribers_with_the_secret(monkeypatch, caplog):
    pub_port, replay_port = free_port(), free_port()
    monkeypatch.setenv(SECRET_ENV, SECRET)
    kv, source = kv_event_publisher(pub_port, replay_port)  # the secret from the environment
    monkeypatch.delenv(SECRET_ENV)
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    info = {"enabled": True, "endpoint": endpoint, "replay_endpoint": replay_endpoint,
            "topic": "", "curve": True}
    cache_tokens(kv, source, list(range(20)))  # before anyone subscribes: the snapshot's
    context = zmq.Context()
    plain_sub = context.socket(zmq.SUB)
    plain_sub.setsockopt(zmq.SUBSCRIBE, b"")
    plain_sub.connect(endpoint)
    subscribers = {name: EventSubscriber(KVIndex(), secret=secret,  # refused ones wait less
                                         replay_timeout=2.0 if secret == SECRET else
                                         REFUSED_WITHIN)
                   for name, secret in (("right", SECRET), ("wrong", WRONG), ("none", None))}
    try:
        for subscriber in subscribers.values():
            subscriber.track("r", info)
        right = subscribers["right"].index
        wait_until(lambda: right.num_blocks("r") == 5, what="the snapshot")
        cache_tokens(kv, source, list(range(100, 112)))  # live events
        wait_until(lambda: right.num_blocks("r") == 8, what="the live events")
        time.sleep(0.3)  # heartbeats go out every 0.2 s: a plain SUB would have had some
        assert subscribers["wrong"].index.num_blocks("r") == 0
        assert not subscribers["wrong"].fresh("r", 10.0)
        assert subscribers["none"].sync("r") is None  # no secret: told, not subscribed
        assert any(SECRET_ENV in record.getMessage() for record in caplog.records
                   if record.levelno == logging.WARNING)
        assert not plain_sub.poll(0)
        _check_replay_answers_only_the_secret(context, replay_endpoint)
    finally:
        for subscriber in subscribers.values():
            subscriber.close()
        plain_sub.close(linger=0)
        context.term()
        source.close()


def _check_replay_answers_only_the_secret(context: zmq.Context, endpoint: str) -> None:
    good = ReplayClient(context, endpoint, timeout=5.0, secret=SECRET)
    seq, snapshot = good.snapshot()
    assert len(snapshot.block_hashes) == 8
    assert [batch for _, batch in good.replay(0) if batch.events]
    assert good.probe(list(range(100, 112))) == 3
    good.close()
    for secret in (WRONG, None):
        client = ReplayClient(context, endpoint, timeout=REFUSED_WITHIN, secret=secret)
        started = time.monotonic()
        assert client.snapshot() is None and client.replay(0) is None
        assert time.monotonic() - started < 4 * REFUSED_WITHIN
        client.close()


# ---- KV transfer -------------------------------------------------------------------------------
def _kv_caches(fill: float) -> list[torch.Tensor]:
    """Two layers of [K/V, 6 blocks, block size 4, 2 heads, head dim 8], each block its id."""
    blocks = torch.arange(6, dtype=torch.float32).view(1, 6, 1, 1, 1)
    return [torch.full((2, 6, 4, 2, 8), fill) + blocks * (layer + 1) for layer in range(2)]


def test_kv_sender_with_a_secret_serves_only_pullers_that_know_it():
    with pytest.raises(ZmqSecurityError, match=SECRET_ENV):
        KVSender(_kv_caches(0.0), LeaseTable(), "0.0.0.0", use_shm=False)
    caches, leases = _kv_caches(0.0), LeaseTable()
    # every interface, reachable from other machines: allowed with the secret
    sender = KVSender(caches, leases, "0.0.0.0", use_shm=False, secret=SECRET)
    context = zmq.Context()
    try:
        leases.hold("r", [4, 1], timeout_s=30)
        for secret in (None, WRONG):
            target = _kv_caches(-5.0)
            with pytest.raises(KVTransferError, match="no answer.*KVSERVE_ZMQ_SECRET"):
                pull_into(context, "127.0.0.1", sender.port, "r", target, [0, 2],
                          REFUSED_WITHIN, use_shm=False, secret=secret)
            assert torch.equal(target[0], _kv_caches(-5.0)[0])  # nothing arrived
        target = _kv_caches(-5.0)
        assert pull_into(context, "127.0.0.1", sender.port, "r", target, [0, 2], 5,
                         use_shm=False, secret=SECRET) == 2  # the lease was still there
        for source, cache in zip(caches, target):
            assert torch.equal(cache[:, [0, 2]], source[:, [4, 1]])
    finally:
        sender.close()
        context.term()


def test_ray_replicas_publish_on_loopback_without_a_secret(monkeypatch):
    """A replica without the secret publishes on its node's loopback; an ingress elsewhere must
    not connect to its own 127.0.0.1 instead (it routes that replica by load)."""
    pytest.importorskip("ray.serve")
    from ray.util import get_node_ip_address

    from kvserve.ray_serve.replica import _events_host
    from kvserve.ray_serve.router import _reachable

    assert _events_host("192.0.2.7") == "127.0.0.1"
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert _events_host("192.0.2.7") == "192.0.2.7"

    here = get_node_ip_address()
    loopback = {"endpoint": "tcp://127.0.0.1:5557"}
    assert _reachable({**loopback, "node_ip": here})
    assert not _reachable({**loopback, "node_ip": "192.0.2.7"})
    assert _reachable({"endpoint": "tcp://192.0.2.7:5557", "node_ip": "192.0.2.7"})
    assert _reachable(loopback)  # a replica that does not say where it runs


# ---- a real server: the secret reaches its engine core and worker through the environment -----
@pytest.mark.multiprocess
def test_a_server_with_the_secret_serves_events_and_kv_only_behind_it(tiny_model_dir, tmp_path):
    """Every interface, with the secret: its events and its held KV reach a peer with the
    secret; a plain SUB and a puller without it get nothing."""
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://0.0.0.0:{free_port('')}",
              "replay_endpoint": f"tcp://0.0.0.0:{free_port('')}"}
    flags = tiny_server_flags(tiny_model_dir, "--kv-events-config", json.dumps(events),
                              "--kv-transfer-config",
                              json.dumps({"kv_role": "kv_producer", "kv_ip": "0.0.0.0"}))
    context = zmq.Context()
    with ServerProcess(flags, env={SECRET_ENV: SECRET}, log_path=tmp_path / "server.log") \
            as server:
        info = httpx.get(server.base_url + "/kv_events_info", timeout=10).json()
        assert info["curve"] is True
        subscriber = EventSubscriber(KVIndex(), replay_timeout=2.0, secret=SECRET)
        plain_sub = context.socket(zmq.SUB)
        plain_sub.setsockopt(zmq.SUBSCRIBE, b"")
        plain_sub.connect(reachable_endpoint(info["endpoint"], server.base_url))
        try:
            subscriber.track(server.base_url, info)
            wait_until(lambda: subscriber.fresh(server.base_url, 5.0), what="the subscription")
            body = {"prompt": "The secret keeps the rivers of KV blocks flowing. " * 4,
                    "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            handle = httpx.post(server.base_url + "/v1/completions", json=body,
                                timeout=60).json()["kv_transfer_params"]
            wait_until(lambda: subscriber.index.num_blocks(server.base_url) > 0,
                       what="the prompt's blocks in the index")
            assert not plain_sub.poll(0)  # heartbeats every second went by meanwhile
            _pull_only_with_the_secret(context, tiny_model_dir, info["block_size"], handle)
        finally:
            subscriber.close()
            plain_sub.close(linger=0)
    context.term()


def _pull_only_with_the_secret(context, model_dir, block_size: int, handle: dict) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    num_blocks = len(handle["remote_block_ids"])
    page = (2, num_blocks, block_size, config["num_key_value_heads"], config["head_dim"])
    caches = [torch.zeros(page) for _ in range(config["num_hidden_layers"])]
    where = ("127.0.0.1", handle["remote_port"], handle["remote_request_id"])
    with pytest.raises(KVTransferError, match="no answer"):
        pull_into(context, *where, caches, list(range(num_blocks)), REFUSED_WITHIN,
                  use_shm=False, secret=None)
    assert pull_into(context, *where, caches, list(range(num_blocks)), 10, use_shm=False,
                     secret=SECRET) == num_blocks
    assert all(cache.abs().sum() > 0 for cache in caches)  # the prompt's K and V arrived
