"""The KV connector interface (kvserve/kv_transfer/base.py) apart from the P/D transfer's own
behaviour (tests/test_kv_transfer.py): every rank's reports merged, the block pool's
evictions reaching a connector that asks, tokens a connector loads within the step, connectors
by name ("module:Class" too), a layer-wise connector's hooks called by a real engine, the
handle of a prefill engine with several ranks, a pull that comes before its lease; and
prefill -> decode through the `mp` executor (one rank, tensor parallel 2, pipeline parallel 2
on both sides; the `ray` executor at tensor parallel 2) giving one engine's greedy tokens."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from kvserve import SamplingParams
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine_config import EngineConfig
from kvserve.kv_transfer.aggregator import KVOutputAggregator
from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from kvserve.kv_transfer.config import KVTransferConfig, kv_transfer_config
from kvserve.kv_transfer.connector import TcpConnector
from kvserve.kv_transfer.factory import connector_class, make_connector
from kvserve.kv_transfer.leases import LeaseTable
from kvserve.kv_transfer.tcp import KVSender, pull_into
from kvserve.protocol.kv_transfer_params import KVTransferParams, parse_kv_transfer_params
from kvserve.protocol.worker import KVConnectorOutput, ModelRunnerOutput
from tests.helpers import bounded, run_until_finished, wait_engine_idle

BLOCK = 4


class SchedulerSideConnector(KVConnectorBase):
    """A scheduler side that offers `external` tokens of every request synchronously (within
    the step) and records what it is told."""

    def __init__(self, config=None, role=KVConnectorRole.SCHEDULER, context=None, external=0):
        super().__init__(config or KVTransferConfig(role="both"), role,
                         context or KVConnectorContext(BLOCK))
        self.external = external
        self.allocated: dict[str, tuple[list[int], int]] = {}
        self.evicted: list[tuple[list[int], list[int]]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.external, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, block_ids):
        return False, None

    def register_kv_caches(self, kv_caches):
        raise NotImplementedError  # no worker side here

    start_load_kv = get_finished = register_kv_caches


class EvictionRecorder(SchedulerSideConnector):
    def on_evict(self, block_hashes, block_ids):
        self.evicted.append((block_hashes, block_ids))


def _request(request_id, tokens, max_tokens=2):
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.all_stop_token_ids = set()
    return Request(request_id, list(tokens), sampling, max_tokens)


def _run_alone(scheduler, request):
    """Schedule the request until it finishes (one sampled token per step)."""
    scheduler.add_request(request)
    for _ in bounded(1000, f"request {request.request_id}"):
        if request.is_finished:
            break
        output = scheduler.schedule()
        scheduler.update_from_output(output, ModelRunnerOutput(
            {item.request.request_id: [7] for item in output.scheduled if item.sample}, {}))


# ---- unit: no model ------------------------------------------------------------------------
def test_a_transfer_is_done_once_every_rank_reported_it():
    aggregator = KVOutputAggregator(world_size=2)
    assert aggregator.aggregate([KVConnectorOutput(finished_recving=["a", "b"],
                                                   finished_sending=["p"])]) is None
    done = aggregator.aggregate([KVConnectorOutput(finished_recving=["a"],
                                                   load_errors={"a": "rank 1 timed out"})])
    assert done.finished_recving == ["a"] and done.load_errors == {"a": "rank 1 timed out"}
    done = aggregator.aggregate([KVConnectorOutput(finished_sending=["p"]),
                                 KVConnectorOutput(finished_recving=["b"])])
    assert (done.finished_sending, done.finished_recving, done.load_errors) == (["p"], ["b"], {})
    assert aggregator.aggregate([]) is None


def test_evictions_reach_a_connector_that_asks_once_per_step():
    """Cached blocks dropped by reuse come to `on_evict` (hash and block id) at the next
    schedule, before its metadata is built; without a consumer the pool records nothing."""
    connector = EvictionRecorder()
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                          KVCacheManager(6, BLOCK), connector)
    _run_alone(scheduler, _request("a", range(100, 108)))  # 2 full blocks cached, 1 free
    cached = dict(scheduler.kv.pool.cached)
    assert len(cached) == 2 and connector.evicted == []
    _run_alone(scheduler, _request("b", range(200, 220)))  # all 6 blocks: evicts a's
    hashes = [h for batch, _ in connector.evicted for h in batch]
    block_ids = [b for _, batch in connector.evicted for b in batch]
    assert sorted(hashes) == sorted(cached) and sorted(block_ids) == sorted(
        block.block_id for block in cached.values())
    assert scheduler.kv.pool.evictions == []  # drained

    plain = Scheduler(SchedulerConfig(), KVCacheManager(6, BLOCK), SchedulerSideConnector())
    assert plain.kv.pool.evictions is None and plain.kv.pool.take_evictions() == []


def test_tokens_loaded_within_the_step_count_as_computed():
    """A connector that offers tokens synchronously: the request computes only the rest in
    its first step (one token at least), and the connector learns its blocks."""
    connector = SchedulerSideConnector(external=100)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                          KVCacheManager(16, BLOCK), connector)
    request = _request("r", range(10, 20))
    scheduler.add_request(request)
    item = scheduler.schedule().scheduled[0]
    assert (item.start_position, item.num_new_tokens, item.sample) == (9, 1, True)
    assert connector.allocated["r"] == (scheduler.kv.block_ids("r"), 9)
    assert request.num_transferred_tokens == 9


def test_connectors_by_name():
    assert connector_class("TcpConnector") is TcpConnector
    assert kv_transfer_config(None, '{"kv_connector": "KVServeConnector", "kv_role": '
                                    '"kv_both"}').connector == "TcpConnector"
    config = kv_transfer_config(None, '{"kv_connector": "EvictionRecorder", '
                                      '"kv_connector_module_path": "tests.test_kv_connector", '
                                      '"kv_role": "kv_both", "kv_connector_extra_config": '
                                      '{"tier_bytes": 1024}}')
    assert config.connector == "tests.test_kv_connector:EvictionRecorder"
    assert config.extra_config == {"tier_bytes": 1024}
    built = make_connector(config, KVConnectorRole.SCHEDULER, KVConnectorContext(BLOCK))
    assert type(built).__name__ == "EvictionRecorder" and built.config is config
    with pytest.raises(ValueError, match="not a kvserve connector"):
        kv_transfer_config(None, '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}')
    with pytest.raises(ValueError, match="cannot import"):
        connector_class("tests.no_such_module:Connector")


def test_a_prefill_engine_with_several_ranks_names_each_ranks_sender():
    """The handle carries one address per rank; a decode engine of another parallel layout
    refuses it (the workers report the load failed, so it recomputes or fails)."""
    prefill = TcpConnector(KVTransferConfig(role="prefill"), KVConnectorRole.SCHEDULER,
                           KVConnectorContext(BLOCK, tensor_parallel_size=2))
    prefill.set_handshake_metadata([{"host": "10.0.0.1", "port": 5000},
                                    {"host": "10.0.0.1", "port": 5001}])
    request = _request("p", range(10, 19))
    request.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    request.status = RequestStatus.FINISHED_LENGTH
    delay, handle = prefill.request_finished(request, [3, 4, 5])
    assert delay and (handle.remote_host, handle.remote_port) == ("10.0.0.1", 5000)
    assert handle.remote_addresses == [("10.0.0.1", 5000), ("10.0.0.1", 5001)]
    assert (handle.tp_size, handle.pp_size) == (2, 1)
    assert [serve.block_ids for serve in prefill.build_connector_meta(None).serves] == [[3, 4, 5]]
    assert prefill.build_connector_meta(None) is None  # sent once

    decode = TcpConnector(KVTransferConfig(role="decode"), KVConnectorRole.SCHEDULER,
                          KVConnectorContext(BLOCK))
    wanting = _request("d", range(10, 19))
    wanting.kv_transfer_params = parse_kv_transfer_params(handle.to_json())  # as over HTTP
    assert decode.get_num_new_matched_tokens(wanting, 0) == (9, True)
    decode.update_state_after_alloc(wanting, [0, 1, 2], 9)
    (load,) = decode.build_connector_meta(None).loads
    assert "tensor x pipeline parallel 2x1" in load.error and "1x1" in load.error
    assert decode.get_num_new_matched_tokens(wanting, 0) == (0, False)  # asked once


def test_a_pull_that_comes_before_its_lease_waits_for_it():
    """The decode engine may pull before the prefill rank heard of the lease (it hears a
    step later): the sender answers once the lease comes; an unknown one is refused after
    the wait, a pulled one at once."""
    caches = [torch.arange(2 * 8 * 4 * 2 * 8, dtype=torch.float32).view(2, 8, 4, 2, 8)]
    leases = LeaseTable()
    sender = KVSender(caches, leases, "127.0.0.1", use_shm=False, transfer_timeout_s=0.5)
    context = zmq.Context()
    target = [torch.zeros_like(caches[0])]
    timer = threading.Timer(0.2, leases.hold, ("late", [6], 10))
    try:
        timer.start()
        assert pull_into(context, "127.0.0.1", sender.port, "late", target, [1], 5) == 1
        assert torch.equal(target[0][:, 1], caches[0][:, 6])
        assert leases.take_releasable() == ["late"]
        started = time.monotonic()
        with pytest.raises(Exception, match="no KV held"):
            pull_into(context, "127.0.0.1", sender.port, "never", target, [1], 5)
        assert 0.4 < time.monotonic() - started < 3
        started = time.monotonic()
        with pytest.raises(Exception, match="no KV held"):
            pull_into(context, "127.0.0.1", sender.port, "late", target, [1], 5)
        assert time.monotonic() - started < 0.3
    finally:
        timer.cancel()
        sender.close()
        context.term()


# ---- a layer-wise connector in a real engine -------------------------------------------------
class RecordingConnector(KVConnectorBase):
    """Moves nothing; its worker side records the calls a layer-wise connector gets."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, block_ids):
        return False, None

    def register_kv_caches(self, kv_caches):
        self.calls.append(("register", len(kv_caches)))

    def start_load_kv(self, metadata):
        self.calls.append(("start", metadata))

    def wait_for_layer_load(self, layer):
        self.calls.append(("wait", layer))

    def save_kv_layer(self, layer, kv_cache, attn_metadata):
        self.calls.append(("save", layer, tuple(kv_cache.shape)))

    def wait_for_save(self):
        self.calls.append(("saved",))

    def get_finished(self, finished_req_ids):
        self.calls.append(("finished",))
        return set(), set()


