"""The `ray` executor: the mp executor's workers as Ray actors, so that ranks can sit on several
machines of a Ray cluster.

One actor per rank (tensor x pipeline) in a placement group with one bundle per rank, rank i in
bundle i (strategy PACK unless KVSERVE_RAY_PLACEMENT_STRATEGY says otherwise; bundle 0 on the
engine core's node unless KVSERVE_RAY_RANK_RESOURCES places it: custom resources per rank, e.g.
a Ray node's own `--resources`). Each actor sets KVSERVE_NODE_ID/IP to its Ray node's, so ranks
on two Ray nodes never take one-host shortcuts (platform.host_identity: no /dev/shm all-reduce
or KV) and a rank's KV sender on another node than the engine core's listens on its node's IP.
Each actor holds the same `Worker` as an mp worker process; the ranks meet
over torch.distributed at tcp://<rank 0's node IP>:<a free port there>. Each step every actor gets
the same msgspec-encoded ExecuteStep (Ray runs one caller's calls to an actor in order) and the
output rank's reply carries the samples; any rank's reply may also carry a KV connector report
(kept for `take_kv_reports`). A dead actor (killed, its node lost) or a worker
exception is a WorkerDiedError, as with mp: the engine core ends. Ray itself is started here
(a local instance, no dashboard) unless it is running or RAY_ADDRESS names a cluster; a local
instance started here stops when the last executor using it shuts down.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
import weakref
from collections import deque

import msgspec

from kvserve.engine_config import EngineConfig
from kvserve.executor.base import PipelinedExecutor
from kvserve.executor.mp import WorkerDiedError, _check_model_splits
from kvserve.models import resolve_dtype, resolve_kv_dtype
from kvserve.ports import free_port
from kvserve.protocol.worker import (
    ExecuteStep,
    FromWorker,
    InitKVCache,
    KVCacheReady,
    KVConnectorOutput,
    KVReport,
    ModelRunnerOutput,
    StepResult,
    WorkerReady,
)

logger = logging.getLogger(__name__)

CPUS_PER_RANK_ENV = "KVSERVE_RAY_CPUS_PER_RANK"
STRATEGY_ENV = "KVSERVE_RAY_PLACEMENT_STRATEGY"
RANK_RESOURCES_ENV = "KVSERVE_RAY_RANK_RESOURCES"
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LIVENESS_POLL_SECONDS = 0.2
STARTUP_TIMEOUT_SECONDS = 600.0
PLACEMENT_TIMEOUT_SECONDS = 120.0
STOP_GRACE_SECONDS = 5.0


class RayWorker:
    """The actor around one rank's `Worker`: messages cross as msgspec bytes, as over mp's
    sockets. Made a Ray actor class with `ray.remote` when the executor starts, so this module
    imports without Ray."""

    def __init__(self, env: dict[str, str], log_level: int):
        import ray

        from kvserve.platform import NODE_ID_ENV, NODE_IP_ENV

        os.environ.update(env)  # the engine's KVSERVE_* settings (read lazily by kvserve)
        os.environ[NODE_ID_ENV] = ray.get_runtime_context().get_node_id()
        os.environ[NODE_IP_ENV] = ray.util.get_node_ip_address()
        self.log_level = log_level
        self.worker = None
        self.encoder = msgspec.msgpack.Encoder()
        self.step_decoder = None

    def node_info(self) -> tuple[str, str, int, int]:
        """(node IP, Ray node id, CPU count, pid)."""
        import ray

        return (ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
                os.cpu_count() or 1, os.getpid())

    def free_port(self) -> int:
        return free_port("")

    def describe(self) -> dict:
        """How this rank talks to the others (operators, tests): its Ray node, the host it
        counts as, its all-reduce, and its KV sender's pulls by transport."""
        from kvserve.platform import NODE_ID_ENV, host_identity

        parallel = getattr(self.worker, "parallel", None)
        communicator = getattr(parallel, "communicator", None)
        sender = getattr(getattr(self.worker, "kv_connector", None), "sender", None)
        return {"node_id": os.environ[NODE_ID_ENV], "host_id": host_identity(),
                "all_reduce": getattr(communicator, "name", None),
                "kv_pulls": dict(sender.pulls_by_transport) if sender is not None else None}

    def start(self, config: EngineConfig, rank: int, world_size: int,
              init_method: str) -> tuple[bytes, bool]:
        """Join the group and load this rank's shard: (WorkerReady, is it the output rank)."""
        from kvserve.protocol.worker import ExecuteStep
        from kvserve.worker.worker import Worker

        logging.basicConfig(level=self.log_level, force=True,
                            format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: "
                                   f"%(message)s")
        self.step_decoder = msgspec.msgpack.Decoder(ExecuteStep)
        self.worker = Worker(config, rank, world_size, init_method)
        return self.encoder.encode(self.worker.ready_message()), self.worker.is_output_rank

    def init_kv_cache(self, data: bytes) -> bytes:
        message = msgspec.msgpack.decode(data, type=InitKVCache)
        return self.encoder.encode(self.worker.init_kv_cache(message))

    def execute(self, data: bytes) -> list[bytes]:
        """The step's messages: the StepResult (output rank, scheduled steps) and a KV
        report, each when there is one."""
        try:
            result = self.worker.execute(self.step_decoder.decode(data))
        finally:
            report = self.worker.take_kv_report()
        return [self.encoder.encode(message) for message in (result, report)
                if message is not None]

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor(PipelinedExecutor):
    def __init__(self, config: EngineConfig):
        _check_model_splits(config)
        ray = _import_ray()
        self.config = config
        self.world_size = config.world_size
        self.max_concurrent_batches = config.pipeline_parallel_size
        self.encoder = msgspec.msgpack.Encoder()
        self.reply_decoder = msgspec.msgpack.Decoder(FromWorker)
        self._outputs: deque = deque()  # output rank's refs of scheduled steps, oldest first
        self._calls: list = []  # every other call not yet seen finished: checked for failures
        self._kv_reports: list[KVConnectorOutput] = []
        self._failure: str | None = None
        self._closed = False
        self._held = _Held(owns_ray=_acquire_ray(ray))
        # also when the executor is garbage-collected without shutdown(): actors, placement
        # group and a Ray started here never outlive it (the holder is filled as they start)
        self._finalizer = weakref.finalize(self, _release, self._held)
        try:
            self._start_actors(ray)
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, ray) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cpus = _cpus_per_rank(ray, self.world_size)
        self._held.group = group = _placement_group(ray, self.world_size, cpus)
        actor_class = ray.remote(RayWorker)
        env = {key: value for key, value in os.environ.items() if key.startswith("KVSERVE_")}
        log_level = logging.getLogger().getEffectiveLevel()
        actors = self._held.actors
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            actors.append(actor_class.options(num_cpus=cpus, scheduling_strategy=strategy)
                          .remote(env, log_level))
        nodes = self._gather([actor.node_info.remote() for actor in actors],
                             STARTUP_TIMEOUT_SECONDS)
        self._held.pids = [pid for _, _, _, pid in nodes]
        init_method = _tcp_address(nodes[0][0],
                                   self._gather([actors[0].free_port.remote()], 60.0)[0])
        core_node = ray.get_runtime_context().get_node_id()
        replies = self._gather(
            [actor.start.remote(_rank_config(self.config, nodes, rank, core_node), rank,
                                self.world_size, init_method)
             for rank, actor in enumerate(actors)],
            STARTUP_TIMEOUT_SECONDS)
        ready = [msgspec.msgpack.decode(data, type=WorkerReady) for data, _ in replies]
        self.output_actor = actors[[is_output for _, is_output in replies].index(True)]
        first = ready[0]
        self.model_config = first.model_config
        self.dtype = resolve_dtype(first.dtype)
        self.kv_dtype = resolve_kv_dtype(first.kv_dtype)
        self.quantization = first.quantization
        self.kv_page_bytes = max(worker.kv_page_bytes for worker in ready)
        _log_ready(self.config, nodes, cpus, init_method)

    @property
    def worker_pids(self) -> list[int]:
        """The actors' process ids, rank order (each on its own node: see the logs)."""
        return list(self._held.pids)

    def describe_ranks(self) -> list[dict]:
        """Each rank's RayWorker.describe(), rank order: its node and how it communicates."""
        return self._gather([actor.describe.remote() for actor in self._held.actors], 60.0)

    # ---- the executor interface ------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int, block_size: int,
                            placement: tuple[list[int], list[int]] | None = None,
                            ) -> list[KVCacheReady]:
        data = self.encoder.encode(InitKVCache(num_blocks, block_size, *(placement or ([], []))))
        replies = self._gather([actor.init_kv_cache.remote(data)
                                for actor in self._held.actors], STARTUP_TIMEOUT_SECONDS)
        return [msgspec.msgpack.decode(reply, type=KVCacheReady) for reply in replies]

    def submit(self, step: ExecuteStep) -> None:
        """Every actor gets the step (Ray keeps each actor's calls in order, so a pipeline's
        first stage starts on it while later stages may still run earlier steps)."""
        self.check_health()
        data = self.encoder.encode(step)
        for actor in self._held.actors:
            ref = actor.execute.remote(data)
            if actor is self.output_actor and step.scheduled:
                self._outputs.append(ref)
            else:
                self._calls.append(ref)

    def collect(self) -> ModelRunnerOutput:
        """The output rank's reply to the oldest scheduled step; while waiting, every other
        call is checked (a dead rank leaves the others waiting in a collective)."""
        if not self._outputs:
            raise RuntimeError("collect() without a submitted step to collect")
        ref = self._outputs.popleft()
        ray = _import_ray()
        while not ray.wait([ref], timeout=LIVENESS_POLL_SECONDS)[0]:
            self.check_health()
        (result,) = [message for message in self._replies(self._get([ref]))
                     if isinstance(message, StepResult)]
        return result.output

    def take_kv_reports(self, wait_s: float = 0.0, poll: bool = False
                        ) -> list[KVConnectorOutput]:
        if poll:
            self.submit(ExecuteStep([], [], []))
        self.check_health()
        if not self._kv_reports and wait_s > 0 and self._calls:
            _import_ray().wait(self._calls, num_returns=1, timeout=wait_s, fetch_local=False)
            self.check_health()
        reports, self._kv_reports = self._kv_reports, []
        return reports

    def check_health(self) -> None:
        """Cheap (one local ray.wait over the calls in flight): a call that ended with an
        error means its actor died or its worker raised. The replies of those that ended
        are read for KV reports."""
        if self._failure is not None:
            raise WorkerDiedError(self._failure)
        if not self._calls:
            return
        ray = _import_ray()
        done, self._calls = ray.wait(self._calls, num_returns=len(self._calls), timeout=0,
                                     fetch_local=False)
        if done:
            self._replies(self._get(done))

    def _replies(self, values: list) -> list:
        """The messages of execute calls' return values; KV reports are kept."""
        messages = [self.reply_decoder.decode(data) for value in values for data in value]
        self._kv_reports.extend(message.output for message in messages
                                if isinstance(message, KVReport))
        return messages

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    # ---- Ray calls ------------------------------------------------------------------------
    def _get(self, refs: list) -> list:
        """ray.get, with every Ray failure (actor died, node lost, the worker raised) turned
        into WorkerDiedError, which every later call raises again."""
        ray = _import_ray()
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise self._fail(_describe_failure(ray, exc)) from exc

    def _fail(self, message: str) -> WorkerDiedError:
        """Remember the failure (every later call raises it; shutdown then kills the actors
        without asking them first: the others may be stuck in a collective)."""
        self._failure = message
        self._held.graceful = False
        return WorkerDiedError(message)

    def _gather(self, refs: list, timeout: float) -> list:
        """Every call's result, in order; the first failure raises at once (the other ranks
        may wait for the failed one forever)."""
        ray = _import_ray()
        deadline = time.monotonic() + timeout
        waiting = list(refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=len(waiting),
                                     timeout=LIVENESS_POLL_SECONDS, fetch_local=False)
            if done:
                self._get(done)
            if waiting and time.monotonic() > deadline:
                raise self._fail(f"{len(waiting)} Ray actor(s) did not answer in "
                                 f"{timeout:.0f}s")
        return self._get(refs)


