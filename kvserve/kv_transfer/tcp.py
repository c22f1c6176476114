"""The transport (ZeroMQ over TCP): a decode engine pulls a held request's blocks by id.

The prefill engine's `KVSender` thread serves a ROUTER socket. A `Pull` names the request and
the layout the puller expects (block size, each layer's page shape, dtype); the sender takes
the lease (leases.py), gathers the request's blocks from every layer's KV tensor and answers
with a `PullReply` header and one frame per layer (its page layout's [planes, blocks, ...],
sent without copying once gathered), then marks the lease done. One round trip: there is no
release message, and a puller that dies mid-reply costs the sender nothing. A sender that dies
is a pull that times out (`transfer_timeout_s`). A pull may come before the sender's rank has
heard of the lease (it hears in a step after the request finished, the decode engine as soon as
the prefill engine answered): such a pull waits, up to the transfer timeout, for it. When both
engines are on one host (the pull names the puller's host and it matches) the blocks go through
a /dev/shm file instead of frames (shm.py), unless the sender's transport is "tcp". With the
shared secret ($KVSERVE_ZMQ_SECRET, zmq_security.py) both ends speak CURVE and the sender admits
only pullers that know it; without one the sender binds loopback only.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings

import msgspec
import torch
import zmq

from kvserve.kv_transfer.leases import LeaseTable
from kvserve.kv_transfer.shm import (
    ShmJanitor,
    block_run_shapes,
    read_blocks,
    shm_available,
    write_blocks,
)
from kvserve.platform import host_identity
from kvserve.zmq_security import (
    curve_keys,
    make_client,
    make_server,
    require_secret,
    start_authenticator,
)

logger = logging.getLogger(__name__)

POLL_MS = 100
PARKED_POLL_MS = 2  # while pulls wait for their lease


class KVTransferError(RuntimeError):
    """A pull failed: the sender is gone or too slow, the lease expired, the layouts differ."""


class KVLayout(msgspec.Struct, frozen=True, array_like=True):
    """What a block is: two engines exchange blocks only when these agree. `pages`: each
    layer's page as its cache holds it without the block dimension (its KVPageLayout: planes,
    block size, then the rows: [2, 16, kv heads, head dim] for standard attention)."""

    block_size: int
    pages: tuple[tuple[int, ...], ...]
    dtype: str

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> "KVLayout":
        pages = tuple((int(cache.shape[0]), *map(int, cache.shape[2:])) for cache in kv_caches)
        return cls(int(kv_caches[0].shape[2]), pages,
                   str(kv_caches[0].dtype).removeprefix("torch."))

    @property
    def num_layers(self) -> int:
        return len(self.pages)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class Pull(msgspec.Struct, array_like=True):
    request_id: str
    layout: KVLayout
    host_id: str = ""  # the puller's machine (shm.host_identity): same as ours -> shared memory
    first_block: int = 0  # the puller holds the blocks before this one (its prefix cache)


class PullReply(msgspec.Struct, array_like=True):
    ok: bool
    error: str = ""
    num_blocks: int = 0
    shm_path: str = ""  # the blocks are in this /dev/shm file, not in frames


class KVSender:
    """Serves pulls of held blocks from `kv_caches` on tcp://host:port (port 0: a free one,
    then `self.port`), on its own thread. `secret`: default $KVSERVE_ZMQ_SECRET."""

    def __init__(self, kv_caches: list[torch.Tensor], leases: LeaseTable, host: str,
                 port: int = 0, use_shm: bool = True, transfer_timeout_s: float = 10.0,
                 secret: str | None = None):
        keys = curve_keys(secret)
        require_secret(host, "the KV sender's host (--kv-transfer-config kv_ip)", keys)
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        self.leases = leases
        self.host = host
        self.host_id = host_identity()
        self.use_shm = use_shm and shm_available()
        self.janitor = ShmJanitor(2 * transfer_timeout_s) if self.use_shm else None
        self._context = zmq.Context()
        self._auth = start_authenticator(self._context, keys)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        make_server(self._socket, keys)
        bind_host = "*" if host in ("0.0.0.0", "*") else host
        if port:
            self._socket.bind(f"tcp://{bind_host}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
        self.park_s = transfer_timeout_s
        self._parked: list[tuple[float, bytes, Pull]] = []  # (give up at, puller, pull)
        self.pulls_by_transport = {"shm": 0, "frames": 0}  # answered pulls, by how they went
        self._puller_hosts: set[str] = set()  # logged once each
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-sender", daemon=True)
        self._thread.start()
        logger.info("KV sender on tcp://%s:%d (%s)", host, self.port, self.layout)

    def _serve(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        decoder = msgspec.msgpack.Decoder(Pull)
        while not self._stop.is_set():
            if self.janitor is not None:
                self.janitor.sweep()
            if self._parked:
                self._retry_parked(encoder)
            if not self._socket.poll(PARKED_POLL_MS if self._parked else POLL_MS):
                continue
            identity, payload = self._socket.recv_multipart()
            try:
                pull = decoder.decode(payload)
            except msgspec.DecodeError as exc:
                self._socket.send_multipart([identity, encoder.encode(
                    PullReply(False, f"malformed pull: {exc}"))])
                continue
            if self.leases.knows(pull.request_id):
                self._answer(identity, pull, encoder)
            else:
                self._parked.append((time.monotonic() + self.park_s, identity, pull))

    def _retry_parked(self, encoder) -> None:
        """Answer the waiting pulls whose lease came, and refuse those that waited too long."""
        now, waiting = time.monotonic(), []
        for give_up_at, identity, pull in self._parked:
            if self.leases.knows(pull.request_id) or now > give_up_at:
                self._answer(identity, pull, encoder)
            else:
                waiting.append((give_up_at, identity, pull))
        self._parked = waiting

    def _answer(self, identity: bytes, pull: Pull, encoder) -> None:
        if self.leases.is_stalled(pull.request_id):
            return  # test-only fault: a sender hung mid-transfer (the puller times out)
        if pull.layout != self.layout:
            reply, frames = PullReply(False, f"KV layouts differ: the sender has {self.layout}, "
                                             f"the puller {pull.layout}"), []
        else:
            block_ids = self.leases.begin_pull(pull.request_id)
            if block_ids is None:
                reply, frames = PullReply(False, f"no KV held for {pull.request_id!r} (unknown, "
                                                 f"expired or already pulled)"), []
            else:
                try:
                    reply, frames = self._blocks(block_ids[pull.first_block:],
                                                 pull.host_id == self.host_id)
                    self._count(pull.host_id, reply)
                finally:
                    self.leases.end_pull(pull.request_id)
        self._socket.send_multipart([identity, encoder.encode(reply), *frames], copy=False)

    def _blocks(self, block_ids: list[int], same_host: bool) -> tuple[PullReply, list]:
        """The reply and its frames: the blocks through shared memory when the puller is on
        this host (falling back to frames when /dev/shm cannot take them), else as frames."""
        index = torch.tensor(block_ids, dtype=torch.long)
        if same_host and self.use_shm:
            try:
                path = write_blocks(self.kv_caches, index)
                self.janitor.created(path)
                return PullReply(True, num_blocks=len(block_ids), shm_path=path), []
            except OSError as exc:
                logger.warning("KV through /dev/shm failed (%s): sending frames", exc)
        frames = [cache.index_select(1, index).view(torch.uint8).numpy()
                  for cache in self.kv_caches]
        return PullReply(True, num_blocks=len(block_ids)), frames

    def _count(self, puller_host: str, reply: PullReply) -> None:
        """Count the pull by transport; say once per puller host how its pulls go."""
        transport = "shm" if reply.shm_path else "frames"
        self.pulls_by_transport[transport] += 1
        if puller_host not in self._puller_hosts:
            self._puller_hosts.add(puller_host)
            logger.info("KV pulls from host %r go %s", puller_host or "(not said)",
                        "through /dev/shm" if reply.shm_path else "as TCP frames")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self.janitor is not None:
            self.janitor.close()
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()


def pull_into(context: zmq.Context, host: str, port: int, request_id: str,
              kv_caches: list[torch.Tensor], block_ids: list[int], timeout_s: float,
              use_shm: bool = True, first_block: int = 0, secret: str | None = None) -> int:
    """Pull a held request's blocks, from its `first_block`th on, into `block_ids` of kv_caches
    (as many as both have); returns how many blocks arrived. Raises KVTransferError when the
    sender refuses or does not answer within timeout_s. `secret`: the sender's shared secret
    (default $KVSERVE_ZMQ_SECRET; none: a plain connection)."""
    layout = KVLayout.of(kv_caches)
    host_id = host_identity() if use_shm and shm_available() else ""
    keys = curve_keys(secret)
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        make_client(socket, keys)
        socket.connect(f"tcp://{host}:{port}")
        socket.send(msgspec.msgpack.encode(Pull(request_id, layout, host_id, first_block)))
        if not socket.poll(int(timeout_s * 1000)):
            raise KVTransferError(f"no answer from the KV sender at {host}:{port} in "
                                  f"{timeout_s:g}s (dead, hung, or it expects another "
                                  f"KVSERVE_ZMQ_SECRET than this engine's)")
        header, *frames = socket.recv_multipart(copy=False)
    finally:
        socket.close(linger=0)
    reply = msgspec.msgpack.decode(header.buffer, type=PullReply)
    if not reply.ok:
        raise KVTransferError(reply.error)
    count = min(len(block_ids), reply.num_blocks)
    index = torch.tensor(block_ids[:count], dtype=torch.long)
    if reply.shm_path:
        try:
            read_blocks(reply.shm_path, kv_caches, index, reply.num_blocks)
        except OSError as exc:
            raise KVTransferError(f"cannot read the KV the sender left in "
                                  f"{reply.shm_path}: {exc}") from exc
        return count
    if len(frames) != layout.num_layers:
        raise KVTransferError(f"{len(frames)} layers received, {layout.num_layers} expected")
    with warnings.catch_warnings():  # read-only buffers: only read, then copied
        warnings.simplefilter("ignore", UserWarning)
        # the layouts agreed, so the sender's layers have this side's page shapes
        for cache, frame, shape in zip(kv_caches, frames,
                                       block_run_shapes(kv_caches, reply.num_blocks)):
            layer = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(
                layout.torch_dtype).view(shape)
            cache.index_copy_(1, index, layer[:, :count])
    return count
