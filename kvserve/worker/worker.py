"""A worker: one rank's model shard (its pipeline stage's layers, its tensor-parallel slice of
them), its KV tensors and a ModelRunner, driven step by step by the engine core through an
executor. `Worker` is the rank itself, whatever holds it (the core's own process for `uni`, a
process for `mp`, a Ray actor for `ray`); `run_worker` is the process loop of the `mp` executor.

Started by the `mp` executor as `python -m kvserve.worker.worker IN OUT RANK WORLD INIT PARENT LOG`
with the EngineConfig as JSON on stdin. It joins the process group (torch.distributed, gloo on
CPU), loads its shard, reports ready, then runs each ExecuteStep it receives. Any exception is
fatal for the group (the other ranks would wait in a collective forever): it reports
WorkerFailed and exits, and the core fails with it. It also exits when the core goes away.

With a KV connector (`--kv-role` / `--kv-transfer-config`) each rank holds the connector's
worker side beside its KV tensors: every step starts its loads (`start_load_kv`) before the
model runs and asks what finished after it (`get_finished`), which goes back to the core as a
`KVReport` only when there is something.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import msgspec
import zmq

from kvserve.engine_config import EngineConfig
from kvserve.errors import UnsupportedArchitectureError
from kvserve.model_source import resolve_model
from kvserve.kv_transfer.aggregator import merge_reports
from kvserve.platform import exit_when_parent_dies
from kvserve.plugins import load_plugins
from kvserve.tokenizer import load_tokenizer
from kvserve.protocol.worker import (
    ExecuteStep,
    FromWorker,
    InitKVCache,
    KVCacheReady,
    KVConnectorOutput,
    KVReport,
    ScheduledData,
    StepResult,
    StopWorker,
    ToWorker,
    WorkerFailed,
    WorkerReady,
)
from kvserve.sample.logits_processor import (
    SAMPLING_DEVICE,
    ProcessorInit,
    load_processor_classes,
)
from kvserve.spec_decode.config import mtp_module_count, parse_speculative_config
from kvserve.spec_decode.proposal import ProposalStep
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.request_state import CachedRequestState, RunnerInput, ScheduledItem

logger = logging.getLogger(__name__)


class Worker:
    """One rank. Every rank gets every ExecuteStep, in order; `execute` returns the step's
    samples on the output rank (last stage, tensor rank 0) and None elsewhere."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str):
        from kvserve.distributed.parallel_state import output_rank
        from kvserve.platform import configure_threads
        from kvserve.worker.model_loading import load_engine_model

        load_plugins()
        self.config = config
        # before the model loads: a processor that cannot be imported fails the start at once
        self.processor_classes = load_processor_classes(config.logits_processors)
        self.rank = rank
        self.is_output_rank = rank == output_rank(config.tensor_parallel_size,
                                                  config.pipeline_parallel_size)
        self.grammar = None  # structured output's processor, on the rank that samples
        configure_threads(config.num_threads or max(1, (os.cpu_count() or 1) // world_size))
        self.parallel = None
        if world_size > 1:
            from kvserve.distributed.parallel_state import init_distributed

            self.parallel = init_distributed(
                rank, world_size, init_method, device=config.device,
                pipeline_parallel_size=config.pipeline_parallel_size)
            self.parallel = _with_expert_parallel(self.parallel, config)
        self.loaded = load_engine_model(config, self.parallel)
        if config.enable_lora:
            from kvserve.models.lora import ModelLoRA

            model = self.loaded.model
            model.lora = ModelLoRA(model, config.max_loras, config.max_lora_rank,
                                   model.activation_dtype)
        # speculative decoding's proposer runs here, on the rank that samples (made with the
        # KV cache: a draft model or MTP sizes its KV by the pool)
        self.spec = parse_speculative_config(config.speculative_config) \
            if self.is_output_rank else None
        self.mtp = self._load_mtp() if self.spec is not None and self.spec.method == "mtp" \
            else None
        self.proposer = None
        # EPLB: every rank re-places its experts at the same step (they all run every step)
        self.rebalance_every = config.eplb().step_interval if config.enable_eplb else 0
        self.log_balancedness = config.eplb().log_balancedness
        self.steps = 0
        self.requests: dict[str, CachedRequestState] = {}
        self.runner = None
        self.kv_connector = _make_kv_connector(config, rank)
        self._kv_report: KVConnectorOutput | None = None  # finished since the core last asked

    def _count_step(self, ran: bool) -> None:
        """EPLB's clock: steps that ran the model; each `rebalance_every`-th rebalances."""
        if not ran or not self.rebalance_every:
            return
        self.steps += 1
        if self.steps % self.rebalance_every == 0:
            start = time.perf_counter()
            moved = self.loaded.model.rebalance_experts()
            logger.info("EPLB at step %d: %d mixture layers re-placed their experts in %.3fs",
                        self.steps, moved, time.perf_counter() - start)
            if self.log_balancedness:
                logger.info("EPLB balancedness (mean / max tokens a rank took, per layer, "
                            "placement before -> after): %s", self.loaded.model.balancedness())

    def _load_mtp(self):
        """The checkpoint's MTP modules the `mtp` proposer drafts with."""
        from kvserve.spec_decode.mtp import load_mtp_modules

        if self.config.streaming_window is not None:
            raise UnsupportedArchitectureError(
                "speculative_config: MTP drafts with attention sinks' window "
                "(--streaming-window) are not built (the window's positions are not the "
                "tokens')")
        model = self.loaded.model
        count = mtp_module_count(model.full_config.num_nextn_predict_layers,
                                 self.spec.num_speculative_tokens)
        return load_mtp_modules(model, resolve_model(self.config.model), count)

    def _make_proposer(self, num_blocks: int, block_size: int):
        from kvserve.spec_decode.proposers import ProposerContext, make_worker_proposer

        config, loaded = self.config, self.loaded
        return make_worker_proposer(self.spec, ProposerContext(
            vocab_size=loaded.config.vocab_size, model_source=resolve_model(config.model),
            dtype=loaded.dtype, kv_dtype=loaded.kv_dtype, device=config.device,
            attention_backend=config.attention_backend, use_cpu_kernels=config.cpu_kernels,
            quantization=config.quantization, block_size=block_size, num_blocks=num_blocks,
            max_num_seqs=config.max_num_seqs, model=loaded.model, mtp=self.mtp))

    def ready_message(self) -> WorkerReady:
        from kvserve.kernels.reference import kv_dtype_name
        from kvserve.worker.model_loading import kv_page_bytes

        loaded = self.loaded
        return WorkerReady(self.rank, loaded.config, str(loaded.dtype).removeprefix("torch."),
                           kv_dtype_name(loaded.kv_dtype), loaded.quantization,
                           kv_page_bytes(loaded.model, loaded.kv_dtype))

    def init_kv_cache(self, message: InitKVCache) -> KVCacheReady:
        self.runner = ModelRunner(self.loaded.model, message.num_blocks, message.block_size,
                                  self.config.device, self.config.seed,
                                  kv_dtype=self.loaded.kv_dtype, parallel=self.parallel,
                                  samples=self.is_output_rank,
                                  logits_processors=self._logits_processors(),
                                  placement=(message.layer_groups, message.layer_tensors),
                                  streaming_sink_blocks=self.config.streaming_sink_blocks)
        if self.spec is not None:
            self.proposer = self._make_proposer(message.num_blocks, message.block_size)
            self.runner.keep_forward = self.proposer.keeps_forward
        connector = self.kv_connector
        if connector is None:
            return KVCacheReady(self.rank)
        from kvserve.kv_transfer.base import uses_layer_hooks

        connector.register_kv_caches(self.runner.kv_caches)
        if uses_layer_hooks(connector):
            self.loaded.model.bind_kv_connector(connector)
        return KVCacheReady(self.rank, connector.get_handshake_metadata())

    def _logits_processors(self) -> list:
        """The grammar mask (structured output) and the custom logits processors, built once,
        on the rank that samples."""
        if not self.is_output_rank:
            return []
        from kvserve.structured_output.compiler import shared_compiler
        from kvserve.structured_output.processor import GrammarProcessor

        vocab_size = self.loaded.config.vocab_size
        init = ProcessorInit(vocab_size, self.config.max_num_seqs, SAMPLING_DEVICE)
        ops = self.loaded.model.kernel_ops  # None: torch's ops throughout
        model = self.config.model
        compiler = shared_compiler(model, vocab_size,
                                   lambda: load_tokenizer(resolve_model(model)))
        self.grammar = GrammarProcessor(compiler, ops.apply_token_bitmask_ if ops else None)
        return [self.grammar, *(cls(init) for cls in self.processor_classes)]

    def execute(self, step: ExecuteStep) -> StepResult | None:
        """One step: the connector's loads start, the model runs, the connector's finished
        transfers are noted for `take_kv_report`."""
        connector = self.kv_connector
        if connector is None:
            return self.execute_model(step)
        metadata = None
        if step.kv_connector_metadata is not None:
            metadata = msgspec.msgpack.decode(step.kv_connector_metadata,
                                              type=connector.metadata_type)
        connector.start_load_kv(metadata)
        try:
            return self.execute_model(step)
        finally:
            connector.wait_for_save()
            self._note_finished(step.finished_ids)

    def execute_model(self, step: ExecuteStep) -> StepResult | None:
        # first: a new request may reuse the id of one that finished in the step before
        for request_id in step.finished_ids:
            self.requests.pop(request_id, None)
            if self.proposer is not None:
                self.proposer.finish(request_id)
        if step.lora_loads or step.lora_unloads:
            self._update_loras(step)
        for new in step.new_requests:  # a request sent again (a re-run alone) keeps its state
            if new.request_id not in self.requests:
                self.requests[new.request_id] = CachedRequestState.from_new(new)
                if self.grammar is not None:  # its grammar compiles beside the prefill
                    self.grammar.prefetch(new.params)
        scheduled = [self._scheduled(item) for item in step.scheduled]
        output = self.runner.execute(RunnerInput(scheduled, step.finished_ids))
        self._count_step(bool(step.scheduled))
        if not self.is_output_rank or not step.scheduled:  # the core waits for nothing else
            return None
        for request_id, tokens in output.sampled_token_ids.items():
            request = self.requests[request_id]
            request.output_token_ids.extend(tokens)
            request.all_token_ids.extend(tokens)
        if self.proposer is not None:
            self._propose(step, output)
        if step.report_expert_counts:
            output.expert_counts = self.runner.model.expert_counts()
        return StepResult(output)

    def _update_loras(self, step: ExecuteStep) -> None:
        """Drop the adapters no request runs any more, then load the new ones into slots."""
        from kvserve.models.lora import read_peft_adapter

        lora = self.runner.model.lora
        for lora_id in step.lora_unloads:
            lora.remove(lora_id)
        for load in step.lora_loads:
            lora.add(load.lora_id, read_peft_adapter(load.path, lora.max_rank))

    def _propose(self, step: ExecuteStep, output) -> None:
        """The proposer's drafts for the requests that sampled, as many as the core allowed,
        into the step's output (with the drafting forwards, which the core prices)."""
        output.draft_token_ids = self.proposer.propose(ProposalStep(
            self.requests, output.sampled_token_ids, step.draft_limits,
            self.runner.last_forward))
        output.draft_forwards = self.proposer.take_forwards()
        self.runner.last_forward = None

    # ---- the KV connector's reports --------------------------------------------------------
    def _note_finished(self, finished_ids: list[str]) -> None:
        sending, recving = self.kv_connector.get_finished(finished_ids)
        if sending or recving:
            report = KVConnectorOutput(sorted(sending), sorted(recving),
                                       self.kv_connector.get_load_errors())
            self._kv_report = merge_reports([r for r in (self._kv_report, report) if r])

    def take_kv_report(self) -> KVReport | None:
        """What the connector finished since the last call (sent to the core after a step)."""
        report, self._kv_report = self._kv_report, None
        return None if report is None else KVReport(self.rank, report)

    def poll_kv(self, wait_s: float = 0.0) -> KVReport | None:
        """Between steps, for a core in this process (`uni`): what finished, waiting up to
        `wait_s` for something when nothing has."""
        if self.kv_connector is None:
            return None
        self._note_finished([])
        if self._kv_report is None and wait_s > 0:
            self.kv_connector.wait_for_finished(wait_s)
            self._note_finished([])
        return self.take_kv_report()

    def _scheduled(self, item: ScheduledData) -> ScheduledItem:
        request = self.requests[item.request_id]
        if item.reset_blocks:
            request.block_ids = list(item.new_block_ids)
            request.group_block_ids = [list(table) for table in item.new_group_block_ids]
        else:
            request.block_ids.extend(item.new_block_ids)
            missing = len(item.new_group_block_ids) - len(request.group_block_ids)
            request.group_block_ids += [[] for _ in range(missing)]  # a new request's tables
            for table, added in zip(request.group_block_ids, item.new_group_block_ids):
                table.extend(added)
        return ScheduledItem(request, item.token_ids, item.start_position, item.sample,
                             item.num_draft_tokens)

    def shutdown(self) -> None:
        if self.grammar is not None:
            self.grammar.compiler.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.parallel is not None:
            from kvserve.distributed.parallel_state import destroy_distributed

            destroy_distributed(self.parallel)


def _make_kv_connector(config: EngineConfig, rank: int):
    """This rank's side of the engine's KV connector, or None without one."""
    kv_config = config.transfer_config()
    if kv_config is None:
        return None
    from kvserve.kv_transfer.base import KVConnectorContext, KVConnectorRole
    from kvserve.kv_transfer.factory import make_connector

    return make_connector(kv_config, KVConnectorRole.WORKER, KVConnectorContext(
        config.block_size, config.tensor_parallel_size, config.pipeline_parallel_size, rank))


def run_worker(config: EngineConfig, input_address: str, output_address: str, rank: int,
               world_size: int, init_method: str) -> None:
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    worker = None
    try:
        worker = Worker(config, rank, world_size, init_method)
        outputs.send(encoder.encode(worker.ready_message()))
        while True:
            message = decoder.decode(inputs.recv(copy=False).buffer)
            if isinstance(message, StopWorker):
                break
            if isinstance(message, InitKVCache):
                reply = worker.init_kv_cache(message)
            else:
                reply = worker.execute(message)
            if reply is not None:
                outputs.send(encoder.encode(reply), copy=False)
            report = worker.take_kv_report()
            if report is not None:
                outputs.send(encoder.encode(report), copy=False)
    except BaseException as exc:  # reported, then fatal: see the module docstring
        logger.exception("worker %d failed", rank)
        outputs.send(encoder.encode(WorkerFailed(rank, f"{type(exc).__name__}: {exc}")))
        outputs.close()
        context.term()
        os._exit(1)  # skip torch.distributed teardown: the other ranks may be mid-collective
    if worker is not None:
        worker.shutdown()
    outputs.close()
    inputs.close(linger=0)
    context.term()


def _with_expert_parallel(parallel, config: EngineConfig):
    """The rank's context with expert parallelism as the options ask (the experts split over
    the tensor-parallel group, EPLB's redundant copies among them)."""
    if not config.enable_expert_parallel:
        return parallel
    import dataclasses

    redundant = config.eplb().num_redundant_experts if config.enable_eplb else 0
    return dataclasses.replace(parallel, expert_parallel=True, redundant_experts=redundant)


def main(argv: list[str]) -> None:
    input_address, output_address, rank, world_size, init_method, parent, log_level = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_parent_dies(int(parent))
    logging.basicConfig(level=int(log_level),
                        format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: "
                               f"%(message)s")
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    run_worker(config, input_address, output_address, int(rank), int(world_size), init_method)


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["FromWorker", "Worker", "run_worker"]