# ---- placement ------------------------------------------------------------------------------
def _cpus_per_rank(ray, world_size: int) -> float:
    """KVSERVE_RAY_CPUS_PER_RANK, else one CPU per rank, or an equal share of the cluster's
    CPUs when it has fewer CPUs than ranks (a logical reservation: a rank's threads are set
    apart, see `_rank_config`). Rounded down to Ray's resource granularity, so that the shares
    add up to no more than the CPUs."""
    override = os.environ.get(CPUS_PER_RANK_ENV)
    if override:
        return float(override)
    total = ray.cluster_resources().get("CPU", 1.0)
    return math.floor(min(1.0, total / world_size) * 10_000) / 10_000


def _placement_group(ray, world_size: int, cpus: float):
    """One bundle per rank; bundle 0 on this node (the engine core's), so that with PACK every
    rank stays here when they fit. Waits until placed."""
    strategy = os.environ.get(STRATEGY_ENV, "PACK").upper()
    if strategy not in STRATEGIES:
        raise ValueError(f"{STRATEGY_ENV}={strategy!r}: use one of {', '.join(STRATEGIES)}")
    placed = _rank_resources(world_size)
    bundles = [{"CPU": cpus, **resources} for resources in placed]
    here = f"node:{ray.util.get_node_ip_address()}"
    if here in ray.cluster_resources() and not placed[0] and _this_node_cpus(ray) >= cpus:
        bundles[0][here] = 0.001
    group = ray.util.placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_SECONDS)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not place {world_size} ranks ({bundles[-1]} each, strategy {strategy}) "
            f"in {PLACEMENT_TIMEOUT_SECONDS:.0f}s; cluster resources: "
            f"{ray.cluster_resources()}. Lower {CPUS_PER_RANK_ENV} or add nodes "
            f"(`ray status` shows what is free)")
    return group


