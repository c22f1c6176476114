"""KV cache events: which blocks an engine cached and evicted, published for KV-aware routers.

vLLM's wire (vllm/distributed/kv_events.py): msgspec structs as msgpack, sent as multipart
(topic, seq as 8 bytes big-endian, batch) on a ZeroMQ PUB socket, and a ROUTER socket that
replays buffered batches from a sequence number, ending with seq -1. kvserve adds to the ROUTER a
snapshot (every cached block hash and the seq it is current to: a subscriber that lost events
starts again from it) and a prefix probe (how many leading blocks of some tokens are cached,
for measuring a router's placements), and an empty batch each second while nothing else goes
out (a silent publisher is a dead or cut-off one). Each batch carries the engine's instance id,
new on every start, so a subscriber sees a restart even when the sequence numbers line up.

The block pool collects events only when they are enabled; EngineCore hands them over once per
step (`KVEventSource.flush`) and a thread of the publisher encodes and sends them, so a step
never waits for the network: a full queue drops the batch (counted), and subscribers see the
gap in the sequence numbers.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Callable

import msgspec
import zmq

from kvserve.ports import free_port
from kvserve.protocol.block_hash import HASH_ALGORITHM
from kvserve.zmq_security import (
    CurveKeys,
    curve_keys,
    make_client,
    make_server,
    require_secret,
    start_authenticator,
)

logger = logging.getLogger(__name__)

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)


# ---- the events (vLLM's names and field order) ------------------------------------------------
class KVCacheEvent(msgspec.Struct, tag=True, **_STRUCT):
    """Base of the events; tagged by class name on the wire."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one sequence became cached; the first one's parent is
    `parent_block_hash` (None: the sequence's first block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, **_STRUCT):
    """One step's events (empty: a heartbeat). vLLM's fields, then kvserve's."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
    engine_instance_id: str = ""


class KVSnapshot(msgspec.Struct, **_STRUCT):
    """Every block hash cached at the sequence number sent beside it (kvserve only)."""

    engine_instance_id: str
    block_size: int
    hash_algorithm: str
    block_hashes: list[int]


# ROUTER requests: vLLM's replay is the start seq as 8 bytes; ours are longer names
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"kvserve.snapshot"
PROBE_REQUEST = b"kvserve.probe"


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)


# ---- configuration (vLLM's --kv-events-config keys) ------------------------------------------
@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; default: zmq when enabled
    # kvserve binds both sockets (vLLM connects to a non-wildcard address); loopback by default
    # because BlockStored carries token ids, i.e. the prompts
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None  # also serves snapshots and probes; routers want it
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread, then dropped
    topic: str = ""
    heartbeat_seconds: float = 1.0  # kvserve: an empty batch after this long without one

    def __post_init__(self) -> None:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        object.__setattr__(self, "publisher", publisher)
        if publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher {publisher!r}: use 'zmq' or 'null'")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None:
                continue
            if not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv events {name} {value!r} is not a ZeroMQ address "
                                 f"(tcp://host:port or ipc://path)")
            if value.startswith("tcp://") and value.rsplit(":", 1)[-1] in ("*", "0"):
                raise ValueError(f"kv events {name} {value!r} needs a fixed port: routers "
                                 f"learn it from the config")
        if self.buffer_steps < 1 or self.max_queue_size < 1 or self.heartbeat_seconds <= 0:
            raise ValueError("kv events buffer_steps and max_queue_size must be >= 1 and "
                             "heartbeat_seconds > 0")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def check_binds(self, keys: CurveKeys | None) -> None:
        """A ZmqSecurityError when a socket would bind beyond loopback without the shared
        secret (zmq_security.py): the events carry prompts' token ids."""
        if self.publishes:
            for name in ("endpoint", "replay_endpoint"):
                if getattr(self, name):
                    require_secret(getattr(self, name), f"--kv-events-config {name}", keys)


def parse_kv_events_config(text: str | dict | None) -> KVEventsConfig | None:
    """`--kv-events-config` JSON (or a dict) -> the config; None when not given. A bad one is a
    ValueError naming the problem."""
    if text is None or text == "":
        return None
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
    else:
        data = dict(text)
    if not isinstance(data, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(known)}")
    try:
        return msgspec.convert(data, KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from exc


# ---- publishers ------------------------------------------------------------------------------
class NullEventPublisher:
    """Events collected and dropped (`publisher: "null"`: measures the collection alone)."""

    def publish(self, events: list) -> None:
        pass

    def close(self) -> None:
        pass


class ZmqEventPublisher:
    """A PUB socket for batches and a ROUTER for replay, snapshots and probes, both owned by one
    background thread. `publish` (the engine's thread) only numbers a batch and queues it."""

    POLL_SECONDS = 0.05  # how long the thread waits for a batch before serving the ROUTER
    SHUTDOWN_SECONDS = 2.0

    def __init__(self, config: KVEventsConfig, instance_id: str, block_size: int,
                 snapshot: Callable[[], list[int]],
                 probe: Callable[[list[int], str | None], int], secret: str | None = None):
        """`secret`: the shared secret (default: $KVSERVE_ZMQ_SECRET); with one, both sockets
        admit only CURVE clients that know it."""
        self.keys = curve_keys(secret)
        config.check_binds(self.keys)
        self.config = config
        self.instance_id = instance_id
        self.block_size = block_size
        self._snapshot_source, self._probe = snapshot, probe
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()  # seq numbering and queue order agree
        self._next_seq = 0
        self.num_dropped = 0
        self._last_sent = time.monotonic()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"cannot bind the KV events sockets ({config.endpoint}, "
                             f"{config.replay_endpoint}): {self._error}") from self._error
        logger.info("KV events: publishing on %s (replay %s, topic %r), instance %s",
                    config.endpoint, config.replay_endpoint, config.topic, instance_id)

    # ---- the engine's side ---------------------------------------------------------------
    def publish(self, events: list) -> None:
        batch = KVEventBatch(time.time(), events, None, self.instance_id)
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, batch))
                return
            except queue.Full:
                self.num_dropped += 1
        if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
            logger.warning("KV events: queue full, %d batches dropped (subscribers resync)",
                           self.num_dropped)

    @property
    def last_seq(self) -> int:
        """The seq of the last batch numbered (-1: none yet)."""
        with self._lock:
            return self._next_seq - 1

    def close(self) -> None:
        """Send what is queued (briefly), then close the sockets."""
        self._stopping.set()
        self._thread.join(self.SHUTDOWN_SECONDS)

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        context = zmq.Context()
        sockets: list[zmq.Socket] = []
        auth = None
        try:
            auth = start_authenticator(context, self.keys)
            pub = context.socket(zmq.PUB)
            sockets.append(pub)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            make_server(pub, self.keys)
            pub.bind(self.config.endpoint)
            replay = None
            if self.config.replay_endpoint:
                replay = context.socket(zmq.ROUTER)
                sockets.append(replay)
                make_server(replay, self.keys)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
        self._ready.set()
        try:
            if self._error is None:
                self._loop(pub, replay)
        finally:
            for socket in sockets:
                socket.close(linger=0)
            if auth is not None:
                auth.stop()
            context.term()

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        topic = self.config.topic.encode()
        encoder = msgspec.msgpack.Encoder()
        while not (self._stopping.is_set() and self._queue.empty()):
            try:
                seq, batch = self._queue.get(timeout=self.POLL_SECONDS)
            except queue.Empty:
                pass
            else:
                payload = encoder.encode(batch)
                pub.send_multipart((topic, seq_bytes(seq), payload))
                self._ring.append((seq, payload))
                self._last_sent = time.monotonic()
            if replay is not None:
                self._serve(replay, encoder)
            if time.monotonic() - self._last_sent >= self.config.heartbeat_seconds \
                    and not self._stopping.is_set():
                self.publish([])

    def _serve(self, replay: zmq.Socket, encoder: msgspec.msgpack.Encoder) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) < 3:
                continue
            client, request = frames[0], frames[2]
            try:
                if request == SNAPSHOT_REQUEST:
                    seq, snapshot = self._snapshot()
                    replay.send_multipart((client, b"", seq_bytes(seq), encoder.encode(snapshot)))
                elif request == PROBE_REQUEST and len(frames) > 3:
                    token_ids = msgspec.msgpack.decode(frames[3], type=list[int])
                    salt = frames[4].decode() if len(frames) > 4 and frames[4] else None
                    replay.send_multipart((client, b"",
                                           encoder.encode(self._probe(token_ids, salt))))
                elif len(request) == 8:
                    start = seq_from_bytes(request)
                    for seq, payload in list(self._ring):
                        if seq >= start:
                            replay.send_multipart((client, b"", seq_bytes(seq), payload))
                    replay.send_multipart((client, b"", END_SEQ, b""))
            except Exception:  # a bad request must not end the publisher
                logger.exception("KV events: cannot answer a ROUTER request")

    def _snapshot(self) -> tuple[int, KVSnapshot]:
        """The cached hashes, read after the last seq was taken: every batch up to it is in the
        pool, and replaying later batches over events already applied gives the same set (each
        hash's state is that of its last event), so seq + hashes is an exact cursor. The pool is
        read from this thread while the engine steps: list(dict) runs in C under the GIL."""
        seq = self.last_seq
        for _ in range(3):
            try:
                hashes = self._snapshot_source()
                break
            except RuntimeError:  # changed size during iteration: try again
                continue
        else:
            hashes = []
        return seq, KVSnapshot(self.instance_id, self.block_size, HASH_ALGORITHM, hashes)