def test_a_layer_wise_connectors_hooks_run_around_every_layer(tiny_model_dir):
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", engine_core="thread", num_kv_blocks=32,
        kv_transfer_config='{"kv_connector": "tests.test_kv_connector:RecordingConnector", '
                           '"kv_role": "kv_both"}'))
    try:
        calls = engine.engine_core.executor.worker.kv_connector.calls  # the uni worker's
        num_layers = engine.engine_core.model_config.num_hidden_layers
        assert calls == [("register", num_layers)]
        calls.clear()
        engine.add_prepared(engine.prepare_request("r", "Hello there", SamplingParams(
            temperature=0, max_tokens=1)))
        for _ in bounded(100, "the request"):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        start = calls.index(("start", None))  # (a uni core also asks get_finished between)
        first = calls[start:calls.index(("saved",)) + 2]
        per_layer = [call for call in first if call[0] in ("wait", "save")]
        assert first[-2:] == [("saved",), ("finished",)]
        assert [call[:2] for call in per_layer] == [
            (kind, layer) for layer in range(num_layers) for kind in ("wait", "save")]
        assert per_layer[1][2][0] == 2  # the layer's [2, blocks, ...] KV tensor
    finally:
        engine.shutdown()


# ---- through the mp executor ---------------------------------------------------------------
PROMPTS = [f"Session {i}: the quick brown fox jumps over the lazy dog. " * (1 + i % 3)
           for i in range(5)] + ["Paris is"]


