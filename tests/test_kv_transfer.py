"""Disaggregated prefill/decode inside one test process: a prefill engine computes prompts and
holds their KV under a lease; a decode engine pulls it over TCP (ZeroMQ) and generates. Greedy
tokens equal one aggregated engine's on 16 prompts (fp32 and the default dtype); the decode
side reports the transferred tokens; both end with no blocks in use. Leases, the transport's
failures (layout mismatch, expired or unknown lease, a sender that never answers) and the
scheduler's handling of loads (others run meanwhile, aborts wait for the load, failures
recompute) are tested apart."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import zmq

from kvserve import SamplingParams
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine_config import EngineConfig
from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from kvserve.kv_transfer.config import KVTransferConfig, kv_transfer_config
from kvserve.kv_transfer.leases import LeaseTable
from kvserve.kv_transfer.tcp import KVSender, KVTransferError, pull_into
from kvserve.protocol.kv_transfer_params import KVTransferParams
from kvserve.protocol.worker import KVConnectorOutput, ModelRunnerOutput
from tests.helpers import run_until_finished, wait_engine_idle

PROMPTS = ([f"Session {i}: the quick brown fox jumps over the lazy dog. " * (1 + i % 4)
            for i in range(12)] + ["Hi", "x", "Paris is", "1, 2, 3,"])


# ---- config and leases -------------------------------------------------------------------
def test_vllm_kv_transfer_config_json_is_understood():
    config = kv_transfer_config(None, '{"kv_connector": "KVServeConnector", "kv_role": '
                                      '"kv_producer", "kv_ip": "10.0.0.5", "kv_port": 15000, '
                                      '"kv_connector_extra_config": {"hold_timeout_s": 5}}')
    assert (config.role, config.host, config.port, config.hold_timeout_s) == (
        "prefill", "10.0.0.5", 15000, 5)
    assert kv_transfer_config("decode", '{"kv_role": "kv_producer"}').role == "decode"
    assert kv_transfer_config(None, None) is None
    with pytest.raises(ValueError, match="NixlConnector"):
        kv_transfer_config(None, '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    with pytest.raises(ValueError, match="kv role"):
        EngineConfig(kv_role="sideways")


def test_leases_are_pulled_once_and_expire_unpulled():
    now = [0.0]
    leases = LeaseTable(clock=lambda: now[0])
    leases.hold("a", [1, 2], timeout_s=10)
    leases.hold("b", [3], timeout_s=10)
    assert leases.begin_pull("a") == [1, 2]
    assert leases.begin_pull("a") is None  # one pull per lease
    assert leases.take_releasable() == []  # still being read: never freed under a pull
    leases.end_pull("a")
    assert leases.take_releasable() == ["a"]
    now[0] = 11.0
    assert leases.begin_pull("b") is None  # expired: the puller must recompute
    assert leases.take_releasable() == ["b"] and leases.num_expired == 1 and len(leases) == 0


# ---- the TCP transport ---------------------------------------------------------------------
# per-layer pages without the block dimension: standard attention's K and V planes, and a
# single-plane page of another row width (a latent cache's shape) beside it
PAGES = {"standard": [(2, 4, 2, 8)] * 3, "mixed": [(2, 4, 2, 8), (1, 4, 1, 24), (2, 4, 1, 8)]}


def _caches(layers=3, blocks=8, fill=0.0, dtype=torch.float32, pages="standard"):
    return [torch.full((planes, blocks, *rest), fill, dtype=dtype) + torch.arange(
        blocks, dtype=dtype).view(1, blocks, 1, 1, 1) * (i + 1)
        for i, (planes, *rest) in enumerate(PAGES[pages][:layers])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_shm", [True, False])
@pytest.mark.parametrize("pages", ["standard", "mixed"])
def test_a_pull_moves_the_held_blocks(dtype, use_shm, pages):
    """Blocks move by id, through /dev/shm or frames, whatever each layer's page layout."""
    caches, leases = _caches(dtype=dtype, pages=pages), LeaseTable()
    sender = KVSender(caches, leases, "127.0.0.1", use_shm=use_shm)
    context = zmq.Context()
    target = _caches(dtype=dtype, fill=-7, pages=pages)
    before = [cache.clone() for cache in target]
    try:
        leases.hold("r", [5, 2, 6], timeout_s=10)
        assert pull_into(context, "127.0.0.1", sender.port, "r", target, [1, 3], 5) == 2
        for source, cache, old in zip(caches, target, before):
            assert torch.equal(cache[:, [1, 3]], source[:, [5, 2]])
            assert torch.equal(cache[:, [0, 2, 4]], old[:, [0, 2, 4]])  # the others stay
        assert not list(Path("/dev/shm").glob(f"kvserve-kv-{os.getpid()}-*"))  # unlinked
        with pytest.raises(KVTransferError, match="already pulled"):
            pull_into(context, "127.0.0.1", sender.port, "r", target, [1], 5)
        leases.hold("s", [1], timeout_s=10)
        with pytest.raises(KVTransferError, match="layouts differ"):
            pull_into(context, "127.0.0.1", sender.port, "s",
                      _caches(layers=2, dtype=dtype, pages=pages), [0], 5)
    finally:
        sender.close()
        context.term()