# ---- the engine's glue -------------------------------------------------------------------------
class KVEventSource:
    """What EngineCore holds: it hands the block pool's events to the publisher once per step
    (`flush`) and closes it at shutdown. Disabled, both do nothing."""

    def __init__(self, pool=None, publisher=None, block_size: int = 0):
        self.pool = pool
        self.publisher = publisher
        self.block_size = block_size
        self._tiers: list = []  # offload connectors' take_tier_changes

    def add_source(self, connector) -> None:
        """Publish what `connector`'s offload tiers gain and lose too (one with
        `take_tier_changes`), each tier's blocks under its own medium, when events are on."""
        if self.publisher is not None and hasattr(connector, "take_tier_changes"):
            connector.enable_tier_changes()
            self._tiers.append(connector.take_tier_changes)

    def flush(self) -> None:
        if self.publisher is None:
            return
        events = self.pool.take_events() if self.pool.events else []
        for take in self._tiers:
            for medium, stored, removed in take():
                if removed:
                    events.append(BlockRemoved(block_hashes=removed, medium=medium))
                if stored:
                    events.append(BlockStored(block_hashes=stored, parent_block_hash=None,
                                              token_ids=[], block_size=self.block_size,
                                              medium=medium))
        if events:
            self.publisher.publish(events)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = self.pool = None