def _this_node_cpus(ray) -> float:
    """The CPUs Ray counts on the engine core's node: a head started with `--num-cpus 0` (it
    runs the servers and the router) gets no rank, so bundle 0 is not pinned there."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return float(node.get("Resources", {}).get("CPU", 0.0))
    return 0.0


def _rank_resources(world_size: int) -> list[dict[str, float]]:
    """KVSERVE_RAY_RANK_RESOURCES: custom Ray resources each rank's bundle asks for, a JSON
    object (every rank) or a list of one per rank, e.g. '[{"node_a": 0.01}, {"node_b": 0.01}]'
    with nodes started with `ray start --resources '{"node_a": 1}'`; none by default."""
    text = os.environ.get(RANK_RESOURCES_ENV, "").strip()
    if not text:
        return [{} for _ in range(world_size)]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{RANK_RESOURCES_ENV} is not JSON: {exc}") from exc
    per_rank = [value] * world_size if isinstance(value, dict) else value
    if (not isinstance(per_rank, list) or len(per_rank) != world_size
            or not all(isinstance(item, dict) for item in per_rank)):
        raise ValueError(f"{RANK_RESOURCES_ENV} must be a JSON object or a list of "
                         f"{world_size} objects (one per rank), got {text!r}")
    return [{str(name): float(amount) for name, amount in item.items()} for item in per_rank]


def _rank_config(config: EngineConfig, nodes: list[tuple[str, str, int, int]],
                 rank: int, core_node: str) -> EngineConfig:
    """The config a rank starts with: unless --num-threads is set, its node's cores shared by
    the ranks on that node (as mp shares one host's cores by its ranks); on another node than
    the engine core's, its KV sender listens on that node's IP (kv_ip names the core's host,
    or loopback, neither of which is the rank's)."""
    node_ip, node_id, node_cpus, _ = nodes[rank]
    if node_id != core_node:
        config = _with_kv_host(config, node_ip)
    if config.num_threads:
        return config
    ranks_here = sum(1 for _, other, _, _ in nodes if other == node_id)
    return dataclasses.replace(config, num_threads=max(1, node_cpus // ranks_here))


def _with_kv_host(config: EngineConfig, host: str) -> EngineConfig:
    """The config with its TCP KV transfer's kv_ip set to `host` (a wildcard kv_ip is kept:
    it binds every interface and advertises the node's address)."""
    from kvserve.kv_transfer.factory import DEFAULT_CONNECTOR

    transfer = config.transfer_config()
    if (transfer is None or transfer.connector != DEFAULT_CONNECTOR
            or transfer.host in ("0.0.0.0", "*")):
        return config
    raw = json.loads(config.kv_transfer_config) if config.kv_transfer_config else {}
    return dataclasses.replace(config, kv_transfer_config=json.dumps({**raw, "kv_ip": host}))


def _log_ready(config: EngineConfig, nodes: list[tuple[str, str, int, int]], cpus: float,
               init_method: str) -> None:
    ranks_by_node: dict[str, list[int]] = {}
    for rank, (ip, _, _, _) in enumerate(nodes):
        ranks_by_node.setdefault(ip, []).append(rank)
    logger.info("%d Ray actors ready (tensor parallel %d, pipeline parallel %d, %.4g CPUs "
                "reserved per rank, ranks by node %s, rendezvous %s)", len(nodes),
                config.tensor_parallel_size, config.pipeline_parallel_size, cpus,
                ranks_by_node, init_method)


def _tcp_address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def _describe_failure(ray, exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if exc.cause is not None else exc
        return f"a Ray worker failed: {type(cause).__name__}: {cause}"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"a Ray worker died ({type(exc).__name__}: {first_line})"


# ---- Ray itself, and what the executor holds ------------------------------------------------
def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the ray executor needs Ray: pip install 'kvserve[ray]'") from exc
    return ray


_ray_lock = threading.Lock()
_ray_users = 0  # executors of this process on a Ray instance this module started


def _acquire_ray(ray) -> bool:
    """Make sure Ray is up; True when the instance is ours (started here, for our executors).
    RAY_ADDRESS connects to a cluster (`ray start --head`); otherwise a local instance starts,
    quiet and without the dashboard."""
    global _ray_users
    with _ray_lock:
        if ray.is_initialized():
            if _ray_users:
                _ray_users += 1
                return True
            return False  # someone else's: theirs to stop
        address = os.environ.get("RAY_ADDRESS") or None
        options = dict(logging_level=logging.ERROR, log_to_driver=True)
        if address is None:
            ray.init(address="local", include_dashboard=False, **options)
            logger.info("started a local Ray instance (%s CPUs)",
                        ray.cluster_resources().get("CPU"))
        else:
            ray.init(address=address, **options)
            logger.info("connected to the Ray cluster at %s (%s CPUs)", address,
                        ray.cluster_resources().get("CPU"))
        _ray_users = 1
        return True


@dataclasses.dataclass(eq=False)
class _Held:
    """What an executor holds in Ray, for `_release` (kept apart from the executor so that its
    finalizer does not keep it alive)."""

    owns_ray: bool
    group: object = None
    actors: list = dataclasses.field(default_factory=list)
    pids: list = dataclasses.field(default_factory=list)
    graceful: bool = True


def _release(held: _Held) -> None:
    """Let healthy workers leave their group, kill every actor, free the placement group, and
    stop Ray when the last executor on an instance started here is done."""
    global _ray_users
    import ray

    if ray.is_initialized():
        actors, held.actors = held.actors, []
        if actors and held.graceful:
            try:
                ray.wait([actor.stop.remote() for actor in actors], num_returns=len(actors),
                         timeout=STOP_GRACE_SECONDS)
            except Exception:  # noqa: BLE001 - killing them below is what matters
                pass
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if held.group is not None:
            try:
                ray.util.remove_placement_group(held.group)
            except Exception:  # noqa: BLE001 - already removed with its cluster
                pass
            held.group = None
    if held.owns_ray:
        held.owns_ray = False
        with _ray_lock:
            _ray_users -= 1
            if _ray_users == 0 and ray.is_initialized():
                ray.shutdown()


__all__ = ["RayExecutor", "RayWorker"]