def test_a_sender_that_never_answers_is_a_timeout():
    silent = zmq.Context()
    socket = silent.socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    context = zmq.Context()
    started = time.monotonic()
    try:
        with pytest.raises(KVTransferError, match="no answer"):
            pull_into(context, "127.0.0.1", port, "r", _caches(), [0], 0.3)
        assert time.monotonic() - started < 3
    finally:
        socket.close(linger=0)
        silent.term()
        context.term()


# ---- the scheduler with a connector --------------------------------------------------------
class FakeConnector(KVConnectorBase):
    """The scheduler side only; loads end when the test reports them."""

    def __init__(self):
        super().__init__(KVTransferConfig(role="both"), KVConnectorRole.SCHEDULER,
                         KVConnectorContext(block_size=4))
        self.started: dict[str, list[int]] = {}
        self.held: dict[str, list[int]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        if params is not None and params.wants_load and not request.kv_load_attempted:
            return request.num_tokens - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        request.kv_load_attempted = True
        self.started[request.request_id] = block_ids

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params
        if params is not None and params.do_remote_decode and \
                request.status != RequestStatus.FINISHED_ABORTED:
            self.held[request.request_id] = block_ids
            return True, None
        return False, None

    def register_kv_caches(self, kv_caches):
        raise NotImplementedError  # no worker side here

    start_load_kv = get_finished = register_kv_caches


def _remote(request_id, prompt_len, max_tokens=3):
    params = KVTransferParams(do_remote_prefill=True, remote_request_id="p-" + request_id,
                              remote_block_ids=[0, 1], remote_host="h", remote_port=1,
                              num_prompt_tokens=prompt_len)
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.all_stop_token_ids = set()
    return Request(request_id, list(range(10, 10 + prompt_len)), sampling, max_tokens,
                   kv_transfer_params=params)


def _local(request_id, prompt_len):
    sampling = SamplingParams(max_tokens=3)
    sampling.all_stop_token_ids = set()
    return Request(request_id, list(range(50, 50 + prompt_len)), sampling, 3)


def _scheduler(connector, num_blocks=16):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_model_len=64),
                     KVCacheManager(num_blocks, 4), connector)


def test_loading_requests_wait_without_holding_up_others_then_run_one_token():
    connector = FakeConnector()
    scheduler = _scheduler(connector)
    scheduler.add_request(_remote("remote", 7))
    scheduler.add_request(_local("local", 5))
    first = scheduler.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["local"]
    assert connector.started["remote"] == scheduler.kv.block_ids("remote")
    assert scheduler.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    scheduler.update_connector_output(KVConnectorOutput(finished_recving=["remote"]))
    second = scheduler.schedule()
    item = next(s for s in second.scheduled if s.request.request_id == "remote")
    assert (item.start_position, item.num_new_tokens, item.sample) == (6, 1, True)
    assert scheduler.requests["remote"].num_transferred_tokens == 6


def test_a_failed_load_recomputes_and_an_aborted_one_frees_only_when_it_ends():
    connector = FakeConnector()
    scheduler = _scheduler(connector)
    scheduler.add_request(_remote("failed", 7))
    scheduler.add_request(_remote("aborted", 7))
    scheduler.schedule()
    used = scheduler.kv.pool.num_used_blocks
    scheduler.finish_request("aborted", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.pool.num_used_blocks == used  # the load still writes into them
    scheduler.update_connector_output(KVConnectorOutput(
        finished_recving=["failed", "aborted"], load_errors={"failed": "sender gone"}))
    output = scheduler.schedule()
    item = output.scheduled[0]
    assert item.request.request_id == "failed" and (item.start_position,
                                                     item.num_new_tokens) == (0, 7)
    assert scheduler.load_failures == [("failed", "sender gone")]
    assert scheduler.kv.block_ids("aborted") == []


def test_prefill_side_holds_blocks_until_released():
    connector = FakeConnector()
    scheduler = _scheduler(connector)
    request = _local("p", 6)
    request.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({"p": [1]}, {}))
    scheduler.finish_request("p", RequestStatus.FINISHED_LENGTH)
    assert connector.held["p"] and scheduler.kv.pool.num_used_blocks == 2
    assert scheduler.finish_request("p", RequestStatus.FINISHED_ABORTED) is None  # ignored
    assert scheduler.update_connector_output(KVConnectorOutput(finished_sending=["p"])) == 1
    assert scheduler.kv.pool.num_used_blocks == 0


# ---- two engines ---------------------------------------------------------------------------
def _leases(engine: LLMEngine) -> LeaseTable:
    """The leases of a one-rank engine's worker (its TcpConnector's worker side)."""
    return engine.engine_core.executor.worker.kv_connector.leases


@pytest.mark.parametrize("dtype, transport", [("float32", "shm"), ("float32", "tcp"),
                                              ("auto", "tcp")])