def make_kv_event_source(config_text: str | None, kv_manager) -> KVEventSource:
    """From EngineConfig.kv_events_config: turn on the pool's event collection and start a
    publisher, with a new instance id; disabled when not asked for."""
    config = parse_kv_events_config(config_text)
    if config is None or not config.enable_kv_cache_events:
        return KVEventSource()
    if not kv_manager.enable_prefix_caching:
        logger.warning("KV events: prefix caching is off, so no block is ever cached; "
                       "nothing but heartbeats will be published")
    kv_manager.pool.enable_events()
    if not config.publishes:
        return KVEventSource(kv_manager.pool, NullEventPublisher(), kv_manager.block_size)
    if config.replay_endpoint is None:
        logger.warning("KV events without a replay_endpoint: subscribers that miss a batch "
                       "cannot replay or take a snapshot")
    publisher = ZmqEventPublisher(
        config, uuid.uuid4().hex, kv_manager.block_size,
        snapshot=lambda: list(kv_manager.pool.cached),
        probe=kv_manager.num_cached_prefix_blocks)
    return KVEventSource(kv_manager.pool, publisher, kv_manager.block_size)


def with_kv_events(config, host: str):
    """The engine config (an EngineConfig) with KV events on, both sockets on free ports of
    `host`; other keys of a --kv-events-config given (topic, buffers, heartbeat) are kept."""
    events = json.loads(config.kv_events_config) if config.kv_events_config else {}
    bracketed = f"[{host}]" if ":" in host else host
    events.update(enable_kv_cache_events=True, publisher="zmq",
                  endpoint=f"tcp://{bracketed}:{free_port(host)}",
                  replay_endpoint=f"tcp://{bracketed}:{free_port(host)}")
    return dataclasses.replace(config, kv_events_config=json.dumps(events))


