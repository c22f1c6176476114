"""`OffloadingConnector`: the KV offload tiers as one KV connector (vLLM's name for its native
offloading; `--kv-offload-ram-bytes`, `--kv-offload-disk-dir`, `--kv-offload-disk-bytes`, or
vLLM's `--kv-offloading-size`).

Scheduler side (engine core):
- Each block the prefix cache evicts (`on_evict`, drained just before the step's metadata is
  built, while the block still holds its KV) is saved to every tier that lacks it; each tier
  keeps its least recently used blocks within its capacity (index.py).
- A waiting request whose prefix misses the pool is looked up in the tiers, block after block
  from where the pool's hit ends; the run of blocks found is loaded between steps
  (asynchronously: the request waits, holding its blocks, while others run), and counts as
  cached tokens. A load that fails (a corrupt or missing file) recomputes from the pool's hit,
  and the load's blocks leave the index.

Worker side (every rank, its own heads and layers): saves copy the blocks out synchronously
before the step's forward can overwrite them, into the RAM tier and/or a queue that one writer
thread empties to disk (store.py: atomic, checksummed files); loads run on a loader thread,
from RAM, a block still waiting to be written, or disk, and copy into the request's blocks.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from hashlib import blake2b
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvserve.kernels.omp_teams import run_alone
from kvserve.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.load_reports import LoadReports
from kvserve.kv_transfer.offload import store
from kvserve.kv_transfer.offload.index import DISK, RAM, TierIndex
from kvserve.kv_transfer.offload.load_cost import LoadCost
from kvserve.protocol.block_hash import hash_block_tokens

if TYPE_CHECKING:
    import torch

    from kvserve.core.request import Request
    from kvserve.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_DISK_BYTES = 16 << 30  # a disk tier without --kv-offload-disk-bytes
WRITE_PROBLEM_LOG_EVERY_S = 60.0
# measured: a run is loaded only when that is expected to be faster than recomputing it
# (load_cost.py); always: every run a tier holds is loaded
LOAD_POLICIES = ("measured", "always")
# the KV-event medium of each tier's blocks (vLLM's offloading connector calls host memory CPU)
TIER_MEDIA = {RAM: "CPU", DISK: "DISK"}
MAX_UNWRITTEN_BYTES = 512 << 20  # a rank's saved blocks waiting for the disk writer


class OffloadSave(msgspec.Struct, array_like=True):
    """Copy block `block_id`, which holds `block_hash`, into the RAM tier and/or to disk."""

    block_hash: int
    block_id: int
    to_ram: bool
    to_disk: bool


class OffloadLoad(msgspec.Struct, array_like=True):
    """Fill the request's `block_ids` with the tiers' copies of `block_hashes`."""

    request_id: str
    block_hashes: list[int]
    block_ids: list[int]


class OffloadMetadata(KVConnectorMetadata):
    saves: list[OffloadSave] = []
    loads: list[OffloadLoad] = []
    drop_ram: list[int] = []
    drop_disk: list[int] = []


class OffloadingConnector(KVConnectorBase):
    metadata_type = OffloadMetadata
    # the scheduler counts what this connector loads as prefix-cache hits (usage's
    # cached_tokens), not as KV that came from another engine
    loads_are_cache_hits = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 context: KVConnectorContext):
        super().__init__(config, role, context)
        extra = config.extra_config
        self.ram_bytes = int(extra.get("ram_bytes") or 0)
        self.disk_dir = extra.get("disk_dir") or None
        self.disk_bytes = int(extra.get("disk_bytes") or DEFAULT_DISK_BYTES)
        self.fingerprint = str(extra.get("fingerprint", ""))
        self.load_policy = str(extra.get("load_policy") or "measured")
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy {self.load_policy!r}: choose one of "
                             f"{', '.join(LOAD_POLICIES)}")
        if self.ram_bytes <= 0 and not self.disk_dir:
            raise ValueError("OffloadingConnector needs kv_connector_extra_config ram_bytes "
                             "> 0 and/or disk_dir (--kv-offload-ram-bytes, "
                             "--kv-offload-disk-dir)")
        # scheduler side
        self.ram = TierIndex(RAM, 0)
        self.disk = TierIndex(DISK, 0)
        self._pending = OffloadMetadata([], [], [], [])
        self._loading: dict[str, list[int]] = {}  # request id -> the hashes it loads
        self._failed: set[str] = set()  # requests whose load failed: they recompute
        self._issued: dict[str, tuple[float, int]] = {}  # request id -> (when, blocks)
        self.cost = LoadCost()
        # (medium, stored hashes, removed hashes) for the KV event publisher, when it is on
        self._changes: list[tuple[str, list[int], list[int]]] | None = None
        self.stats = {"saved_blocks": 0, "loaded_blocks": 0, "failed_loads": 0,
                      "recomputed_runs": 0}
        # worker side
        self.kv_caches: list[torch.Tensor] = []
        self.block_bytes = 0
        self.folder: Path | None = None
        self.layout = b""
        self._ram_blocks: dict[int, torch.Tensor] = {}
        self._unwritten: dict[int, torch.Tensor] = {}  # saved to disk, not yet written
        self._lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None
        self._loader: ThreadPoolExecutor | None = None
        self.load_reports = LoadReports()
        self._fetched: queue.Queue = queue.Queue()  # (load, rows) read, not yet copied in
        self._write_problem_logged_at = 0.0

    # ---- scheduler side ------------------------------------------------------------------
    def set_handshake_metadata(self, per_rank: list[dict | None]) -> None:
        """Capacities in blocks from the ranks' block sizes; the disk tier starts with what
        an earlier run left in this layout's folder."""
        block_bytes = sum(info["block_bytes"] for info in per_rank)
        self.ram.capacity = self.ram_bytes // block_bytes
        if self.disk_dir:
            self.disk.capacity = self.disk_bytes // block_bytes
            self.folder = store.layout_folder(self.disk_dir, bytes.fromhex(per_rank[0]["layout"]))
            found = store.scan(self.folder, len(per_rank))
            for block_hash in found:
                self._pending.drop_disk += self.disk.add(block_hash)
            self._announce(DISK, [h for h in found if h in self.disk], [])
        logger.info("KV offload: RAM tier %d blocks, disk tier %d blocks%s (%d blocks found "
                    "from an earlier run)", self.ram.capacity, self.disk.capacity,
                    f" in {self.folder}" if self.folder else "", len(self.disk))

    def on_evict(self, block_hashes: list[int], block_ids: list[int]) -> None:
        pending = self._pending
        stored: dict[str, list[int]] = {RAM: [], DISK: []}
        dropped: dict[str, list[int]] = {RAM: [], DISK: []}
        for block_hash, block_id in zip(block_hashes, block_ids):
            to_ram = self.ram.capacity > 0 and block_hash not in self.ram
            to_disk = self.disk.capacity > 0 and block_hash not in self.disk
            if not (to_ram or to_disk):
                self.ram.touch(block_hash)
                self.disk.touch(block_hash)
                continue
            for tier, wanted in ((self.ram, to_ram), (self.disk, to_disk)):
                if wanted:
                    dropped[tier.name] += tier.add(block_hash)
                    stored[tier.name].append(block_hash)
            pending.saves.append(OffloadSave(block_hash, block_id, to_ram, to_disk))
            self.stats["saved_blocks"] += 1
        pending.drop_ram += dropped[RAM]
        pending.drop_disk += dropped[DISK]
        for tier in (RAM, DISK):
            self._announce(tier, stored[tier], dropped[tier])

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """The run of blocks after the pool's hit that some tier holds; never the request's
        last token. Asked again when a preempted request comes back: its blocks, evicted
        from the pool meanwhile, come back from the tiers (swap preemption) instead of being
        recomputed. After a failed load the request recomputes; with the `measured` load
        policy, so does a run that loading is expected to make slower (LoadCost)."""
        if request.request_id in self._failed:
            return 0, False
        size = self.context.block_size
        first = num_computed_tokens // size
        hashes = self._block_hashes(request, (request.num_tokens - 1) // size)
        count = 0
        for block_hash in hashes[first:]:
            if block_hash not in self.ram and block_hash not in self.disk:
                break
            count += 1
        if count and self.load_policy == "measured" and not self.cost.load_pays(count, size):
            self.stats["recomputed_runs"] += 1
            return 0, False
        return count * size, count > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        size = self.context.block_size
        first = request.num_computed_tokens // size
        count = num_external_tokens // size
        hashes = self._block_hashes(request, first + count)[first:]
        for block_hash in hashes:
            self.ram.touch(block_hash)
            self.disk.touch(block_hash)
        self._loading[request.request_id] = hashes
        self._issued[request.request_id] = (time.monotonic(), count)
        self._pending.loads.append(OffloadLoad(request.request_id, hashes,
                                               block_ids[first:first + count]))
        self.stats["loaded_blocks"] += count

    def update_connector_output(self, output) -> None:
        """A failed load's blocks leave both tiers (the workers drop their copies): one of
        them was bad, and they are saved again when the pool next evicts them."""
        now = time.monotonic()
        for request_id in output.finished_recving:
            hashes = self._loading.pop(request_id, [])
            issued = self._issued.pop(request_id, None)
            if issued is not None and request_id not in output.load_errors:
                self.cost.on_load(issued[1], now - issued[0])
            if request_id in output.load_errors:
                self.stats["failed_loads"] += 1
                self._failed.add(request_id)
                for block_hash in hashes:
                    if self.ram.discard(block_hash):
                        self._pending.drop_ram.append(block_hash)
                        self._announce(RAM, [], [block_hash])
                    if self.disk.discard(block_hash):
                        self._pending.drop_disk.append(block_hash)
                        self._announce(DISK, [], [block_hash])

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> OffloadMetadata | None:
        self.cost.on_schedule(time.monotonic(), scheduler_output.num_batched_tokens,
                              len(scheduler_output.scheduled))
        pending = self._pending
        if not (pending.saves or pending.loads or pending.drop_ram or pending.drop_disk):
            return None
        self._pending = OffloadMetadata([], [], [], [])
        return pending

    # ---- KV events: what the tiers hold, for a KV-aware router -----------------------------
    def enable_tier_changes(self) -> None:
        self._changes = []

    def take_tier_changes(self) -> list[tuple[str, list[int], list[int]]]:
        """(medium, hashes stored, hashes removed) since the last call; kv_events.py turns them
        into BlockStored / BlockRemoved events under the tier's medium."""
        if self._changes is None:
            return []
        changes, self._changes = self._changes, []
        return changes

    def _announce(self, tier: str, stored: list[int], removed: list[int]) -> None:
        """Blocks a tier gained and lost (a block that left the pool for a tier is still this
        replica's to load). Nothing recorded when events are off."""
        if self._changes is not None and (stored or removed):
            self._changes.append((TIER_MEDIA[tier], list(stored), list(removed)))

    def request_finished(self, request: Request, block_ids: list[int]):
        self._failed.discard(request.request_id)
        self._issued.pop(request.request_id, None)  # aborted while its load ran: no sample
        return False, None

    def _block_hashes(self, request: Request, count: int) -> list[int]:
        """The request's first `count` chained block hashes (the pool's, where it computed
        them already)."""
        hashes = list(request.block_hashes[:count])
        size, tokens = self.context.block_size, request.all_token_ids
        parent = hashes[-1] if hashes else request.hash_root
        for index in range(len(hashes), count):
            parent = hash_block_tokens(parent, tokens[index * size:(index + 1) * size])
            hashes.append(parent)
        return hashes

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        # this rank's bytes of one block, all its layers (a file's payload, a save's row)
        self.block_bytes = sum(cache[:, 0].numel() * cache.element_size()
                               for cache in kv_caches)
        context = self.context
        first = kv_caches[0]
        layout = "|".join([self.fingerprint, str(context.block_size),
                           str(context.tensor_parallel_size),
                           str(context.pipeline_parallel_size), str(first.dtype)])
        self.layout = blake2b(layout.encode(), digest_size=16).digest()
        if self.disk_dir:
            self.folder = store.layout_folder(self.disk_dir, self.layout)
            self.folder.mkdir(parents=True, exist_ok=True)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-write",
                                              initializer=_lower_priority)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-load",
                                          initializer=run_alone)


    def get_handshake_metadata(self) -> dict | None:
        return {"block_bytes": self.block_bytes, "layout": self.layout.hex()}

    def start_load_kv(self, metadata: OffloadMetadata | None) -> None:
        if metadata is None:
            return
        for block_hash in metadata.drop_ram:
            self._ram_blocks.pop(block_hash, None)
        for block_hash in metadata.drop_disk:
            self._writer.submit(store.remove_block, self.folder, block_hash, self.context.rank)
        if metadata.saves:
            self._save(metadata.saves)
        for load in metadata.loads:
            self._loader.submit(self._load, load)

    def _save(self, saves: list[OffloadSave]) -> None:
        """Copy the blocks out now (the step's forward may overwrite them), one gather per
        layer; disk writes go to the writer thread."""
        import torch

        ids = torch.tensor([save.block_id for save in saves])
        rows = torch.cat([cache[:, ids].transpose(0, 1).reshape(len(saves), -1)
                          for cache in self.kv_caches], dim=1)
        for save, row in zip(saves, rows):
            if save.to_ram:  # its own storage: the tier's budget counts block by block
                self._ram_blocks[save.block_hash] = row.clone()
            if save.to_disk and self._may_queue_write():
                with self._lock:
                    self._unwritten[save.block_hash] = row
                self._writer.submit(self._write, save.block_hash, row)

    def _may_queue_write(self) -> bool:
        """False when the writer is too far behind (a slow disk under a steady stream of
        evictions): that block is not written, and recomputed if it is asked for."""
        if len(self._unwritten) * self.block_bytes < MAX_UNWRITTEN_BYTES:
            return True
        self._log_write_problem("the disk writer is behind by "
                                f"{MAX_UNWRITTEN_BYTES >> 20} MiB")
        return False

    def _log_write_problem(self, problem) -> None:
        now = time.monotonic()
        if now - self._write_problem_logged_at >= WRITE_PROBLEM_LOG_EVERY_S:
            self._write_problem_logged_at = now
            logger.warning("KV offload: %s; blocks not written to %s are recomputed when "
                           "asked for", problem, self.folder)

    def _write(self, block_hash: int, row: torch.Tensor) -> None:
        import torch

        try:
            store.write_block(self.folder, self.layout, block_hash, self.context.rank,
                              row.view(torch.uint8).numpy().data)
        except OSError as exc:  # a full disk: the block is recomputed when needed
            self._log_write_problem(f"a write failed ({exc})")
        finally:
            with self._lock:
                if self._unwritten.get(block_hash) is row:
                    del self._unwritten[block_hash]

    def _load(self, load: OffloadLoad) -> None:
        """On the loader thread: find and check the blocks' bytes, no torch op. The copy into
        the KV tensors happens on the worker's own thread (`get_finished`): a torch op on
        another thread starts a second OpenMP team, whose threads spin after each op and took
        the model's cores (decode 12.6 against 6.9 ms a token, docs/performance-journal.md)."""
        try:
            rows = [self._block_row(block_hash) for block_hash in load.block_hashes]
        except store.CorruptBlockError as exc:
            self.load_reports.report(load.request_id, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - reported as this request's failed load
            logger.exception("KV offload: loading %s failed", load.request_id)
            self.load_reports.report(load.request_id, f"{type(exc).__name__}: {exc}")
            return
        self._fetched.put((load, rows))
        self.load_reports.nudge()

    def _scatter_fetched(self) -> None:
        """Copy the blocks the loader found into the requests' blocks, and report them."""
        while True:
            try:
                load, rows = self._fetched.get_nowait()
            except queue.Empty:
                return
            try:
                self._scatter(rows, load.block_ids)
                self.load_reports.report(load.request_id, None)
            except Exception as exc:  # noqa: BLE001 - reported as this request's failed load
                logger.exception("KV offload: loading %s failed", load.request_id)
                self.load_reports.report(load.request_id, f"{type(exc).__name__}: {exc}")

    def _block_row(self, block_hash: int) -> torch.Tensor:
        """One block's saved row: from RAM, a write still queued, or its file."""
        import torch

        row = self._ram_blocks.get(block_hash)
        if row is None:
            with self._lock:
                row = self._unwritten.get(block_hash)
        if row is not None:
            return row
        if self.folder is None:
            raise store.CorruptBlockError(f"block {block_hash:016x} is in no tier")
        payload = store.read_block(self.folder, self.layout, block_hash, self.context.rank,
                                   self.block_bytes)
        dtype = self.kv_caches[0].dtype
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)

    def _scatter(self, rows: list[torch.Tensor], block_ids: list[int]) -> None:
        import torch

        ids = torch.tensor(block_ids)
        stacked = torch.stack(rows)
        offset = 0
        for cache in self.kv_caches:
            per_block = cache[:, 0].numel()
            part = stacked[:, offset:offset + per_block]
            cache[:, ids] = part.reshape(len(block_ids), *cache[:, 0].shape).transpose(0, 1)
            offset += per_block

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        self._scatter_fetched()
        return set(), self.load_reports.take_finished()

    def get_load_errors(self) -> dict[str, str]:
        return self.load_reports.take_errors()

    def wait_for_finished(self, timeout_s: float) -> None:
        self.load_reports.wait(timeout_s)

    def shutdown(self) -> None:
        """Queued disk writes finish first (a clean stop keeps every saved block)."""
        for pool in (self._loader, self._writer):
            if pool is not None:
                pool.shutdown(wait=True)


WRITER_NICENESS = 10


def _lower_priority() -> None:
    """The disk writer yields the cores to the model's threads: its writes can wait, and on
    2 cores a writer beside torch's threads slowed the steps (+20% prefill time with the disk
    tier on, docs/performance-journal.md). It runs alone, too: no OpenMP team of its own (see
    kernels/omp_teams.py)."""
    run_alone()
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError):  # not Linux: the thread keeps the process's priority
        pass
