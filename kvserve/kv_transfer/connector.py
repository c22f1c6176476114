"""`TcpConnector`: disaggregated prefill and decode, whole requests pulled between steps over
ZeroMQ (tcp.py; /dev/shm on one host), as one KV connector (base.py).

Scheduler side (engine core): a decode engine's request carrying a handle loads every prompt
token after its own prefix-cache hit, asynchronously; a prefill engine's request that asked
for it (`do_remote_decode`) keeps its blocks when it finishes and answers with the handle.
Worker side (every rank): each rank pulls its own shard (its KV heads, its stage's layers)
from the same rank of the prefill engine on load threads, and serves its shard of held blocks
from its own `KVSender` (port `kv_port + rank`, or a free one), under a lease per request
(leases.py). So both engines need the same tensor and pipeline parallel sizes. The layer
hooks are the base's no-ops: nothing moves during the forward.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvserve.kernels.omp_teams import run_alone
from kvserve.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.leases import LeaseTable
from kvserve.kv_transfer.load_reports import LoadReports
from kvserve.kv_transfer.tcp import KVSender, KVTransferError, pull_into
from kvserve.protocol.kv_transfer_params import KVTransferParams

if TYPE_CHECKING:
    import torch

    from kvserve.core.request import Request
    from kvserve.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

LOAD_THREADS = 2


class TcpLoad(msgspec.Struct, array_like=True, omit_defaults=True):
    """Pull `remote_request_id`'s blocks from `first_block` on into `block_ids`, rank r from
    `remote_hosts[r]:remote_ports[r]`; or, with `error`, report that failure at once."""

    request_id: str
    remote_request_id: str = ""
    remote_hosts: list[str] = []
    remote_ports: list[int] = []
    block_ids: list[int] = []
    first_block: int = 0
    error: str = ""


class TcpServe(msgspec.Struct, array_like=True):
    """Serve these blocks of a finished request to one puller, until the hold timeout."""

    request_id: str
    block_ids: list[int]


class TcpConnectorMetadata(KVConnectorMetadata):
    loads: list[TcpLoad] = []
    serves: list[TcpServe] = []


class TcpConnector(KVConnectorBase):
    metadata_type = TcpConnectorMetadata

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 context: KVConnectorContext):
        super().__init__(config, role, context)
        # scheduler side
        self.engine_id = uuid.uuid4().hex  # names this engine's run in the handles it gives
        self._addresses: list[tuple[str, int]] = []  # each rank's sender
        self._loads: list[TcpLoad] = []
        self._serves: list[TcpServe] = []
        # worker side
        self.leases = LeaseTable()
        self.sender: KVSender | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._context = zmq.Context() if role is KVConnectorRole.WORKER else None
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-load",
                                        initializer=run_alone) \
            if role is KVConnectorRole.WORKER and config.consumes else None
        self.load_reports = LoadReports()

    # ---- scheduler side: the decode engine ---------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if (self.config.consumes and params is not None and params.wants_load
                and not request.kv_load_attempted):
            return request.num_tokens - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Pull the blocks after the request's prefix-cache hit; once per request (a preempted
        one recomputes)."""
        request.kv_load_attempted = True
        params = request.kv_transfer_params
        first_block = request.num_computed_tokens // self.context.block_size
        addresses = params.remote_addresses
        self._loads.append(TcpLoad(
            request.request_id, params.remote_request_id, [host for host, _ in addresses],
            [port for _, port in addresses], block_ids[first_block:], first_block,
            self._refusal(request, params)))

    def _refusal(self, request: Request, params: KVTransferParams) -> str:
        """Why this handle cannot load here ("" when it can)."""
        if params.num_prompt_tokens and params.num_prompt_tokens != request.num_prompt_tokens:
            return (f"the prefill engine's prompt has {params.num_prompt_tokens} tokens, this "
                    f"one {request.num_prompt_tokens}: not the same prompt")
        context = self.context
        theirs = (params.tp_size, params.pp_size)
        ours = (context.tensor_parallel_size, context.pipeline_parallel_size)
        if theirs != ours or len(params.remote_addresses) != context.world_size:
            return (f"the prefill engine runs tensor x pipeline parallel {theirs[0]}x{theirs[1]} "
                    f"({len(params.remote_addresses)} KV senders), this one "
                    f"{ours[0]}x{ours[1]}: each rank pulls its shard from the same rank, so "
                    f"both need the same sizes")
        return ""

    # ---- scheduler side: the prefill engine --------------------------------------------------
    def set_handshake_metadata(self, per_rank: list[dict | None]) -> None:
        if self.config.produces:
            self._addresses = [(info["host"], info["port"]) for info in per_rank]

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferParams | None]:
        """Hold the blocks of a finished (stop or length) `do_remote_decode` request for a
        decode engine, and hand out where to pull them; aborts free at once."""
        params = request.kv_transfer_params
        if not (self.config.produces and params is not None and params.do_remote_decode
                and request.finish_reason() in ("length", "stop")):
            return False, None
        self._serves.append(TcpServe(request.request_id, list(block_ids)))
        host, port = self._addresses[0]
        handle = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id,
            remote_request_id=request.request_id, remote_block_ids=list(block_ids),
            remote_host=host, remote_port=port, num_prompt_tokens=request.num_prompt_tokens)
        if self.context.world_size > 1:
            handle.remote_hosts = [host for host, _ in self._addresses]
            handle.remote_ports = [port for _, port in self._addresses]
            handle.tp_size = self.context.tensor_parallel_size
            handle.pp_size = self.context.pipeline_parallel_size
        return True, handle

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> TcpConnectorMetadata | None:
        if not (self._loads or self._serves):
            return None
        metadata = TcpConnectorMetadata(self._loads, self._serves)
        self._loads, self._serves = [], []
        return metadata

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        if self.config.produces:
            config = self.config
            port = config.port + self.context.rank if config.port else 0
            self.sender = KVSender(kv_caches, self.leases, config.host, port,
                                   config.transport == "shm", config.transfer_timeout_s)

    def get_handshake_metadata(self) -> dict | None:
        if self.sender is None:
            return None
        return {"host": _advertised(self.config.host), "port": self.sender.port}

    def start_load_kv(self, metadata: TcpConnectorMetadata | None) -> None:
        if metadata is None:
            return
        for serve in metadata.serves:
            self.leases.hold(serve.request_id, serve.block_ids, self.config.hold_timeout_s)
        for load in metadata.loads:
            if load.error:
                self.load_reports.report(load.request_id, load.error)
            else:
                self._pool.submit(self._load, load)

    def _load(self, load: TcpLoad) -> None:
        rank = self.context.rank
        try:
            pull_into(self._context, load.remote_hosts[rank], load.remote_ports[rank],
                      load.remote_request_id, self.kv_caches, load.block_ids,
                      self.config.transfer_timeout_s, self.config.transport == "shm",
                      load.first_block)
            self.load_reports.report(load.request_id, None)
        except KVTransferError as exc:
            self.load_reports.report(load.request_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported as this request's failed load
            logger.exception("KV load of %s failed", load.request_id)
            self.load_reports.report(load.request_id, f"{type(exc).__name__}: {exc}")

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        return set(self.leases.take_releasable()), self.load_reports.take_finished()

    def get_load_errors(self) -> dict[str, str]:
        return self.load_reports.take_errors()

    def wait_for_finished(self, timeout_s: float) -> None:
        self.load_reports.wait(timeout_s)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()
        if self._context is not None:
            self._context.term()


def _advertised(host: str) -> str:
    """Where decode engines pull from: a wildcard kv_ip binds every interface, so the handle
    names this node's address instead (a Ray rank's node IP)."""
    from kvserve.platform import node_address

    return node_address() if host in ("0.0.0.0", "*") else host
