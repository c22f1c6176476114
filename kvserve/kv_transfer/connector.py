"""The two sides of the KV connector (vLLM v1's split), for an engine with its KV in its own
process (the `uni` executor).

- `KVConnectorScheduler` (the engine core's scheduler consults it): which waiting requests load
  their prompt's KV from elsewhere, which finished requests keep their blocks for a decode
  engine (and the handle they answer with), and which held blocks may be freed now.
- `KVConnectorWorker` (beside the KV tensors): pulls a request's blocks on a background thread
  into the blocks the scheduler gave it, and serves this engine's held blocks to others.

Loads run between steps on their own thread, so a request whose KV is in flight waits without
holding up the others; the scheduler sees its result at the start of a later step.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import zmq

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.leases import LeaseTable
from kvserve.kv_transfer.tcp import KVSender, KVTransferError, pull_into
from kvserve.protocol.kv_transfer_params import KVTransferParams

if TYPE_CHECKING:  # the engine core's request; the core imports this package, not the reverse
    from kvserve.core.request import Request

logger = logging.getLogger(__name__)

LOAD_THREADS = 2


class KVConnectorWorker:
    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor],
                 leases: LeaseTable):
        self.config = config
        self.kv_caches = kv_caches
        self.sender = KVSender(kv_caches, leases, config.host, config.port,
                               config.transport == "shm", config.transfer_timeout_s) \
            if config.produces else None
        self._context = zmq.Context()
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-load") \
            if config.consumes else None
        self._finished: queue.Queue[tuple[str, str | None]] = queue.Queue()

    def start_load(self, request_id: str, params: KVTransferParams,
                   block_ids: list[int], first_block: int = 0) -> None:
        """Pull `params`' blocks from its `first_block`th on into `block_ids` (in order) on a
        load thread; the outcome comes back through `finished_loads`."""
        self._pool.submit(self._load, request_id, params, list(block_ids), first_block)

    def _load(self, request_id: str, params: KVTransferParams, block_ids: list[int],
              first_block: int) -> None:
        try:
            pull_into(self._context, params.remote_host, params.remote_port,
                      params.remote_request_id, self.kv_caches, block_ids,
                      self.config.transfer_timeout_s, self.config.transport == "shm",
                      first_block)
            self.report(request_id, None)
        except KVTransferError as exc:
            self.report(request_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported as this request's failed load
            logger.exception("KV load of %s failed", request_id)
            self.report(request_id, f"{type(exc).__name__}: {exc}")

    def report(self, request_id: str, error: str | None) -> None:
        """A load's outcome, for `finished_loads` (also for loads refused before starting)."""
        self._finished.put((request_id, error))

    def finished_loads(self, wait_s: float = 0.0) -> list[tuple[str, str | None]]:
        """(request id, error or None) of every load ended since the last call; waits up to
        `wait_s` for the first when none has."""
        done = []
        try:
            done.append(self._finished.get(timeout=wait_s) if wait_s > 0
                        else self._finished.get_nowait())
            while True:
                done.append(self._finished.get_nowait())
        except queue.Empty:
            pass
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()
        self._context.term()


class KVConnectorScheduler:
    def __init__(self, config: KVTransferConfig, worker: KVConnectorWorker,
                 leases: LeaseTable):
        self.config = config
        self.worker = worker
        self.leases = leases
        self.engine_id = uuid.uuid4().hex  # names this engine's run in the handles it gives
        self._lock = threading.Lock()

    # ---- decode side -----------------------------------------------------------------------
    def wants_load(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return (self.config.consumes and params is not None and params.wants_load
                and not request.kv_load_attempted)

    def start_load(self, request: Request, block_ids: list[int], first_block: int = 0) -> None:
        """Pull the request's blocks from `first_block` on (those before it are this engine's
        prefix-cache hit) into `block_ids`."""
        request.kv_load_attempted = True
        params = request.kv_transfer_params
        if params.num_prompt_tokens and params.num_prompt_tokens != request.num_prompt_tokens:
            self.worker.report(request.request_id, (
                f"the prefill engine's prompt has {params.num_prompt_tokens} tokens, this one "
                f"{request.num_prompt_tokens}: not the same prompt"))
            return
        self.worker.start_load(request.request_id, params, block_ids, first_block)

    def finished_loads(self, wait_s: float = 0.0) -> list[tuple[str, str | None]]:
        return self.worker.finished_loads(wait_s)

    # ---- prefill side ----------------------------------------------------------------------
    def should_hold(self, request: Request, finish_reason: str) -> bool:
        params = request.kv_transfer_params
        return (self.config.produces and params is not None and params.do_remote_decode
                and finish_reason in ("length", "stop"))

    def hold(self, request: Request, block_ids: list[int]) -> None:
        """Keep the request's blocks for a decode engine and set the handle its last output
        carries."""
        self.leases.hold(request.request_id, block_ids, self.config.hold_timeout_s)
        request.kv_handle = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id,
            remote_request_id=request.request_id, remote_block_ids=list(block_ids),
            remote_host=self.config.host, remote_port=self.worker.sender.port,
            num_prompt_tokens=request.num_prompt_tokens)

    def releasable(self) -> list[str]:
        return self.leases.take_releasable()

    def close(self) -> None:
        self.worker.close()


def make_connector(config: KVTransferConfig, kv_caches: list[torch.Tensor]
                   ) -> KVConnectorScheduler:
    leases = LeaseTable()
    return KVConnectorScheduler(config, KVConnectorWorker(config, kv_caches, leases), leases)
