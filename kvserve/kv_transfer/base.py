"""The KV connector interface (vLLM v1's split): one class, built twice per engine, once per
role.

- Its **scheduler side** lives in the engine core beside the scheduler and speaks block ids:
  which waiting requests find tokens elsewhere (`get_num_new_matched_tokens`), which blocks
  to fill once allocated (`update_state_after_alloc`), what every worker must load, save or
  serve this step (`build_connector_meta`, carried inside the step's ExecuteStep), which
  finished requests keep their blocks and what their output hands on (`request_finished`),
  what the workers finished (`update_connector_output`), and, if it wants them, the prefix
  cache's evictions (`on_evict`).
- Its **worker side** lives in every Worker (one per rank, whatever executor holds it) beside
  that rank's KV tensors: `register_kv_caches`, `start_load_kv(metadata)` before the forward,
  `wait_for_layer_load(layer)` / `save_kv_layer(layer, ...)` around each decoder layer,
  `wait_for_save()` after it, and `get_finished()` after every step. The scheduler side hears
  of a request's transfer once every rank reported it (kv_transfer/aggregator.py).

A connector that moves whole requests between steps (ours, `TcpConnector`) leaves the layer
hooks as they are here; the model calls them only for connectors that override them, so
others pay nothing per layer. Connectors are named in `--kv-transfer-config`'s
`kv_connector` (kv_transfer/factory.py).
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import msgspec

if TYPE_CHECKING:  # the engine core's types: the core imports this package, not the reverse
    import torch

    from kvserve.core.request import Request
    from kvserve.core.scheduler import SchedulerOutput
    from kvserve.kv_transfer.config import KVTransferConfig
    from kvserve.protocol.kv_transfer_params import KVTransferParams


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"  # in the engine core
    WORKER = "worker"  # in each Worker


@dataclass(frozen=True)
class KVConnectorContext:
    """Where a connector runs: the engine's block size and parallel layout, and for the worker
    side its rank (global: stage x tensor size + tensor rank)."""

    block_size: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the scheduler side tells every worker in one step; each connector subclasses it
    (it crosses to worker processes as msgpack, so plain msgspec fields only)."""


class KVConnectorBase(ABC):
    """Subclass it, implement the abstract methods of both sides, and name the class in
    `--kv-transfer-config` ({"kv_connector": "module:Class", "kv_role": ...}). Each instance
    serves one role: the scheduler side's methods are called only on the SCHEDULER instance,
    the worker side's only on the WORKER ones."""

    metadata_type: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 context: KVConnectorContext):
        self.config = config
        self.role = role
        self.context = context

    # ---- scheduler side (engine core) ---------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the local prefix hit (`num_computed_tokens`) whose KV this connector
        can provide, and whether they load asynchronously (between steps: the request waits,
        holding its blocks, while others run) or within the next step (before the forward that
        reads them). No side effects: it may be asked again, e.g. when the pool is full."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request got blocks for the tokens promised (`block_ids`: its whole table, the
        prefix hit's blocks first; `request.num_computed_tokens` is the hit). Note what to
        load where, for the next `build_connector_meta`."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> KVConnectorMetadata | None:
        """What every worker must do this step; None when nothing. Called at the end of each
        `schedule()`, and again once the step's results are in (requests it finished may have
        left work, e.g. blocks to serve): that metadata goes out at once in a step of its own."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferParams | None]:
        """Once per finished request (stop, length, abort), before its blocks are freed: True
        to keep them until every worker reports the request in `finished_sending`, and the
        `kv_transfer_params` its last output carries."""

    def update_connector_output(self, output) -> None:
        """Transfers every rank finished (a KVConnectorOutput), before the scheduler acts on
        them (loaded requests run, sent ones' blocks are freed)."""

    def set_handshake_metadata(self, per_rank: list[dict | None]) -> None:
        """Each rank's `get_handshake_metadata()`, rank order, once the KV caches exist."""

    def on_evict(self, block_hashes: list[int], block_ids: list[int]) -> None:
        """The prefix cache dropped these blocks (block_ids[i] held block_hashes[i]), drained
        once per step just before `build_connector_meta`: the blocks' contents are intact
        until that step's forward, so an offload tier may still save them then. Only
        connectors that override this make the block pool record evictions."""

    # ---- worker side (every Worker) -----------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """This rank's KV tensors, one per decoder layer it runs (its pipeline stage's), each
        its layer's page layout (attention/kv_tensors.py KVPageLayout.shape): [planes, blocks,
        block_size, heads, row], blocks always on dim 1 (standard attention: [2, blocks,
        block_size, kv_heads of this rank, head_dim]); layers may differ in shape."""

    def get_handshake_metadata(self) -> dict | None:
        """What the scheduler side must know of this rank (JSON-able), after
        `register_kv_caches`."""
        return None

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Before each step's forward (also steps with nothing scheduled), with the step's
        metadata or None."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Before decoder layer `layer` (index into the registered caches) reads its KV."""

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, attn_metadata) -> None:
        """After decoder layer `layer` wrote this step's KV into `kv_cache`."""

    def wait_for_save(self) -> None:
        """After the forward: saves this step started that must end before the next one."""

    @abstractmethod
    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        """After each step: (requests whose blocks this rank no longer reads for a send,
        requests whose load into this rank ended), each reported once. `finished_req_ids`:
        requests the engine finished since the last step."""

    def get_load_errors(self) -> dict[str, str]:
        """Of the loads the last `get_finished` reported, those that failed and why."""
        return {}

    def wait_for_finished(self, timeout_s: float) -> None:
        """Block until a transfer may have finished, or `timeout_s`: called when the engine
        has nothing to run but transfers and its worker is in the core's process (`uni`).
        Connectors that finish transfers on their own threads wake it up early."""
        time.sleep(timeout_s)

    # ---- both -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop threads and close sockets."""


def overrides(connector: KVConnectorBase, method: str) -> bool:
    """Whether the connector's class replaces the base's (no-op) `method`: the engine wires
    the per-layer hooks and eviction records only for connectors that use them."""
    return getattr(type(connector), method) is not getattr(KVConnectorBase, method)


def uses_layer_hooks(connector: KVConnectorBase) -> bool:
    return overrides(connector, "wait_for_layer_load") or overrides(connector, "save_kv_layer")