def kv_events_info(config_text: str | None, block_size: int) -> dict[str, Any]:
    """What a router needs to subscribe (the server's GET /kv_events_info)."""
    config = parse_kv_events_config(config_text)
    if config is None or not config.publishes:
        return {"enabled": False, "block_size": block_size, "hash_algorithm": HASH_ALGORITHM}
    return {"enabled": True, "endpoint": config.endpoint,
            "replay_endpoint": config.replay_endpoint, "topic": config.topic,
            "block_size": block_size, "hash_algorithm": HASH_ALGORITHM,
            "heartbeat_seconds": config.heartbeat_seconds,
            "curve": curve_keys() is not None}  # subscribers need KVSERVE_ZMQ_SECRET too


# ---- the subscriber's side of the ROUTER -------------------------------------------------------
class ReplayClient:
    """Replay, snapshot and probe requests to one publisher's ROUTER socket, each answered
    within `timeout` seconds or None. One thread at a time (ZeroMQ sockets are not
    thread-safe); after a timeout the socket is replaced, so a late answer cannot be taken for
    the next one."""

    def __init__(self, context: zmq.Context, endpoint: str, timeout: float = 2.0,
                 secret: str | None = None):
        """`secret`: the publisher's shared secret (default: $KVSERVE_ZMQ_SECRET; none: a
        plain connection)."""
        self.context = context
        self.endpoint = endpoint
        self.timeout = timeout
        self.keys = curve_keys(secret)
        self._batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._snapshot_decoder = msgspec.msgpack.Decoder(KVSnapshot)
        self._socket: zmq.Socket | None = None

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = self.context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            make_client(self._socket, self.keys)
            self._socket.connect(self.endpoint)
        return self._socket

    def _receive(self, deadline: float) -> list[bytes] | None:
        socket = self._connected()
        wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not socket.poll(wait_ms):
            self.close()
            return None
        return socket.recv_multipart()[1:]  # drop the empty delimiter

    def replay(self, start_seq: int) -> list[tuple[int, KVEventBatch]] | None:
        """The buffered batches from `start_seq` on (possibly not starting there: older ones
        are gone); None on timeout."""
        deadline = time.monotonic() + self.timeout
        self._connected().send_multipart((b"", seq_bytes(start_seq)))
        batches = []
        while True:
            frames = self._receive(deadline)
            if frames is None or len(frames) < 2:
                return None
            if frames[0] == END_SEQ:
                return batches
            batches.append((seq_from_bytes(frames[0]), self._batch_decoder.decode(frames[1])))

    def snapshot(self) -> tuple[int, KVSnapshot] | None:
        deadline = time.monotonic() + self.timeout
        self._connected().send_multipart((b"", SNAPSHOT_REQUEST))
        frames = self._receive(deadline)
        if frames is None or len(frames) < 2:
            return None
        return seq_from_bytes(frames[0]), self._snapshot_decoder.decode(frames[1])

    def probe(self, token_ids: list[int], cache_salt: str | None = None) -> int | None:
        """How many leading full blocks of `token_ids` (under `cache_salt`) the engine holds
        cached."""
        deadline = time.monotonic() + self.timeout
        frames = [b"", PROBE_REQUEST, msgspec.msgpack.encode(token_ids)]
        if cache_salt:
            frames.append(cache_salt.encode())
        self._connected().send_multipart(frames)
        frames = self._receive(deadline)
        if not frames:
            return None
        return msgspec.msgpack.decode(frames[0], type=int)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