@pytest.fixture(scope="module")
def expected_tokens(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                    engine_core="thread", num_kv_blocks=64))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        return [run_until_finished(engine, f"a{i}", prompt, greedy).outputs[0].token_ids
                for i, prompt in enumerate(PROMPTS)]
    finally:
        engine.shutdown()


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend, tp, pp", [("mp", 1, 1), ("mp", 2, 1), ("mp", 1, 2),
                                             ("ray", 2, 1)])
def test_disaggregated_through_worker_processes_equals_one_engine(
        tiny_model_dir, expected_tokens, monkeypatch, backend, tp, pp):
    """Both engines' workers in processes of their own (mp) or Ray actors: each rank serves
    (prefill) or pulls (decode) its own shard of every request's blocks; tokens equal one
    single-process engine's."""
    if backend == "ray":
        pytest.importorskip("ray")
        # two engines of two ranks on a local Ray of 2 CPUs (tests' machines)
        monkeypatch.setenv("KVSERVE_RAY_CPUS_PER_RANK", "0.5")
    options = dict(model=str(tiny_model_dir), dtype="float32", engine_core="thread",
                   num_kv_blocks=64, max_num_batched_tokens=64, tensor_parallel_size=tp,
                   pipeline_parallel_size=pp, distributed_executor_backend=backend)
    prefill = LLMEngine(EngineConfig(kv_role="prefill", **options))
    decode = None
    try:
        decode = LLMEngine(EngineConfig(kv_role="decode", **options))
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, (prompt, expected) in enumerate(zip(PROMPTS, expected_tokens)):
            handle = run_until_finished(prefill, f"p{i}", prompt, SamplingParams(max_tokens=1),
                                        KVTransferParams(do_remote_decode=True)
                                        ).kv_transfer_params
            assert len(handle.remote_addresses) == tp * pp
            got = run_until_finished(decode, f"d{i}", prompt, greedy, handle)
            assert got.outputs[0].token_ids == expected, (tp, pp, prompt)
            assert got.num_transferred_tokens == len(got.prompt_token_ids) - 1
        assert wait_engine_idle(prefill, 10) == 0 and wait_engine_idle(decode, 10) == 0
    finally:
        for engine in (prefill, decode):
            if engine is not None:
                engine.shutdown()
