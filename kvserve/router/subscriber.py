"""One thread that subscribes to every replica's KV events and keeps the index in step.

Per replica: a SUB socket on its PUB endpoint and a ReplayClient on its ROUTER (replay,
snapshots). `track(replica, info)` (any thread) connects, reconnects to new endpoints, or with
info None disconnects and forgets the replica's entries. A replica is snapshotted as soon as it
is tracked (resync on connect); batches lost before the subscription took hold show up as a gap
and are replayed. Replays and snapshots run on this thread with a timeout, so a replica that
stops answering delays the others' events by that timeout at most (ZeroMQ buffers them). With
KVSERVE_ZMQ_SECRET both sockets speak CURVE (zmq_security.py); a replica whose
/kv_events_info says otherwise than this process's secret is not subscribed (routed by load).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq

from kvserve.kv_events import KVEventBatch, ReplayClient, seq_from_bytes
from kvserve.router.index import EventSync, KVIndex
from kvserve.zmq_security import SECRET_ENV, curve_keys, make_client

logger = logging.getLogger(__name__)


def reachable_endpoint(endpoint: str | None, replica_url: str) -> str | None:
    """A bind address as the router can reach it: `tcp://*:5557` or `tcp://0.0.0.0:5557` take
    the replica's host from its URL."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::"):
        host = urlsplit(replica_url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    return f"tcp://{host}:{port}"


@dataclass
class _Feed:
    sub: zmq.Socket
    replay: ReplayClient | None
    sync: EventSync
    key: tuple


class EventSubscriber:
    POLL_MS = 100

    def __init__(self, index: KVIndex, replay_timeout: float = 2.0, secret: str | None = None):
        """`secret`: the replicas' shared secret (default: $KVSERVE_ZMQ_SECRET; a short one
        fails here, at the router's start)."""
        self.index = index
        self.replay_timeout = replay_timeout
        self.secret = secret
        self.keys = curve_keys(secret)
        self.context = zmq.Context()
        self._feeds: dict[str, _Feed] = {}
        self._by_socket: dict[zmq.Socket, str] = {}
        self._syncs: dict[str, EventSync] = {}  # read by other threads: replaced, not mutated
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._thread = threading.Thread(target=self._run, name="kvserve-router-events",
                                        daemon=True)
        self._thread.start()

    # ---- any thread ----------------------------------------------------------------------
    def track(self, replica: str, info: dict | None) -> None:
        """Subscribe to `replica` as its /kv_events_info describes (None: stop, forget)."""
        self._commands.put((replica, info))

    def sync(self, replica: str) -> EventSync | None:
        return self._syncs.get(replica)

    def fresh(self, replica: str, stale_after: float) -> bool:
        sync = self._syncs.get(replica)
        return sync is not None and sync.fresh(stale_after)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._apply_commands(poller)
                for socket, _ in poller.poll(self.POLL_MS):
                    self._drain(socket)
        finally:
            for replica in list(self._feeds):
                self._drop(replica, poller)
            self.context.term()

    def _apply_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                replica, info = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._track(replica, info, poller)
            except Exception:  # a bad endpoint must not end the thread
                logger.exception("cannot subscribe to the KV events of %s", replica)

    def _track(self, replica: str, info: dict | None, poller: zmq.Poller) -> None:
        endpoint = reachable_endpoint((info or {}).get("endpoint"), replica)
        replay_endpoint = reachable_endpoint((info or {}).get("replay_endpoint"), replica)
        key = (endpoint, replay_endpoint, (info or {}).get("topic", ""))
        feed = self._feeds.get(replica)
        if feed is not None and feed.key == key and endpoint:
            return  # same endpoints: ZeroMQ reconnects by itself
        self._drop(replica, poller)
        if not (info and info.get("enabled") and endpoint) or not self._same_security(replica,
                                                                                      info):
            return
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # keep everything: a lost batch costs a replay
        sub.setsockopt(zmq.SUBSCRIBE, key[2].encode())
        make_client(sub, self.keys)
        sub.connect(endpoint)
        replay = ReplayClient(self.context, replay_endpoint, self.replay_timeout, self.secret) \
            if replay_endpoint else None
        sync = EventSync(replica, self.index, replay.replay if replay else None,
                         replay.snapshot if replay else None)
        self._feeds[replica] = _Feed(sub, replay, sync, key)
        self._by_socket[sub] = replica
        self._syncs = {**self._syncs, replica: sync}
        poller.register(sub, zmq.POLLIN)
        logger.info("subscribed to the KV events of %s at %s (replay %s)", replica, endpoint,
                    replay_endpoint)
        if replay is not None and sync.resync():
            logger.info("replica %s: snapshot of %d blocks at seq %d", replica,
                        self.index.num_blocks(replica), sync.last_seq)

    def _same_security(self, replica: str, info: dict) -> bool:
        """Whether both ends agree on CURVE (a replica that does not say is assumed to); a
        mismatch would only time out, so say what to set instead."""
        if "curve" not in info or bool(info["curve"]) == (self.keys is not None):
            return True
        logger.warning("replica %s: its KV events %s, this router's %s: not subscribed (routed "
                       "by load); give both the same %s", replica,
                       "need a shared secret" if info["curve"] else "have no shared secret",
                       "has one" if self.keys else "has none", SECRET_ENV)
        return False

    def _drop(self, replica: str, poller: zmq.Poller) -> None:
        feed = self._feeds.pop(replica, None)
        if feed is None:
            return
        poller.unregister(feed.sub)
        self._by_socket.pop(feed.sub, None)
        feed.sub.close(linger=0)
        if feed.replay is not None:
            feed.replay.close()
        feed.sync.reset()
        self._syncs = {k: v for k, v in self._syncs.items() if k != replica}

    def _drain(self, socket: zmq.Socket) -> None:
        replica = self._by_socket.get(socket)
        if replica is None:
            return
        sync = self._feeds[replica].sync
        for _ in range(1000):  # then let the other replicas' sockets have a turn
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            try:
                batch = self._decoder.decode(frames[2])
            except msgspec.DecodeError:
                logger.warning("replica %s sent an undecodable KV event batch", replica)
                continue
            sync.on_batch(seq_from_bytes(frames[1]), batch)