def test_disaggregated_tokens_equal_one_engine(tiny_model_dir, dtype, transport):
    """Both engines in this process: "shm" moves the blocks through /dev/shm, "tcp" as
    frames."""
    options = dict(model=str(tiny_model_dir), dtype=dtype, engine_core="thread",
                   num_kv_blocks=96, max_num_batched_tokens=64)
    kv_config = f'{{"kv_connector_extra_config": {{"transport": "{transport}"}}}}'
    engines = [LLMEngine(EngineConfig(**options)),
               LLMEngine(EngineConfig(kv_role="prefill", kv_transfer_config=kv_config,
                                      **options)),
               LLMEngine(EngineConfig(kv_role="decode", kv_transfer_config=kv_config,
                                      **options))]
    aggregated, prefill, decode = engines
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    try:
        for i, prompt in enumerate(PROMPTS):
            expected = run_until_finished(aggregated, f"a{i}", prompt, greedy)
            handed = run_until_finished(prefill, f"p{i}", prompt, first_token,
                          KVTransferParams(do_remote_decode=True))
            handle = handed.kv_transfer_params
            assert handle.do_remote_prefill and handle.remote_block_ids
            got = run_until_finished(decode, f"d{i}", prompt, greedy, handle)
            assert got.outputs[0].token_ids == expected.outputs[0].token_ids, prompt
            assert got.num_transferred_tokens == len(expected.prompt_token_ids) - 1
        assert wait_engine_idle(prefill) == 0 and wait_engine_idle(decode) == 0
        assert _leases(prefill).num_pulled == len(PROMPTS)
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_decode_engine_pulls_only_what_its_prefix_cache_lacks(tiny_model_dir):
    """The decode engine already holds a conversation's earlier turn: it takes those blocks from
    its prefix cache and pulls only the rest; the tokens are still one engine's."""
    options = dict(model=str(tiny_model_dir), dtype="float32", engine_core="thread",
                   num_kv_blocks=96)
    engines = [LLMEngine(EngineConfig(**options)),
               LLMEngine(EngineConfig(kv_role="prefill", **options)),
               LLMEngine(EngineConfig(kv_role="decode", **options))]
    aggregated, prefill, decode = engines
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    earlier = "System: you are a guide to rivers. User: name a long river. " * 3
    prompt = earlier + "Assistant: the Nile. User: and in Europe?"
    try:
        expected = run_until_finished(aggregated, "a", prompt, greedy)
        run_until_finished(decode, "earlier", earlier, greedy)  # the earlier turn, prefilled on decode
        handle = run_until_finished(prefill, "p", prompt, SamplingParams(max_tokens=1),
                      KVTransferParams(do_remote_decode=True)).kv_transfer_params
        got = run_until_finished(decode, "d", prompt, greedy, handle)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        num_prompt = len(expected.prompt_token_ids)
        assert got.num_cached_tokens >= 32  # whole blocks of the earlier turn
        assert got.num_transferred_tokens == num_prompt - 1 - got.num_cached_tokens > 0
        assert wait_engine_idle(prefill) == 0 and wait_engine_idle(decode) == 0
    finally:
        for engine in engines:
            engine.shutdown()


def test_unpulled_blocks_are_freed_after_the_hold_timeout(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", engine_core="thread",
                          num_kv_blocks=32, kv_role="prefill",
                          kv_transfer_config='{"kv_connector_extra_config": '
                                             '{"hold_timeout_s": 0.3}}')
    prefill = LLMEngine(config)
    try:
        run_until_finished(prefill, "p", "a prompt nobody pulls " * 4,
             SamplingParams(max_tokens=1), KVTransferParams(do_remote_decode=True))
        assert prefill.engine_core.kv_manager.pool.num_used_blocks > 0
        assert wait_engine_idle(prefill, timeout=5) == 0
        assert _leases(prefill).num_expired == 1
    finally:
        prefill.shutdown()


def test_a_dead_prefill_engine_makes_the_decode_side_recompute(tiny_model_dir):
    options = dict(model=str(tiny_model_dir), dtype="float32", engine_core="thread",
                   num_kv_blocks=32)
    aggregated = LLMEngine(EngineConfig(**options))
    decode = LLMEngine(EngineConfig(kv_role="decode", kv_transfer_config=(
        '{"kv_connector_extra_config": {"transfer_timeout_s": 0.5}}'), **options))
    silent = zmq.Context()
    socket = silent.socket(zmq.ROUTER)  # accepts the pull, never answers: a hung prefill side
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "the prefill engine died " * 3
    try:
        expected = run_until_finished(aggregated, "a", prompt, greedy).outputs[0].token_ids
        handle = KVTransferParams(do_remote_prefill=True, remote_request_id="gone",
                                  remote_block_ids=[0, 1], remote_host="127.0.0.1",
                                  remote_port=port)
        started = time.monotonic()
        got = run_until_finished(decode, "d", prompt, greedy, handle)
        assert got.outputs[0].token_ids == expected and got.num_transferred_tokens == 0
        assert time.monotonic() - started < 10
        assert wait_engine_idle(decode) == 0
    finally:
        socket.close(linger=0)
        silent.term()
        aggregated.shutdown()
        decode.shutdown()
